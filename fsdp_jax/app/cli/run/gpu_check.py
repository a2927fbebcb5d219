"""`fsdp-jax gpu-check` once its flags have parsed (they and its description: fsdp_jax.app.cli.gpu_check)."""

from __future__ import annotations

import json
import statistics
import time
import traceback

import jax
import numpy as np
import optax

import fsdp_jax as fj
from fsdp_jax.app.cli.gpu_check import CHECKS
from fsdp_jax.app.cli.gpu_paths import PATHS, SMOKE
from fsdp_jax.app.config import load_config  # not trainer.setup: it imports grain, which GPU machines lack
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.models.decoder import count_params, flops_per_token
from fsdp_jax.app.planner.abstract_step import build_step
from fsdp_jax.app.trainer.build import make_loss_fn, trainer_model
from fsdp_jax.hlo.memory import collective_report, compiled_memory
from fsdp_jax.targets.perf import device_memory, mfu, peak_flops, time_steps


def throughput(config: str, steps: int, overrides: list[str], smoke: bool = False) -> dict:

    n = jax.device_count()
    # 8 sequences of 2048 per GPU: with cuDNN attention (no saved S x S logits) and `dots`
    # remat the 1B step needs ~31 GB of activations + 18 GB of states (scripts/plan.py,
    # `dots_no_batch` column as the stand-in), so it fits an 80 GB H100 as well as an H200.
    cfg = load_config(
        config,
        [
            "precision=params=float32,compute=bfloat16",
            "model.attention=cudnn",
            "remat=dots",
            f"train.global_batch={8 * n}",
            *overrides,
            *(["model.attention=xla", *_smoke_model()] if smoke else []),
        ],
    )
    build = build_step(cfg, "full_shard")  # the trainer's step, on all local devices
    state = build.init_state(jax.random.key(0))
    b = cfg.train.global_batch
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, build.batch.shape, np.int32)
    batch = jax.device_put(tokens, build.plan.batch)
    t = time.perf_counter()
    compiled = build.step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t
    _, m, times = time_steps(compiled, state, batch, steps, warmup=2)
    med = statistics.median(times)
    tps = b * cfg.data.seq_len / med
    peak = peak_flops(jax.devices()[0], "bfloat16")
    mem = device_memory() or {}
    return {
        "config": config,
        "params": count_params(cfg.model),
        "devices": n,
        "device_kind": jax.devices()[0].device_kind,
        "global_batch": b,
        "seq_len": cfg.data.seq_len,
        "compile_s": compile_s,
        "step_s_median": med,
        "tokens_per_s": tps,
        "mfu": mfu(flops_per_token(cfg.model, cfg.data.seq_len), tps, n, peak),
        "peak_bytes_in_use": mem.get("peak_bytes_in_use"),
        "compiled": compiled_memory(compiled),
        "remat": cfg.remat,
        "attention": cfg.model.attention,
        "loss": float(m["loss"]),
    }


def _smoke_model() -> list[str]:

    return [o for o in SMOKE if not o.startswith("precision")]


