"""Size thresholds of the sharding decisions: data, no JAX (the run config's defaults read them).

- `DEFAULT_MIN_SHARD_SIZE`: unannotated leaves with fewer elements stay replicated (the
  fallback rule, `fsdp_jax.sharding.rules`); biases and norm scales are not worth a collective.
- `DEFAULT_MAX_REPLICATED_FRACTION`: the replicated-bytes guard (`fsdp_jax.sharding.replication`)
  refuses a plan that replicates more than this fraction of the parameter bytes.
- `DEFAULT_MIN_REPLICATED_BYTES`: replicated parameter bytes under this are a warning, not an
  error, whatever their fraction: 16 MiB per device is noise on any accelerator, while a small
  model (biases, norms, a 64-wide MLP) can easily be mostly below min_shard_size.
"""

DEFAULT_MIN_SHARD_SIZE = 2**14  # elements
DEFAULT_MAX_REPLICATED_FRACTION = 0.02
DEFAULT_MIN_REPLICATED_BYTES = 16 << 20
