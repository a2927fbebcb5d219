"""Runs' every stage through the `fsdp-jax` entry, in one process (tests/test_run_matrix.py).

    python tests/run_chain.py RUN_DIR STRATEGY STAGES CONFIG [key=value ...]
    python tests/run_chain.py --chains CHAINS.json

STAGES: comma-separated, of train (2 steps: eval at step 2, the text sample, the final
checkpoint), resume (the same command at 3 steps), hf (export --hf), peft (export --peft),
out (export --out), verify (one step under STRATEGY vs one device), plan (STRATEGY on 8
devices). Prints one JSON line last: {stage: [exit code, seconds]}; a stage's stdout and
stderr pass through. The process boundary is not what is tested, so a combination's stages
share one process (one Python and JAX start-up).

`--chains`: a JSON list of {run_dir, strategy, stages, config, overrides}, every chain run in
turn in this one process (one start-up for them all); each chain's stdout and stderr (its
file descriptors, so XLA's and absl's lines too) go to RUN_DIR.log, and a stage that raises
is logged with its traceback and counted as exit code "raised". Prints one JSON line last:
{run_dir: {stage: [exit code, seconds]}}."""

import json
import os
import sys
import time
import traceback

from fsdp_jax.app.cli.entry import main as fsdp_jax


def chain(run_dir: str, strategy: str, stages: list[str], config: str, overrides: list[str]) -> dict:
    train = ["train", "--config", config, "--no-progress", *overrides, f"run_dir={run_dir}"]
    cmds = {
        "train": [*train, "train.steps=2"],
        "resume": [*train, "train.steps=3"],
        "hf": ["export", run_dir, "--hf", f"{run_dir}/hf"],
        "peft": ["export", run_dir, "--peft", f"{run_dir}/peft"],
        "out": ["export", run_dir, "--out", f"{run_dir}/model.safetensors"],
        "verify": ["verify", "--config", f"{run_dir}/config.yaml", "--strategies", strategy, "--steps", "1"],
        "plan": ["plan", "--config", f"{run_dir}/config.yaml", "--devices", "8", "--strategies", strategy],
    }
    done = {}
    for stage in stages:
        t = time.perf_counter()
        print(f"=== {stage}: fsdp-jax {' '.join(cmds[stage])}", flush=True)
        try:
            rc = fsdp_jax(cmds[stage])
        except SystemExit as e:
            rc = e.code
        except Exception:  # noqa: BLE001 - one chain's failure must not end the others' (--chains)
            traceback.print_exc()
            rc = "raised"
        done[stage] = [rc, round(time.perf_counter() - t, 2)]
        sys.stdout.flush()
        sys.stderr.flush()
    return done


def chains(specs: list[dict]) -> dict:
    """Every chain of `specs` in turn, its file descriptors 1 and 2 on RUN_DIR.log."""
    out = {}
    saved = os.dup(1), os.dup(2)
    try:
        for s in specs:
            sys.stdout.flush()
            sys.stderr.flush()
            with open(f"{s['run_dir']}.log", "wb") as log:
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                try:
                    out[s["run_dir"]] = chain(s["run_dir"], s["strategy"], s["stages"], s["config"], s["overrides"])
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os.dup2(saved[0], 1)
                    os.dup2(saved[1], 2)
    finally:
        os.close(saved[0])
        os.close(saved[1])
    return out


if __name__ == "__main__":
    if sys.argv[1] == "--chains":
        with open(sys.argv[2]) as f:
            print(json.dumps(chains(json.load(f))), flush=True)
    else:
        run_dir, strategy, stages, config, *overrides = sys.argv[1:]
        print(json.dumps(chain(run_dir, strategy, stages.split(","), config, overrides)), flush=True)
