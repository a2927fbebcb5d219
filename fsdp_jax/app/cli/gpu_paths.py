"""The GPU-only paths of `gpu-check` (issue 63): each runs a few train steps of a small model
against the XLA path on the same params and batch, and reports both loss curves.

    r = compare("cudnn_packed", smoke=False)   # {"losses": {...}, "max_rel": ..., "ok": ...}

| check        | runs                                       | against                        |
|--------------|--------------------------------------------|--------------------------------|
| cudnn_packed | cuDNN attention, packed rows (segment ids) | model.attention=xla            |
| ring_cudnn   | cuDNN per ring block, mesh.context=1, one  | the XLA ring (`context_attention`) |
|              | device's program, plain and packed rows    |                                |
| tokamax_moe  | tokamax grouped GEMMs, a small MoE         | model.grouped_matmul=xla       |
| lora         | LoRA (rank 16) with cuDNN attention        | the same LoRA with xla         |
| offload      | offload=optimizer, optimizer:streamed      | offload=none (step time share) |

`smoke=True` (a CPU rehearsal: `bash scripts/gpu_check.sh` with GPU_CHECK_SMOKE=1) swaps each
GPU-only kernel for its XLA twin and shrinks the model, so the plumbing runs where no GPU is.
"""

from __future__ import annotations

import importlib.util
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fsdp_jax as fj
from fsdp_jax.app.config import load_config  # not trainer.setup: it imports grain: it imports grain
from fsdp_jax.app.planner.abstract_step import build_step, sample_batch
from fsdp_jax.attention.cudnn import cudnn_kernel
from fsdp_jax.attention.flash import flash_context_attention
from fsdp_jax.attention.kernels import reference_kernel
from fsdp_jax.attention.ring import context_attention
from fsdp_jax.hlo.memory import compiled_memory

# A small Llama for the path checks: 4 layers of d 512 at seq 1024, bf16 compute, dots remat.
SMALL = [
    "model.vocab_size=8192",
    "model.d_model=512",
    "model.n_layers=4",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.ffn_dim=1536",
    "model.max_seq_len=1024",
    "data.seq_len=1024",
    "train.global_batch=8",
    "precision=params=float32,compute=bfloat16",
    "remat=dots",
    "optimizer.warmup_steps=0",
]
SMOKE = [
    "model.vocab_size=256",
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "model.max_seq_len=64",
    "data.seq_len=64",
    "train.global_batch=8",
    "precision=params=float32,compute=float32",
    "optimizer.warmup_steps=0",
]
MOE = ["model.n_experts=8", "model.experts_per_token=2", "model.moe_ffn_dim=512"]
# offload: the 1B config cut to 4 layers (~0.37B params, ~3 GB of AdamW state in host memory)
OFFLOAD = [
    "model.n_layers=4",
    "train.global_batch=4",
    "precision=params=float32,compute=bfloat16",
    "remat=full",
    "model.attention=cudnn",
    "optimizer.warmup_steps=0",
]
STEPS = 3
TOLERANCE = 1e-2  # relative loss difference per step, bf16 compute (XLA vs the GPU kernel)


def run_steps(cfg, steps: int = STEPS, seed: int = 0) -> dict:
    """`steps` train steps of the trainer's step for `cfg` on all local devices, from key(0)
    and one random batch (`sample_batch`): per-step losses, step times, compiled memory."""

    build = build_step(cfg, cfg.mesh.strategy)
    state = build.init_state(jax.random.key(0))
    batch = jax.device_put(sample_batch(cfg, build.batch, np.random.default_rng(seed)), build.plan.batch)
    t = time.perf_counter()
    with jax.default_device(build.mesh.devices.flat[0]):
        compiled = build.step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t
    losses, times = [], []
    for _ in range(steps):
        t = time.perf_counter()
        state, m = compiled(state, batch)
        losses.append(float(m["loss"]))  # blocks on the step
        times.append(time.perf_counter() - t)
    return {
        "losses": losses,
        "step_s": times,
        "step_s_median": statistics.median(times[1:] or times),
        "compile_s": compile_s,
        "compiled": compiled_memory(compiled),
    }


def _pair(base: list[str], kernel: list[str], xla: list[str], smoke: bool) -> dict:

    extra = SMOKE if smoke else []
    runs = {}
    for name, over in (("kernel", [] if smoke else kernel), ("xla", xla)):
        cfg = load_config("configs/llama_1b.yaml", [*base, *extra, "data.source=none", *over])
        runs[name] = run_steps(cfg)
    a, b = runs["kernel"]["losses"], runs["xla"]["losses"]
    rel = [abs(x - y) / abs(y) for x, y in zip(a, b)]
    return {
        "kernel": kernel,
        "losses": {k: r["losses"] for k, r in runs.items()},
        "step_s_median": {k: r["step_s_median"] for k, r in runs.items()},
        "compile_s": {k: r["compile_s"] for k, r in runs.items()},
        "rel_loss": rel,
        "max_rel": max(rel),
        "ok": all(r == r for r in a) and max(rel) < TOLERANCE,
    }


def cudnn_packed(smoke: bool = False) -> dict:
    """cuDNN attention over packed rows (two segments per row, data.document_mask) vs XLA's mask."""
    return _pair([*SMALL, "data.document_mask=true"], ["model.attention=cudnn"], ["model.attention=xla"], smoke)