def precision_check() -> dict:

    cfg = DecoderConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=256)
    model = trainer_model(cfg, "none")
    tokens = np.random.default_rng(1).integers(0, 512, (max(8, jax.device_count()), 257), np.int32)
    out = {}
    for name in ("float32", "bfloat16"):
        tx = optax.sgd(0.0)
        state, plan = fj.init_train_state(
            model.init,
            tx,
            fj.make_mesh(fsdp=-1),
            jax.random.key(0),
            logical_axes=model.logical_axes,
            max_replicated_fraction=None,
        )
        step = fj.make_train_step(make_loss_fn(model), tx, plan, precision=f"params=float32,compute={name}")
        _, m = step(state, jax.device_put(tokens, plan.batch))
        out[name] = {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"])}
    rel_loss = abs(out["bfloat16"]["loss"] - out["float32"]["loss"]) / out["float32"]["loss"]
    rel_gn = abs(out["bfloat16"]["grad_norm"] - out["float32"]["grad_norm"]) / out["float32"]["grad_norm"]
    return {**out, "rel_loss": rel_loss, "rel_grad_norm": rel_gn, "ok": rel_loss < 1e-2 and rel_gn < 5e-2}


def collective_check() -> dict:

    n = jax.device_count()
    if n < 2:
        return {"skipped": f"needs >= 2 devices, have {n}"}
    cfg = DecoderConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=128)
    model = trainer_model(cfg, "dots")
    tx = optax.adamw(1e-3)
    plan = fj.make_plan(model.abstract_params, tx, fj.make_mesh(fsdp=-1), "full_shard", model.logical_axes)
    abstract = fj.abstract_state(plan, model.abstract_params, tx)
    batch = jax.ShapeDtypeStruct((2 * n, 129), "int32", sharding=plan.batch)
    step = fj.make_train_step(make_loss_fn(model), tx, plan, precision="params=float32,compute=bfloat16")
    rep = collective_report(step.lower(abstract, batch).compile().as_text())
    inside = rep["inside_loop"]
    ag = inside.get("all-gather", {}).get("dtypes", {})
    rs = {
        **rep["inside_loop"].get("reduce-scatter", {}).get("dtypes", {}),
        **rep["outside_loop"].get("reduce-scatter", {}).get("dtypes", {}),
    }
    return {
        "report": rep,
        "all_gather_dtypes_in_loop": ag,
        "reduce_scatter_dtypes": rs,
        "ok": ag.get("bf16", 0) > 0 and sum(rs.values()) > 0,
    }


def run(args) -> int:
    # --only, --steps, the config's fields and --json: `fsdp_jax.app.cli.gpu_check.check_flags`, before JAX
    if "throughput" in args.only.split(","):
        load_config(args.config, args.overrides)  # the checks across fields: one line now, not a traceback later

    print(
        f"jax {jax.__version__} | backend {jax.default_backend()} | {jax.device_count()} x "
        f"{jax.devices()[0].device_kind}",
        flush=True,
    )

    results, ok = {}, True
    checks = {
        "throughput": lambda: throughput(args.config, args.steps, args.overrides, args.smoke),
        "precision": precision_check,
        "collectives": collective_check,
        **{name: (lambda f=f: f(args.smoke)) for name, f in PATHS.items()},
    }
    for name in args.only.split(","):
        t = time.perf_counter()
        try:
            results[name] = checks[name]()
        except Exception as e:  # report every check even when one fails
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            ok = False
        results[name]["wall_s"] = time.perf_counter() - t
        ok = ok and results[name].get("ok", True)
        print(
            f"[{name}] " + json.dumps({k: v for k, v in results[name].items() if k != "report"}, default=str),
            flush=True,
        )
        if args.json:  # after every check: a run cut short by its time cap keeps what it finished
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)
    tp = results.get("throughput", {})
    print("\n| check | result |\n|---|---|")
    if "tokens_per_s" in tp:
        mfu = f"{tp['mfu']:.1%}" if tp.get("mfu") else "n/a"
        peak = f"{tp['peak_bytes_in_use'] / 2**30:.1f} GiB" if tp.get("peak_bytes_in_use") else "n/a"
        print(
            f"| throughput ({tp['params'] / 1e9:.2f}B, bs {tp['global_batch']}x{tp['seq_len']}) | "
            f"{tp['tokens_per_s']:.0f} tok/s, MFU {mfu}, peak {peak}, step {tp['step_s_median'] * 1e3:.0f} ms |"
        )
    for name in CHECKS[1:]:
        if name in results:
            print(f"| {name} | {verdict(results[name])} |")
    return 0 if ok else 1


def verdict(r: dict) -> str:
    """One table cell for a check's result."""
    if "skipped" in r:
        return "skipped: " + r["skipped"]
    if "error" in r:
        return "FAIL " + str(r["error"])[:200]
    extra = f" (max rel loss {r['max_rel']:.1e})" if "max_rel" in r else ""
    return ("ok" if r.get("ok") else "FAIL") + extra
