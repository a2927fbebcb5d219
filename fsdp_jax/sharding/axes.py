"""Names of mesh axes and logical dims, in one place.

*Axis* means a mesh axis; *dim* means a tensor dimension. Model code names its
dims with the logical names below; `fsdp_jax.sharding.rules` maps them onto mesh axes.
"""

# Mesh axes, outermost first. `data` replicates params (and carries the
# inter-host / DCN split under hybrid_shard); `fsdp` shards them; `tensor` is
# for tensor parallelism; `context` splits each sequence (context parallelism:
# `fsdp_jax.attention.ring`), placed between `fsdp` and `tensor`.
DATA = "data"
FSDP = "fsdp"
CONTEXT = "context"
TENSOR = "tensor"
MESH_AXES: tuple[str, ...] = (DATA, FSDP, CONTEXT, TENSOR)
MeshAxes = str | tuple[str, ...] | None  # one mesh axis, several, or none (a spec entry, a rule's value)

# Logical dims of parameters.
EMBED = "embed"  # model width (d_model)
MLP = "mlp"  # feed-forward hidden width
HEADS = "heads"  # query heads
KV_HEADS = "kv_heads"  # key/value heads (grouped-query attention)
KV = "kv"  # per-head width (head_dim)
VOCAB = "vocab"
LAYERS = "layers"  # stacked-layer dim created by nnx.vmap / scan
NORM = "norm"  # norm scales: small, kept replicated
LORA_RANK = "lora_rank"  # a LoRA adapter's rank dim: replicated (its other dim shards as its weight's)

EXPERT = "expert"  # the experts of a mixture-of-experts layer
Q_LORA = "q_lora"  # latent attention's compressed query width (q_lora_rank)
KV_LORA = "kv_lora"  # latent attention's compressed key/value width (kv_lora_rank, + the RoPE key)
# A frozen weight's leading own dim when its at-rest (fsdp) dim is its last (`w_down`, `wo` of a
# LoRA base, float or quantised codes): it shards over fsdp here instead, so each layer's
# all-gather runs along a major dim (XLA:GPU otherwise copies the whole layer stack into a
# transposed layout before the layer loop). `fsdp_jax.sharding.frozen_rows`.
FROZEN_ROWS = "frozen_rows"

# Logical dims of activations.
BATCH = "batch"
LENGTH = "length"  # sequence positions (sharded over `context`)