def lora(smoke: bool = False) -> dict:
    """LoRA rank 16 on every linear layer, cuDNN attention vs XLA, the same adapters and batch."""
    base = [*SMALL, "lora.rank=16", "lora.alpha=32", "optimizer.lr=1e-2"]
    return _pair(base, ["model.attention=cudnn"], ["model.attention=xla"], smoke)


def tokamax_moe(smoke: bool = False) -> dict:
    """tokamax's grouped GEMMs (Mosaic GPU on sm90) on an 8-expert top-2 MoE vs `ragged_dot`."""

    if importlib.util.find_spec("tokamax") is None:
        return {"skipped": "tokamax is not installed (scripts/gpu_check.sh carries its wheel in .whl/)"}
    import tokamax

    out = _pair(
        [*SMALL, *MOE, "model.attention=xla"], ["model.grouped_matmul=tokamax"], ["model.grouped_matmul=xla"], smoke
    )
    return {"tokamax": getattr(tokamax, "__version__", "?"), **out}


def offload(smoke: bool = False) -> dict:
    """Step time with the optimizer state in pinned host memory (whole, and streamed layer by
    layer) against none; the transfers' share is (t - t_none) / t."""

    runs = {}
    for off in ("none", "optimizer", "optimizer:streamed"):
        over = [*OFFLOAD, *(SMOKE if smoke else []), "data.source=none", f"offload={off}"]
        if smoke:
            over.append("model.attention=xla")
        try:
            runs[off] = run_steps(load_config("configs/llama_1b.yaml", over), steps=4)
        except Exception as e:  # one setting failing leaves the others' numbers
            runs[off] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    base = runs["none"].get("step_s_median")
    for r in runs.values():
        if base and "step_s_median" in r:
            r["transfer_share"] = max(0.0, 1 - base / r["step_s_median"])
            r["rel_loss_vs_none"] = max(abs(x - y) / abs(y) for x, y in zip(r["losses"], runs["none"]["losses"]))
    ok = all("error" not in r and r.get("rel_loss_vs_none", 0) < TOLERANCE for r in runs.values())
    return {"runs": runs, "ok": ok}


def ring_cudnn(smoke: bool = False) -> dict:
    """cuDNN per ring block (`ring_cudnn.cudnn_kernel`, plain and packed) in one device's program
    (mesh.context=1: the ring of one block, its own CAUSAL / PADDING_CAUSAL call) against the XLA
    ring (`context_attention`): the loss sum(o^2) and its grads for q, k, v, over 3 draws."""

    b, s, h, kvh, dh = (2, 64, 4, 2, 16) if smoke else (2, 2048, 8, 2, 128)
    dt = jnp.float32 if smoke else jnp.bfloat16
    mesh = fj.make_mesh(fsdp=1, context=1, devices=jax.devices()[:1])
    sh = NamedSharding(mesh, P("fsdp", "context"))
    out = {}
    for packed in (False, True):

        def loss(q, k, v, pos, seg, impl, packed=packed):
            seg = seg if packed else None
            if impl == "cudnn":
                kern = reference_kernel(scale=dh**-0.5) if smoke else cudnn_kernel(scale=dh**-0.5, packed=packed)
                o = flash_context_attention(q, k, v, pos, seg, kernel=kern)
            else:
                o = context_attention(q, k, v, pos, seg, scale=dh**-0.5)
            return jnp.sum(o.astype(jnp.float32) ** 2)

        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=5)  # one compile per impl
        rows = []
        for draw in range(3):
            rng = np.random.default_rng(draw)
            q = jax.device_put(jnp.asarray(rng.standard_normal((b, s, h, dh)), dt), sh)
            k, v = (jax.device_put(jnp.asarray(rng.standard_normal((b, s, kvh, dh)), dt), sh) for _ in range(2))
            pos = jax.device_put(jnp.tile(jnp.arange(s, dtype=jnp.int32), (b, 1)), sh)
            cuts = np.sort(rng.choice(np.arange(1, s), 3, replace=False))
            seg = jax.device_put(jnp.asarray(np.tile(np.searchsorted(cuts, np.arange(s), "right") + 1, (b, 1))), sh)
            res = {}
            with jax.set_mesh(mesh):
                for impl in ("cudnn", "xla"):
                    res[impl] = jax.device_get(f(q, k, v, pos, seg, impl))
            (lc, gc), (lx, gx) = res["cudnn"], res["xla"]
            grel = [
                float(np.linalg.norm(np.float32(a) - np.float32(c)) / np.linalg.norm(np.float32(c)))
                for a, c in zip(gc, gx)
            ]
            rows.append({"loss": [float(lc), float(lx)], "rel_loss": abs(float(lc) / float(lx) - 1), "rel_grad": grel})
        worst = max(max(r["rel_loss"], *r["rel_grad"]) for r in rows)
        out["packed" if packed else "plain"] = {"draws": rows, "worst_rel": worst, "ok": worst < 2e-2}
    return {"shape": [b, s, h, kvh, dh], **out, "ok": all(v["ok"] for v in out.values() if isinstance(v, dict))}


PATHS = {
    "cudnn_packed": cudnn_packed,
    "ring_cudnn": ring_cudnn,
    "tokamax_moe": tokamax_moe,
    "lora": lora,
    "offload": offload,
}
