"""One run's every stage through the `fsdp-jax` entry, in one process (tests/test_run_matrix.py).

    python tests/run_chain.py RUN_DIR STRATEGY STAGES CONFIG [key=value ...]

STAGES: comma-separated, of train (2 steps: eval at step 2, the text sample, the final
checkpoint), resume (the same command at 3 steps), hf (export --hf), peft (export --peft),
out (export --out), verify (one step under STRATEGY vs one device), plan (STRATEGY on 8
devices). Prints one JSON line last: {stage: [exit code, seconds]}; a stage's stdout and
stderr pass through. The process boundary is not what is tested, so a combination's stages
share one process (one Python and JAX start-up)."""

import json
import sys
import time

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
        done[stage] = [rc, round(time.perf_counter() - t, 2)]
        sys.stdout.flush()
        sys.stderr.flush()
    return done


if __name__ == "__main__":
    run_dir, strategy, stages, config, *overrides = sys.argv[1:]
    print(json.dumps(chain(run_dir, strategy, stages.split(","), config, overrides)), flush=True)
