"""The decoder's named choices: data, no JAX. The run config's schema checks `model.*` against
these tuples before JAX loads; the modules that compute them read the same tuples.

- `ROPE_TYPES`: transformers' `rope_type` names (5.x `modeling_rope_utils.ROPE_INIT_FUNCTIONS`
  keys) that `fsdp_jax.app.models.rope` computes.
- `GROUPED_MATMULS`: the dropless experts' grouped matmul (`fsdp_jax.app.models.grouped_matmul`):
  `xla` (`jax.lax.ragged_dot`), `tokamax` (tokamax's Pallas `ragged_dot`), `auto` (which runs here).
- `ATTENTIONS`: the attention kernel (`model.attention`): `xla` (`jax.nn.dot_product_attention`'s
  XLA implementation), `cudnn` (its cuDNN flash kernels, CUDA GPUs), `splash` (the Pallas splash
  kernel, TPUs).
"""

ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
GROUPED_MATMULS: tuple[str, ...] = ("auto", "xla", "tokamax")
ATTENTIONS: tuple[str, ...] = ("xla", "cudnn", "splash")
