"""The trainer's `offload: optimizer+params:nvme` run against the same run without offload (issue 61).

In one process, on the CPU devices FSDP_JAX_CPU_DEVICES gives (default 8): the tiny run of
tests/helpers.py (2 layers, d_model 64, batch 16 x 32, remat dots, AdamW with clip_norm 1.0, 4
steps, eval at 2 and 4, checkpoints at 2 and 4, an 8-token sample) without offload and with the
params on disk; `--resume`: again with the params on disk, stopped after step 2 and launched
again (resuming from the step-2 checkpoint, the files rebuilt from it); `--microbatches K`: the
pair again with train.microbatches=K; `--packed DIR`: the pair again on a packed corpus of
32-token rows (fsdp_jax.app.data.sft; any data.document_mask override dropped); `--pair-with
KEY=VALUE` (repeatable): the pair again with those overrides. A preference run: `--corpus` a
.jsonl of {prompt, chosen, rejected} rows with `objective=simpo` (or orpo) among the overrides. Prints one JSON document: per run its metrics.jsonl rows
and stdout, per nvme run its final checkpoint's leaves that differ from its reference run's
(largest difference relative to the leaf's largest value; the reference is the run without
offload, for the resumed run the straight run with the params on disk), the files in the nvme run's dir.

    PYTHONPATH=. JAX_PLATFORMS=cpu FSDP_JAX_CPU_DEVICES=1 python benchmarks/nvme_params_run.py \\
        --corpus DIR --out DIR [--resume] [--microbatches 2] [--packed DIR] [--pair-with k=v ...] [key=value ...]

`--corpus`: a prepared token corpus (tests/helpers.synthetic_corpus writes one; with
data.document_mask=true it needs an `eos_id` in its meta.json). Run on XLA's default flags to
compare with docs/offload.md ("Params on disk"), and under bf16 compute also with
XLA_FLAGS=--xla_allow_excess_precision=false (why: that page); tests/test_nvme_params.py runs this
in a child.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

RUN = [
    "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
    "model.max_seq_len=32", "data.seq_len=32", "train.global_batch=16", "train.log_every=1", "data.source=none",
    "optimizer.warmup_steps=2", "train.steps=4", "train.checkpoint_every=2", "train.eval_every=2",
    "train.eval_batches=1", "train.sample_tokens=8",
]  # fmt: skip
NVME = "optimizer+params:nvme"


def _launch(out: Path, name: str, overrides: list[str], stop_after: int | None = None) -> str:
    """stdout of one train run `name` (the CLI's main, or the loop stopped after a step)."""
    from fsdp_jax.app.cli.train import main
    from fsdp_jax.app.trainer import loop
    from fsdp_jax.app.trainer.setup import load_run_config

    (out / f"{name}_disk").mkdir(parents=True, exist_ok=True)
    over = [*overrides, f"run_dir={out / name}", f"offload_dirs={out / name}_disk"]
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        if stop_after is None:
            rc = main(["--config", "configs/tiny.yaml", *over, "--no-progress"])
            if rc != 0:
                raise SystemExit(f"run {name} exited {rc}")
        else:
            loop.train(load_run_config("configs/tiny.yaml", over), progress=False, stop_after=stop_after)
    return text.getvalue()


def _final(run_dir: Path):
    """The run's newest checkpoint, restored as a run without offload lays it out."""
    from fsdp_jax import checkpoint
    from fsdp_jax.app.trainer.build import trainer_model
    from fsdp_jax.app.trainer.optim import build_optimizer
    from fsdp_jax.app.trainer.setup import load_run_config
    from fsdp_jax.sharding.mesh import make_mesh
    from fsdp_jax.sharding.strategy import make_plan
    from fsdp_jax.train.state import abstract_state

    cfg = load_run_config(run_dir / "config.yaml")
    model = trainer_model(cfg.model, cfg.remat)
    opt, _ = build_optimizer(cfg.optimizer, cfg.train.steps)
    plan = make_plan(model.abstract_params, opt, make_mesh(), "full_shard", model.logical_axes)
    return checkpoint.restore(run_dir / "checkpoints", abstract_state(plan, model.abstract_params, opt))[0]


def _differ(got, ref) -> dict:
    import jax
    import numpy as np

    out = {}
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(ref)):
        a, b = np.asarray(a), np.asarray(b)
        if not np.array_equal(a, b):
            out[jax.tree_util.keystr(path)] = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))
    return out


def compare(out: Path, corpus: Path, resume: bool, microbatches: int, extra: list[str], packed=None, with_=()) -> dict:
    import jax

    base = [*RUN, f"data.path={corpus}", *extra]
    # (name, offload, its reference run, stop after) in launch order
    runs = [("plain", "none", None, None), ("nvme", NVME, "plain", None)]
    if resume:
        runs += [("resumed", NVME, None, 2), ("resumed", NVME, "nvme", None)]  # exact resume: against nvme
    stdout: dict = {}
    for name, offload, _, stop in runs:
        stdout[name if stop is None else f"{name}_stopped"] = _launch(out, name, [*base, f"offload={offload}"], stop)
    if microbatches > 1:
        mb = [*base, f"train.microbatches={microbatches}"]
        runs += [("plain_mb", "none", None, None), ("nvme_mb", NVME, "plain_mb", None)]
        for name, offload, _, _ in runs[-2:]:
            stdout[name] = _launch(out, name, [*mb, f"offload={offload}"])
    if packed is not None:  # packed rows (segment ids, positions, a token-sum loss); no document mask
        rows = [*(x for x in base if not x.startswith("data.document_mask=")), f"data.path={packed}"]
        runs += [("plain_packed", "none", None, None), ("nvme_packed", NVME, "plain_packed", None)]
        for name, offload, _, _ in runs[-2:]:
            stdout[name] = _launch(out, name, [*rows, f"offload={offload}"])
    if with_:  # the pair again with more overrides (e.g. another objective, packed pairs)
        runs += [("plain_with", "none", None, None), ("nvme_with", NVME, "plain_with", None)]
        for name, offload, _, _ in runs[-2:]:
            stdout[name] = _launch(out, name, [*base, *with_, f"offload={offload}"])
    r: dict = {"devices": jax.device_count(), "stdout": stdout, "rows": {}, "final": {}}
    for name, _, ref, stop in runs:
        if stop is not None:
            continue
        r["rows"][name] = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines() if x.strip()]
        if ref is not None:
            got = _final(out / name)
            r["final"][name] = {"step": int(got.step), "leaves": len(jax.tree.leaves(got)),
                                "differ": _differ(got, _final(out / ref))}  # fmt: skip
    r["files"] = sorted(p.name for p in (out / "nvme_disk").iterdir())
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="a fresh dir for the runs")
    ap.add_argument("--resume", action="store_true", help="also stop the nvme run after step 2 and resume it")
    ap.add_argument("--microbatches", type=int, default=1, help="K > 1: the pair again with K microbatches")
    ap.add_argument(
        "--packed", type=Path, default=None, help="a packed corpus (rows of --corpus's length): the pair on it"
    )
    ap.add_argument(
        "--pair-with", action="append", default=[], help="key=value: the pair again with it (plain_with, nvme_with)"
    )
    ap.add_argument("overrides", nargs="*", help="more key=value for every run")
    a = ap.parse_args(argv)
    from fsdp_jax.app.devices import use_cpu_devices

    use_cpu_devices()
    print(json.dumps(compare(a.out, a.corpus, a.resume, a.microbatches, a.overrides, a.packed, a.pair_with)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
