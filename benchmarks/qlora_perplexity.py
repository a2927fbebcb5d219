#!/usr/bin/env python
"""The tiny model's held-out perplexity before / after quantising its frozen base (QLoRA).

    PYTHONPATH=. python benchmarks/qlora_perplexity.py [--steps 300] [--eval-batches 32] \
        [--out benchmarks/qlora_perplexity.json]

1. Trains configs/tiny.yaml (4 layers, d_model 256, bytes) with the trainer itself
   (`fsdp_jax.app.trainer.loop.train`, one CPU device) on the stdlib corpus for `--steps`
   steps; its final checkpoint is the float32 base.
2. For each compute dtype (float32, and bfloat16: a LoRA run's frozen base then rests in
   bf16, "the bf16 base") builds a LoRA run from that checkpoint (`init_from=<run>`,
   `fsdp_jax.app.trainer.setup.setup`, rank 8, B = 0 so the adapters add nothing) with the
   base float (`lora.base_quant=none`) or quantised as the QLoRA model quantises it on load
   (`nf4`, `nf4` + `double_quant`, `int8`; `fsdp_jax.app.trainer.qlora_load`), for two target
   sets: `q_proj v_proj` (LoRA's original targets) and `all-linear` (every projection of the
   decoder: all the frozen matrices the code quantises; embeddings, head and norms stay
   float). Each run's eval step (the model's own forward, dequantising inside each layer)
   gives the mean next-token loss over the same `--eval-batches` validation batches
   (held out: the corpus' val split); perplexity = exp(loss), per byte.
3. Cross-check of every quantised row: the float run's eval step on its base with the
   quantised weights replaced by their NumPy dequantisation of the same codes
   (`fsdp_jax.quant.weight.dequantize`, then cast to the compute dtype as the layer casts)
   must give the same loss; the report keeps the largest difference (`check_max_abs`).

Prints one JSON document (also --out). Uniform over 256 bytes is perplexity 256.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"q_proj v_proj": "q_proj,v_proj", "all-linear": "all-linear"}
SCHEMES = {
    "nf4": ["lora.base_quant=nf4", "lora.double_quant=false"],
    "nf4+dq": ["lora.base_quant=nf4", "lora.double_quant=true"],
    "int8": ["lora.base_quant=int8"],
}
COMPUTE = ("float32", "bfloat16")


def overrides(work: Path, steps: int, eval_batches: int) -> list[str]:
    """The tiny config's overrides shared by the training run and every evaluation."""
    return [
        f"data.path={work / 'data'}",
        f"train.steps={steps}",
        f"train.eval_every={steps}",
        f"train.eval_batches={eval_batches}",
        "train.checkpoint_every=0",
        "train.sample_tokens=0",
        "train.log_every=50",
    ]


def train_base(work: Path, common: list[str]) -> dict:
    """Train the float base; its run directory holds the final checkpoint."""
    from fsdp_jax.app.trainer.loop import train
    from fsdp_jax.app.trainer.setup import load_run_config

    cfg = load_run_config(ROOT / "configs" / "tiny.yaml", common + [f"run_dir={work / 'base'}"])
    t0 = time.perf_counter()
    summary = train(cfg, progress=False)
    tokens = cfg.train.eval_batches * cfg.train.global_batch * cfg.data.seq_len
    return {"seconds": round(time.perf_counter() - t0, 1), "val_loss": summary.get("val_loss"), "eval_tokens": tokens}


def lora_run(work: Path, common: list[str], name: str, compute: str, extra: list[str]):
    """A LoRA run (rank 8, adapters a no-op) over the trained base, not trained: (run, val batches)."""
    from fsdp_jax.app.data.batches import make_batches
    from fsdp_jax.app.trainer.setup import load_run_config, setup

    cfg = load_run_config(
        ROOT / "configs" / "tiny.yaml",
        common
        + [
            f"init_from={work / 'base'}",
            f"run_dir={work / name}",
            f"precision=params=float32,compute={compute}",
            "lora.rank=8",
            "lora.alpha=16",
            *extra,
        ],
    )
    return setup(cfg, resume=False), make_batches(cfg, 0, 1)[1]


def dequantised_params(params, spec, dtype):
    """`params` with each quantised weight ({codes, ...}) replaced by its NumPy dequantisation
    (float32 products cast once to `dtype`, as `fsdp_jax.quant.modules.QuantizedWeight` does)."""
    import jax.numpy as jnp
    import numpy as np

    from fsdp_jax.quant.weight import dequantize

    def walk(node):
        if isinstance(node, dict) and "codes" in node:
            leaves = {k: np.asarray(v) for k, v in node.items()}
            return jnp.asarray(dequantize(np, leaves, spec, np.float32).astype(dtype))
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        return node

    return walk(params)


def with_float_adapters(float_params, quant_params):
    """The float run's params tree holding `quant_params`' values (dequantised weights and
    the same adapters) at `float_params`' dtypes and shardings."""
    import jax

    return jax.tree.map(lambda f, q: jax.device_put(q.astype(f.dtype), f.sharding), float_params, quant_params)


def measure(work: Path, common: list[str]) -> dict:
    """Every row: {compute: {targets: {"float" | scheme: {loss, ppl, ...}}}}."""
    import jax.numpy as jnp

    from fsdp_jax.app.data.batches import evaluate
    from fsdp_jax.app.trainer.build import lora_spec

    out: dict = {}
    for compute in COMPUTE:
        dtype = jnp.dtype(compute)
        rows: dict = {}
        for label, targets in TARGETS.items():
            plain, val = lora_run(work, common, f"f-{compute}-{label}", compute, [f"lora.targets={targets}"])
            base_loss = evaluate(plain, plain.state.params, val)
            rows[label] = {"float": {"loss": base_loss, "ppl": math.exp(base_loss)}}
            for scheme, extra in SCHEMES.items():
                name = f"q-{compute}-{label}-{scheme}".replace(" ", "_")
                run, _ = lora_run(work, common, name, compute, [f"lora.targets={targets}", *extra])
                loss = evaluate(run, run.state.params, val)
                spec = lora_spec(run.cfg)
                ref_params = with_float_adapters(
                    plain.state.params, dequantised_params(run.state.params, spec.base_quant, dtype)
                )
                check = abs(evaluate(plain, ref_params, val) - loss)
                rows[label][scheme] = {
                    "loss": loss,
                    "ppl": math.exp(loss),
                    "ppl_ratio": math.exp(loss - base_loss),
                    "check_max_abs": check,
                }
        out[compute] = rows
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-batches", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.steps < 1 or args.eval_batches < 1:
        print("error: --steps and --eval-batches must be >= 1", file=sys.stderr)
        return 2
    from fsdp_jax.app.devices import use_cpu_devices

    use_cpu_devices(1)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        common = overrides(work, args.steps, args.eval_batches)
        trained = train_base(work, common)
        rows = measure(work, common)
    report = {
        "config": "configs/tiny.yaml",
        "steps": args.steps,
        "eval_batches": args.eval_batches,
        "devices": 1,
        "uniform_ppl": 256,
        "train": trained,
        "rows": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
