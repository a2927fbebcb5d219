"""The sharding strategies' names and aliases: data, no JAX. The run config's checks read
`mesh.strategy` against these before JAX loads (`fsdp_jax.app.config.early_checks`);
`fsdp_jax.sharding.strategy` builds its `STRATEGIES` table in this order and re-exports `ALIASES`.

- `STRATEGY_NAMES`: ZeRO-3, ZeRO-2, ZeRO-1, DDP, HSDP (PyTorch FSDP's ShardingStrategy names,
  lower case, plus `shard_opt` for ZeRO-1).
- `ALIASES`: the DeepSpeed / PyTorch names users also type, each -> its strategy.
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
