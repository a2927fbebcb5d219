"""The decoder's architecture as one frozen dataclass: `DecoderConfig` (families by its fields)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The decoder's architecture. Defaults are the Llama-2 reference; each family
    switch below is off by default and adds params only when on (docs/hf_models.md)."""

    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    ffn_dim: int = 704
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    scan_layers: bool = True
    attention: str = "xla"  # xla | cudnn (jax.nn.dot_product_attention) | splash (TPU Pallas kernel)
    context_kv_pass: str = "all_gather"  # mesh.context > 1: all_gather | ring (sharding/ring_attention.py)
    # attention cudnn, mesh.context > 1, packed rows: segments (documents, padding included) a row
    # may hold; cuDNN's packed layout per ring block is sized for them (the trainer checks each batch)
    max_segments: int = 128
    tie_word_embeddings: bool = False  # output head = embed.T (no separate head param)
    kv_channels: int = 0  # per-head width; 0 = d_model // n_heads (`head_dim` resolves it)
    # RoPE scaling (of global layers): default | linear | llama3 | yarn (models/rope.py)
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_max_len: int = 0  # llama3 / yarn: original_max_position_embeddings
    rope_beta_fast: float = 32.0  # yarn
    rope_beta_slow: float = 1.0  # yarn
    rope_attention_factor: float = 0.0  # yarn; 0 = derived from factor (and mscales)
    rope_mscale: float = 0.0  # yarn
    rope_mscale_all_dim: float = 0.0  # yarn
    rope_truncate: bool = True  # yarn
    qkv_bias: bool = False  # q/k/v projection biases (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3)
    sliding_window: int = 0  # keys within this many positions (query included); 0 = all
    global_every: int = 0  # >0: layer i is global (full attention) when (i+1) % this == 0,
    #                        the others slide with `rope_local_theta` RoPE; 0: all layers alike
    rope_local_theta: float = 0.0  # base of the sliding layers' RoPE; 0 = rope_theta
    attn_softcap: float = 0.0  # cap * tanh(scores / cap); 0 = off
    query_pre_attn_scalar: float = 0.0  # scores scaled by this ** -0.5; 0 = head_dim
    mlp_activation: str = "silu"  # silu | gelu_pytorch_tanh (gated MLP)
    norm_plus_one: bool = False  # RMSNorm scales by (1 + w), w initialised 0 (Gemma)
    sandwich_norm: bool = False  # extra norms on the attention and MLP outputs (Gemma)
    embed_scale: bool = False  # embeddings times sqrt(d_model) in the compute dtype (Gemma)
    final_softcap: float = 0.0  # logits = cap * tanh(logits / cap); 0 = off
    # mixture of experts (models/moe.py; which layers: models/stack.py); 0 experts = dense
    n_experts: int = 0
    experts_per_token: int = 0  # top-k
    moe_ffn_dim: int = 0  # each expert's hidden width
    norm_topk_prob: bool = False  # renormalise the top-k weights (Mixtral, Qwen3-MoE)
    shared_expert_ffn_dim: int = 0  # Qwen2-MoE's shared expert (sigmoid-gated); 0 = none
    # the clamped SwiGLU of biased experts (gpt-oss's sparse MLP part, models/moe_clamped.py):
    # gate clamped above at the limit, up to +-limit, (up + 1) * gate * sigmoid(alpha * gate)
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    # latent attention (DeepSeek-V3's part, models/latent_attention.py); head_dim is the RoPE dims
    q_lora_rank: int = 0  # q through a rank-r bottleneck and its RMSNorm; 0 = one projection
    kv_lora_rank: int = 0  # the compressed key/value width
    qk_nope_head_dim: int = 0  # per-head q/k dims without RoPE
    v_head_dim: int = 0  # per-head value dims
    # grouped sigmoid routing (DeepSeek-V3's part, models/moe_grouped.py)
    n_group: int = 0  # expert groups; a token's experts come from its topk_group best groups
    topk_group: int = 0
    routed_scaling_factor: float = 1.0  # the routed experts' weights times this
    shared_experts_ffn_dim: int = 0  # ungated shared experts' width (n_shared_experts x moe_ffn_dim)
    decoder_sparse_step: int = 1  # layer i sparse when (i + 1) % this == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    router_aux_loss_coef: float = 0.0  # load-balancing loss weight in the training loss
    router_z_loss_coef: float = 0.0  # router z-loss weight in the training loss
    # DeepSeek-V3's aux-loss-free balancing (app/trainer/expert_bias.py): after each step every
    # layer's score_bias += this * sign(mean load - load); 0 = the bias stays as imported
    bias_update_speed: float = 0.0
    # DeepSeek-V3's sequence-wise balance loss weight (the report's alpha; models/moe.py seq_balance)
    seq_aux_loss_coef: float = 0.0
    capacity_factor: float = 0.0  # > 0: tokens over an expert's capacity dropped; 0 = dropless
    grouped_matmul: str = "auto"  # dropless experts' kernel: auto | xla | tokamax (models/grouped_matmul.py)
    expert_exchange: str = "dense"  # experts over batch axes, dropless: dense | ragged all-to-all (GPU/TPU)
    # multi-token prediction (DeepSeek-V3 report sec. 2.2; models/mtp.py): depth k = 1..mtp_depth predicts
    # token t+k+1 from depth k-1's hidden and token t+k's embedding through one more block; the loss adds
    # mtp_loss_weight x the mean over depths of their cross-entropies. 0 = off (DeepSeek-V3: 1, weight 0.3 then 0.1)
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3
    # the model_type of a registered family whose own block parts build the blocks (its config.json
    # decides: `fsdp_jax.app.models.families.Family.parts`); "" = the decoder's own (every family so far)
    family: str = ""

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.d_model // self.n_heads

    def is_local(self, layer: int) -> bool:
        """Whether `layer` attends through the sliding window."""
        if not self.sliding_window:
            return False
        return not self.global_every or (layer + 1) % self.global_every != 0

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` (an MTP block: n_layers + k - 1) has the mixture of experts."""
        step = max(self.decoder_sparse_step, 1)
        return bool(self.n_experts) and layer not in set(self.mlp_only_layers) and (layer + 1) % step == 0

    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer: whether its MLP is the mixture of experts (Qwen's `decoder_sparse_step`
        and `mlp_only_layers`)."""
        return tuple(self.is_sparse(i) for i in range(self.n_layers))
