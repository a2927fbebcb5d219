"""Names of mesh axes and logical dims, in one place.

*Axis* means a mesh axis; *dim* means a tensor dimension. Model code names its
dims with the logical names below; `fsdp_jax.sharding.rules` maps them onto mesh axes.
"""

# Mesh axes, outermost first. `data` replicates params (and carries the
# inter-host / DCN split under hybrid_shard); `fsdp` shards them; `tensor` is
# for tensor parallelism.
DATA = "data"
FSDP = "fsdp"
TENSOR = "tensor"
MESH_AXES: tuple[str, str, str] = (DATA, FSDP, TENSOR)

# Logical dims of parameters.
EMBED = "embed"  # model width (d_model)
MLP = "mlp"  # feed-forward hidden width
HEADS = "heads"  # query heads
KV_HEADS = "kv_heads"  # key/value heads (grouped-query attention)
KV = "kv"  # per-head width (head_dim)
VOCAB = "vocab"
LAYERS = "layers"  # stacked-layer dim created by nnx.vmap / scan
NORM = "norm"  # norm scales: small, kept replicated
EXPERT = "expert"  # the experts of a mixture-of-experts layer

# Logical dims of activations.
BATCH = "batch"
LENGTH = "length"
