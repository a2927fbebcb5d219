#!/usr/bin/env python
"""Does the trainer's model train the same on one device and under each strategy on N?

    python scripts/verify.py --config configs/tiny.yaml
    python scripts/verify.py --config configs/llama2_7b.yaml --devices 8 --steps 3 --json
    python scripts/verify.py --config configs/small.yaml --strategies zero3,ddp optimizer.name=sgd

`fsdp_jax.verify` on the config's model (fsdp_jax/app/models/llama.py), loss, optimizer,
precision, remat, microbatches and clipping, with random tokens of the config's batch
shape: `--steps` steps on one device, the same steps under each strategy on `--devices`
devices (fake CPU devices when this machine has fewer). The optimizer runs at its peak
learning rate (warmup skipped) so that the few steps make full-size updates.

A config too big for this machine (over --max-params, default 20M) is verified at a
reduced depth and width that keeps every sharding decision: each dim shrinks to a size
with the same divisibility by the device count (so by every mesh axis), the logical names
are the model's own, `mesh.min_shard_size` is rescaled so the same params stay
replicated, and the per-param specs of the full and the reduced model are compared
under every strategy before anything runs. The output says which dims shrank and to
what. Trailing key=value arguments override the config as in scripts/train.py.

Exit codes: 0 every strategy passed, 1 a strategy failed verification (or an
environment failure), 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys


def shrink_dim(size: int, target: int, n: int) -> int:
    """The smallest size >= `target` with the same gcd with `n` as `size` (so divisible
    by exactly the same mesh-axis sizes), never above `size`."""
    g = math.gcd(size, n)
    new = max(g, -(-target // g) * g)
    while new < size and math.gcd(new, n) != g:
        new += g
    return min(new, size)


def shrunk_model(m, n: int):
    """(reduced LlamaConfig, {key: (old, new)}) for `m` on `n` devices: 2 layers, about
    8 heads (the grouped-query ratio kept), d_model ~128, ffn ~2x d_model, vocab ~256;
    every dim a rule can map to a mesh axis keeps its gcd with `n`."""
    ratio = m.n_heads // m.n_kv_heads
    kv = shrink_dim(m.n_kv_heads, max(1, 8 // ratio), n)
    heads = kv * ratio  # keeps the grouped-query ratio
    if math.gcd(heads, n) != math.gcd(m.n_heads, n):
        heads = shrink_dim(m.n_heads, heads, n)
    # head_dim maps to no mesh axis; d_model = heads x head_dim (sharded over fsdp) must
    # keep its divisibility, so take the smallest even head_dim that gives it that
    head_dim = max(2, 128 // heads)
    head_dim += head_dim % 2
    while head_dim < m.head_dim and math.gcd(heads * head_dim, n) != math.gcd(m.d_model, n):
        head_dim += 2
    head_dim = min(head_dim, m.head_dim)
    d_model = heads * head_dim
    new = dataclasses.replace(
        m, n_layers=min(m.n_layers, 2), n_heads=heads, n_kv_heads=kv, d_model=d_model,
        ffn_dim=shrink_dim(m.ffn_dim, 2 * d_model, n), vocab_size=shrink_dim(m.vocab_size, 256, n),
        kv_channels=head_dim if m.kv_channels else 0)
    changed = {f"model.{k}": (getattr(m, k), getattr(new, k))
               for k in ("n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")
               if getattr(m, k) != getattr(new, k)}
    if m.head_dim != new.head_dim:
        changed["model.head_dim"] = (m.head_dim, new.head_dim)
    return new, changed


def _rows(model_cfg, min_shard_size: int, strategy: str, devices, remat: str):
    """{param path: (shape, at-rest spec)} of the reference model under `strategy`."""
    import optax

    from fsdp_jax.adapters import from_nnx
    from fsdp_jax.app.models.llama import Llama
    from fsdp_jax.mesh import make_mesh
    from fsdp_jax.strategy import make_plan
    from fsdp_jax.verify import strategy_mesh_shape
    fns = from_nnx(lambda rngs: Llama(model_cfg, rngs=rngs, remat=remat))
    mesh = make_mesh(*strategy_mesh_shape(strategy, len(devices)), devices=devices)
    plan = make_plan(fns.abstract_params, optax.sgd(0.1), mesh, strategy, fns.logical_axes,
                     min_shard_size=min_shard_size, max_replicated_fraction=None)
    return {r.path: (r.shape, r.spec) for r in plan.rows}


def shrink_config(cfg, n: int, strategies, devices):
    """(reduced cfg, {key: (old, new)}, notes). Raises RuntimeError when the reduced
    model would shard any param differently from the full one."""
    model, changed = shrunk_model(cfg.model, n)
    seq = shrink_dim(cfg.data.seq_len, 32, n)
    if seq != cfg.data.seq_len:
        changed["data.seq_len"] = (cfg.data.seq_len, seq)
    model = dataclasses.replace(model, max_seq_len=seq)
    # min_shard_size: the same params must stay replicated for being small
    full = _rows(cfg.model, cfg.mesh.min_shard_size, strategies[0], devices, cfg.remat)
    small_shapes = {p: s for p, (s, _) in _rows(model, 1, strategies[0], devices, cfg.remat).items()}
    small = {p: math.prod(s) < cfg.mesh.min_shard_size
             for p, (s, _) in full.items()}
    below = [math.prod(small_shapes[p]) for p in full if small[p]]
    above = [math.prod(small_shapes[p]) for p in full if not small[p]]
    threshold = max(below, default=0) + 1
    if above and min(above) < threshold:
        raise RuntimeError("cannot shrink this model keeping which params stay replicated; "
                           "run with --max-params 0 to verify it at full size")
    if threshold != cfg.mesh.min_shard_size:
        changed["mesh.min_shard_size"] = (cfg.mesh.min_shard_size, threshold)
    for s in strategies:
        a = _rows(cfg.model, cfg.mesh.min_shard_size, s, devices, cfg.remat)
        b = _rows(model, threshold, s, devices, cfg.remat)
        for path in a:
            if a[path][1] != b[path][1]:
                raise RuntimeError(f"reduced model shards {path} as {b[path][1]} under {s}, the full "
                                   f"model as {a[path][1]}; run with --max-params 0")
    cfg = dataclasses.replace(cfg, model=model, data=dataclasses.replace(cfg.data, seq_len=seq),
                              mesh=dataclasses.replace(cfg.mesh, min_shard_size=threshold))
    notes = [f"same sharding decision for every param under every strategy ({len(a)} params x "
             f"{len(strategies)} strategies compared, full vs reduced)"]
    return cfg, changed, notes


def main(argv: list[str] | None = None) -> int:
    from fsdp_jax.app.flags import Parser, int_in, real_in
    ap = Parser(description=__doc__.splitlines()[1].strip(),
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    ap.add_argument("--strategies", default="all", help="all, or a comma list (aliases ok: ddp,zero3)")
    ap.add_argument("--devices", default="8", help="devices to verify on (default 8)")
    ap.add_argument("--steps", type=int_in(1), default=3, help="train steps compared (default 3)")
    ap.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0, help="init and batch seed")
    ap.add_argument("--max-params", type=real_in(0), default=20e6,
                    help="shrink models with more params than this (0: never shrink)")
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optimizer.name=sgd")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # argparse printed its usage error
        return 2 if e.code else 0

    from fsdp_jax.app.cli import BAD_INPUT, fail
    from fsdp_jax.app.plan_report import PlanError, parse_devices, parse_strategies

    try:
        n = parse_devices(args.devices)
        strategies = parse_strategies(args.strategies)
    except PlanError as e:
        return fail(e)
    from fsdp_jax.app.config import load_config, validate
    try:
        cfg = load_config(args.config, args.overrides)
        validate(cfg)
    except BAD_INPUT as e:
        return fail(e)

    from fsdp_jax.app.plan_report import use_cpu_devices
    try:
        use_cpu_devices(n)  # before JAX starts: n CPU devices when this machine has fewer
    except BAD_INPUT as e:
        return fail(e)

    import jax
    import numpy as np

    from fsdp_jax.adapters import from_nnx
    from fsdp_jax.app.loop import make_loss_fn
    from fsdp_jax.app.models.llama import Llama, count_params
    from fsdp_jax.app.optim import build_optimizer
    from fsdp_jax.verify import VerifyError, devices_for, verify

    devices = devices_for(n)
    if devices is None:
        print(f"error: --devices {n}: this machine has {len(jax.devices())} devices", file=sys.stderr)
        return 1
    notes, changed = [], {}
    n_params = count_params(cfg.model)
    if args.max_params and n_params > args.max_params:
        try:
            cfg, changed, more = shrink_config(cfg, n, strategies, devices)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        reduced = count_params(cfg.model) / 1e6
        notes += [f"{n_params / 1e6:.1f}M params: shrunk to verify on CPU ({reduced:.2f}M); "
                  + ", ".join(f"{k} {a} -> {b}" for k, a, b in ((k, *v) for k, v in changed.items())),
                  "kept: every dim's divisibility by the device count, the logical names, "
                  "global_batch, precision, remat, microbatches, optimizer"] + more
    if cfg.model.attention != "xla" and devices[0].platform == "cpu":
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="xla"))
        notes.append("model.attention cudnn -> xla (CPU devices)")
    if cfg.mesh.tensor != 1:
        notes.append(f"mesh.tensor={cfg.mesh.tensor} ignored: verify compares the data-parallel "
                     "strategies on (data, fsdp) meshes")
    notes.append(f"optimizer {cfg.optimizer.name} at its peak lr {cfg.optimizer.lr:g} (warmup skipped); "
                 f"batches: random tokens ({cfg.train.global_batch}, {cfg.data.seq_len + 1})")

    model = from_nnx(lambda rngs: Llama(cfg.model, rngs=rngs, remat=cfg.remat))
    optimizer, _ = build_optimizer(dataclasses.replace(cfg.optimizer, warmup_steps=0), cfg.train.steps)
    rng = np.random.default_rng(args.seed)
    batches = [rng.integers(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.data.seq_len + 1),
                            dtype=np.int32) for _ in range(args.steps)]
    try:
        report = verify(model, optimizer, make_loss_fn(model), batches=batches, strategies=strategies,
                        devices=n, steps=args.steps, seed=args.seed, precision=cfg.precision,
                        microbatches=cfg.train.microbatches, clip_norm=cfg.optimizer.clip_norm,
                        min_shard_size=cfg.mesh.min_shard_size)
    except BAD_INPUT + (VerifyError,) as e:
        return fail(e)
    if args.json:
        doc = {"config": args.config, "shrunk": {k: list(v) for k, v in changed.items()},
               "notes": notes, **report.to_dict()}
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        print(f"config {args.config}")
        for line in notes:
            print(f"  {line}")
        print(report.format())
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
