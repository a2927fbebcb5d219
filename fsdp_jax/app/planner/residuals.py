"""What one layer keeps for its backward pass under a remat policy, by formula: the
residuals of the reference decoder's dense layer and their bytes per token, read through
the policy's record (`fsdp_jax.sharding.remat.RematPolicy`: which residuals it keeps).

With c = bytes of the compute dtype, D = d_model, Q = heads x head_dim, K = kv_heads x
head_dim, F = ffn_dim, H = heads, S = seq_len, a dense layer's residuals per token are
(`dense_residuals`): q/k/v c*(Q + 2K) (dots without batch dims, named `qkv`); the attention
core's f32 scores and its output 4*H*S + c*Q (dots with batch dims; with flash attention
the fused kernel's matmuls are no dots: none); the out projection c*D (`attn_out`); gate
and up c*2F; the down projection c*D (`mlp_out`). A policy keeps those its record selects
(`RematPolicy.keeps`); one that keeps everything (no remat) keeps
c*(3D + 2Q + 2K + 4F) + H*S*(4 + c) (`everything_per_token`: norm outputs, q/k/v, attention
output, SwiGLU gate/up/silu/product, softmax probabilities in f32 and the compute dtype;
flash: the f32 softmax statistics, 4H, instead of the probabilities). So the shipped
policies: none as that; dots c*(2Q + 2K + 2D + 2F) + 4*H*S; dots_no_batch
c*(Q + 2K + 2D + 2F); save_attn_mlp_out 2cD; save_qkv_attn_mlp_out c*(Q + 2K + 2D);
full and the offloading policies 0 on the device.
"""

from __future__ import annotations

from fsdp_jax.errors import PlanError
from fsdp_jax.sharding.remat import REMAT_POLICIES, RematPolicy, Residual

# one dense layer's residuals as a policy sees them (checkpoint name, made by a dot, batch dims)
QKV = Residual("qkv", dot=True)
ATTN_CORE = Residual("", dot=True, batch_dims=True)  # the f32 scores and their product with v
ATTN_OUT = Residual("attn_out", dot=True)  # the out projection
GATE_UP = Residual("", dot=True)  # the SwiGLU gate and up projections
MLP_OUT = Residual("mlp_out", dot=True)  # the down projection


def rematerialised(remat: str) -> RematPolicy:
    """The record of remat policy `remat`; PlanError naming the known ones for any other."""
    if remat not in REMAT_POLICIES:
        raise PlanError(f"remat: no activation formula for policy {remat!r}; known: {', '.join(REMAT_POLICIES)}")
    return REMAT_POLICIES[remat]


def dense_residuals(model_cfg, seq_len: int, compute_bytes: int) -> tuple[tuple[Residual, int], ...]:
    """The residuals a policy may keep of one dense layer and their bytes per token, beyond
    its input (module docstring): q/k/v, the attention core's f32 scores and its output
    (dots with batch dims; with flash attention no dots at all), the out projection
    (`attn_out`), gate/up and the down projection (`mlp_out`)."""
    c, d, f, h = compute_bytes, model_cfg.d_model, model_cfg.ffn_dim, model_cfg.n_heads
    q, k = h * model_cfg.head_dim, model_cfg.n_kv_heads * model_cfg.head_dim
    core = () if flash(model_cfg) else ((ATTN_CORE, 4 * h * seq_len + c * q),)
    return ((QKV, c * (q + 2 * k)), *core, (ATTN_OUT, c * d), (GATE_UP, c * 2 * f), (MLP_OUT, c * d))


def everything_per_token(model_cfg, seq_len: int, compute_bytes: int) -> int:
    """Bytes one dense layer keeps per token without remat, beyond its input: norm outputs,
    q/k/v, attention output, SwiGLU gate/up/silu/product, softmax probabilities in f32 and
    the compute dtype (flash: the f32 softmax statistics instead)."""
    c, d, f, h = compute_bytes, model_cfg.d_model, model_cfg.ffn_dim, model_cfg.n_heads
    q, k = h * model_cfg.head_dim, model_cfg.n_kv_heads * model_cfg.head_dim
    probs = 4 * h if flash(model_cfg) else h * seq_len * (4 + c)
    return c * (3 * d + 2 * q + 2 * k + 4 * f) + probs


def saved_per_token(model_cfg, remat: str, seq_len: int, compute_bytes: int) -> int:
    """Bytes one layer keeps per token on the device for the backward pass under `remat`,
    beyond its input: what its record keeps of `dense_residuals` (module docstring)."""
    policy = rematerialised(remat)
    if policy.keeps_everything:
        return everything_per_token(model_cfg, seq_len, compute_bytes)
    return sum(b for r, b in dense_residuals(model_cfg, seq_len, compute_bytes) if policy.keeps(r))


def flash(model_cfg) -> bool:
    """Flash attention (`attention: cudnn` on GPU, `splash` on TPU) keeps no S x S attention logits."""
    return getattr(model_cfg, "attention", "xla") in ("cudnn", "splash")
