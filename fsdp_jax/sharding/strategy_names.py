"""The sharding strategies' names and aliases: data, no JAX. The run config's checks read
`mesh.strategy` against these before JAX loads (`fsdp_jax.app.config.early_checks`);
`fsdp_jax.sharding.strategy` builds its `STRATEGIES` table in this order and re-exports `ALIASES`.

- `STRATEGY_NAMES`: ZeRO-3, ZeRO-2, ZeRO-1, DDP, HSDP (PyTorch FSDP's ShardingStrategy names,
  lower case, plus `shard_opt` for ZeRO-1).
- `ALIASES`: the DeepSpeed / PyTorch names users also type, each -> its strategy.
- `strategy_name`: a name or alias -> its name, as `fsdp_jax.sharding.strategy.get_strategy` reads it.
"""

STRATEGY_NAMES: tuple[str, ...] = ("full_shard", "shard_grad_op", "shard_opt", "no_shard", "hybrid_shard")
ALIASES: dict[str, str] = {
    "zero3": "full_shard",
    "fsdp": "full_shard",
    "zero2": "shard_grad_op",
    "zero1": "shard_opt",
    "ddp": "no_shard",
    "hsdp": "hybrid_shard",
}


def strategy_name(name: str) -> str:
    """A strategy's name or alias (any case) -> its name in `STRATEGY_NAMES`; ValueError listing
    them and the aliases (`get_strategy`'s error for a name its table lacks)."""
    key = ALIASES.get(str(name).lower(), str(name).lower())
    if key not in STRATEGY_NAMES:
        raise ValueError(
            f"unknown strategy {name!r}; choose one of {', '.join(STRATEGY_NAMES)} (aliases: {', '.join(ALIASES)})"
        )
    return key
