"""`fsdp-jax verify` once its flags have parsed (they and its description: fsdp_jax.app.cli.verify)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import jax

from fsdp_jax.app.config.checks import check_experts, validate
from fsdp_jax.app.devices import use_cpu_devices
from fsdp_jax.app.exits import fail_env
from fsdp_jax.app.models.decoder import count_params
from fsdp_jax.app.models.lora import adapter_mask
from fsdp_jax.app.objectives.grpo_run import check_grpo_config, is_grpo
from fsdp_jax.app.planner.flag_values import parse_devices, parse_strategies
from fsdp_jax.app.trainer.build import (
    has_loss_aux,
    has_router_aux,
    lora_optimizer,
    lora_spec,
    make_loss_fn,
    objective_loss,
    trainer_model,
)
from fsdp_jax.app.trainer.expert_bias import BIAS, balancing, bias_rule, without_bias_state
from fsdp_jax.app.trainer.optim import build_optimizer
from fsdp_jax.app.trainer.setup import load_run_config
from fsdp_jax.app.verify_batches import verify_batches
from fsdp_jax.app.verify_shrink import shrink_config
from fsdp_jax.errors import ConfigError
from fsdp_jax.verify.compare import strategy_mesh_shape
from fsdp_jax.verify.run import devices_for, verify


def run(args) -> int:
    """Check the flags and config, fit the config to this machine (shrunk when too big,
    noted), verify every strategy against one device, report."""

    n = parse_devices(args.devices)
    strategies = parse_strategies(args.strategies)
    cfg = load_run_config(args.config, args.overrides)
    if is_grpo(cfg):  # what the trainer refuses for GRPO (offload, context > 1, ...)
        check_grpo_config(cfg)
    validate(cfg)
    use_cpu_devices(n)  # before JAX starts: n CPU devices when this machine has fewer

    devices = devices_for(n)
    if devices is None:
        print(f"error: --devices {n}: this machine has {len(jax.devices())} devices", file=sys.stderr)
        return 1
    try:
        cfg, changed, notes = _shrunk_if_big(cfg, args.max_params, n, strategies, devices, _data_size(cfg, n))
    except RuntimeError as e:  # cannot shrink keeping the decisions: exit 1, one line
        return fail_env(e)
    cfg, notes = _as_verified(cfg, devices, notes)
    data = _expert_split(cfg, n, strategies, notes)

    batches, what = verify_batches(cfg, args.steps, args.seed, vocab_shrunk="vocab_size" in changed)
    notes.append(what)
    report = _verify(args, cfg, strategies, n, batches, data)
    _print_report(args, changed, notes, report)
    return 0 if report.passed else 1


def _shrunk_if_big(cfg, max_params: float, n: int, strategies, devices, data: int) -> tuple:
    """(config, {dim: (was, now)}, notes): `cfg` itself when it has at most `max_params`
    params (or 0), else reduced keeping every sharding decision on the meshes verify runs
    (`data` x fsdp, `fsdp_jax.app.verify_shrink`); RuntimeError when that cannot be done."""

    n_params = count_params(cfg.model)
    if not (max_params and n_params > max_params):
        return cfg, {}, []
    cfg, changed, more = shrink_config(cfg, n, strategies, devices, data)
    reduced = count_params(cfg.model) / 1e6
    notes = [
        f"{n_params / 1e6:.1f}M params: shrunk to verify on CPU ({reduced:.2f}M); "
        + ", ".join(f"{k} {a} -> {b}" for k, a, b in ((k, *v) for k, v in changed.items())),
        "kept: every dim's divisibility by the device count, the logical names, "
        "global_batch, precision, remat, microbatches, optimizer",
    ] + more
    return cfg, changed, notes


def _as_verified(cfg, devices, notes: list[str]) -> tuple:
    """(config, notes): XLA attention on CPU devices, and notes on what verify ignores
    (mesh.tensor) and how it runs the optimizer and batches."""
    notes = list(notes)
    if cfg.model.attention != "xla" and devices[0].platform == "cpu":
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="xla"))
        notes.append("model.attention cudnn -> xla (CPU devices)")
    if cfg.mesh.tensor != 1:
        notes.append(
            f"mesh.tensor={cfg.mesh.tensor} ignored: verify compares the data-parallel "
            "strategies on (data, fsdp) meshes"
        )
    if cfg.mesh.context > 1:
        notes.append(f"mesh.context={cfg.mesh.context}: every mesh splits sequences over context (data x fsdp below)")
    if cfg.lora.rank and cfg.lora.dropout:
        notes.append(f"lora.dropout={cfg.lora.dropout:g} off: verify compares the steps without dropout")
    if cfg.lora.rank:
        notes.append(
            "lora B drawn like A, not zero (PEFT's init_lora_weights=False): from zero, B is only its "
            "updates, and Adam's first step in 16-bit compute is the sign of grads at rounding level"
        )
    notes.append(f"optimizer {cfg.optimizer.name} at its peak lr {cfg.optimizer.lr:g} (warmup skipped)")
    if balancing(cfg.model):
        notes.append(
            f"model.bias_update_speed={cfg.model.bias_update_speed:g}: every step moves the score bias by the "
            f"aux-loss-free rule after its update, as the trainer's does; {BIAS} compared exactly"
        )
    return cfg, notes


def _data_size(cfg, n: int) -> int:
    """The data axis of verify's meshes: the config's data size when its rules split the
    experts (`mesh.rules.expert`: the expert axes then get the run's sizes; fsdp the rest of
    the `n` devices), else 1 (each strategy's own split, `strategy_mesh_shape`)."""
    if not (cfg.model.n_experts and cfg.mesh.rules.get("expert")):
        return 1
    data, fsdp = cfg.mesh.data, cfg.mesh.fsdp
    if data == -1 and fsdp > 0 and n % fsdp == 0:
        return n // fsdp
    return data if data > 0 and n % data == 0 else 1


def _expert_split(cfg, n: int, strategies, notes: list[str]) -> int:
    """verify's data size (`_data_size`), noting how the experts are split on each strategy's
    mesh; ConfigError (exit 2) naming model.n_experts when a mesh's expert axes do not divide it."""

    data = _data_size(cfg, n)
    entry = cfg.mesh.rules.get("expert") if cfg.model.n_experts else None
    if not entry:
        return data
    check_experts(cfg, dict.fromkeys(("data", "fsdp", "context", "tensor"), 1))  # axes that can hold experts
    axes = (entry,) if isinstance(entry, str) else tuple(entry)
    split = []
    for s in strategies:
        sizes = dict(zip(("data", "fsdp", "tensor"), strategy_mesh_shape(s, n, data)))
        n_ep = math.prod(sizes.get(a, 1) for a in axes)
        if cfg.model.n_experts % n_ep:
            raise ConfigError(
                "model.n_experts",
                f"{cfg.model.n_experts} is not divisible by the expert axes {', '.join(axes)} of verify's "
                f"{s} mesh (data={sizes['data']} x fsdp={sizes['fsdp']}: size {n_ep})",
            )
        split.append(f"{s} {n_ep}")
    notes.append(f"experts over {', '.join(axes)} (mesh.rules.expert), split n ways: " + ", ".join(split))
    return data


def step_options(cfg) -> dict:
    """The train step's options a run config sets, as `verify` / `build` take them."""
    return dict(
        precision=cfg.precision,
        microbatches=cfg.train.microbatches,
        clip_norm=cfg.optimizer.clip_norm,
        min_shard_size=cfg.mesh.min_shard_size,
        rules=cfg.mesh.rules,
    )


def _verify(args, cfg, strategies, n: int, batches: list, data: int = 1):
    """`fsdp_jax.verify.run` on the trainer's model, loss and optimizer (at its peak lr), with
    `batches` (`fsdp_jax.app.verify_batches`), the config's mesh rules and `data` x fsdp
    meshes (`_data_size`)."""

    lora = lora_spec(cfg)  # a LoRA config: the adapters train (and are compared), the base is frozen
    if lora is not None:  # B from zero would be compared to its own (noise-level) first update
        lora = dataclasses.replace(lora, init_weights=False)
    model = trainer_model(cfg.model, cfg.remat, lora)
    optimizer, _ = build_optimizer(dataclasses.replace(cfg.optimizer, warmup_steps=0), cfg.train.steps)
    optimizer = optimizer if lora is None else lora_optimizer(optimizer)
    # the aux-loss-free rule: the trainer's post_update (build_from_config), its bias without optimizer state
    rule = {"post_update": bias_rule(cfg.model), "exact": BIAS} if balancing(cfg.model) else {}
    optimizer = without_bias_state(optimizer) if rule else optimizer
    loss_fn = make_loss_fn(model, cfg.model)  # a mixture of experts: plus the router terms, as the trainer's step
    has_aux = has_loss_aux(cfg.model)  # router terms, an MTP loss
    if cfg.objective != "sft":  # the trainer's preference / GRPO step (precomputed log-probs: computed in the step)
        model, loss_fn = objective_loss(cfg, model, precomputed=False)
        has_aux = True
    return verify(
        model,
        optimizer,
        loss_fn,
        batches=batches,
        strategies=strategies,
        devices=n,
        steps=args.steps,
        seed=args.seed,
        **step_options(cfg),
        data=data,
        # mesh.context > 1: each strategy's mesh splits sequences over a context axis, as the run's does
        **({"context": cfg.mesh.context} if cfg.mesh.context > 1 else {}),
        has_aux=has_aux,
        # a mixture of experts: the experts' token counts are compared exactly; from a step at which
        # a token's top-k choice flipped (a near-tie) the steps are reported, not judged (docs/moe.md)
        **({"routing": "expert_load"} if has_router_aux(cfg.model) and cfg.objective == "sft" else {}),
        **({} if lora is None else {"trainable": adapter_mask}),
        **rule,
    )


def _print_report(args, changed: dict, notes: list[str], report) -> None:
    """One JSON document (--json), or the notes and the report's table."""
    if args.json:
        doc = {
            "config": args.config,
            "shrunk": {k: list(v) for k, v in changed.items()},
            "notes": notes,
            **report.to_dict(),
        }
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        print(f"config {args.config}")
        for line in notes:
            print(f"  {line}")
        print(report.format())
