"""Attention bytes per device under context parallelism (`mesh.context` > 1): what
`fsdp_jax.attention.ring.context_attention` holds, by formula, for the analytic
memory model (`fsdp_jax.app.planner.memory_model.activation_bytes`).

With C = context, b = sequences per device, s = S / C (a rank's queries), T = b x s
tokens per device, H heads, Q = H x head_dim, K = kv_heads x head_dim, c = compute-dtype
bytes: a rank meets C blocks of keys, its own (s x s, causal) and C - 1 half blocks (the
zig-zag causal mask leaves s x s/2 of each); a score block is computed `q_chunk` queries
at a time (`ring_attention._chunked`) and rematerialised in the backward pass. Read from
`jax.ad_checkpoint.print_saved_residuals` of `context_attention` under each remat policy,
as its record (`fsdp_jax.sharding.remat.RematPolicy`) keeps the attention core's dots
(`planner/residuals.py`: `ATTN_CORE`) or everything:

* `dots` saves every step's score dots in f32 (the outer policy reaches inside the
  checkpointed blocks, and a `lax.cond` keeps both branches' residuals, so each half-block
  step saves s x s scores: C x b x H x s^2 x 4 per layer) and each step's f32 output dot
  (4Q per token);
* `none` saves, per step, both branches' q, k, v slices and block outputs (f32 output and
  softmax statistics): 1.5 x T x (c(Q + 2K) + 4Q + 8H);
* the other policies save nothing of attention beyond the layer input.

One layer's backward works on the largest score block (b x H x q x s, q = q_chunk when s is
split, else s), counted at 8 + 2c bytes a score. Read from the compiled steps' buffer
assignments: XLA:CPU's f32 tiny step at context 2 and 4 holds four f32 buffers of it at once
(`exp(s - m)`, the probabilities `_stats` recomputes; the dot of the output's cotangent with v;
the score gradient and its transposed copy, the operands of the dq and dK dots): 16 bytes, as
counted. Deviceless XLA:GPU with bf16 compute fuses more: Llama-3.1-8B at 131072 tokens on 8
context ranks holds three (the f32 score gradient, its bf16 copy, an f32 transposed copy: 10
bytes) and a 4096-token ring on 4 ranks about 11, so in bf16 the count is 1-2 bytes a score
high on GPU. Plus every step's f32 output and
statistics (kept for the merges' backward: C x T x (4Q + 8H)) and the K/V it meets: the
gathered K/V over the whole row and its gradient (`all_gather`: 2 x b x S x 2K x c), or the
block in flight and the next one, forward and backward (`ring`: 4 x b x s x 2K x c). Under
`dots` the backward loop also copies one layer's saved half-block scores out of the stacked
residuals (the operands of each step's `lax.cond`, both branches: (C - 1) x b x H x s^2 x 4),
as the buffer assignment shows next to the stack.

With a flash kernel per block (`attention: cudnn` or `splash`: `fsdp_jax.attention.flash`)
there is no score block: the custom VJP saves q, k, v, the output and its log-sum-exp
(T x (c(2Q + 2K) + 4H), under `none` only: the other policies recompute the ring); one layer's
backward holds the f32 running output and lse (T x (4Q + 4H)), the f32 dq and dK/dV
(T x 4(Q + 2K), or over the gathered row, b x S x 8K, with `all_gather`) and the K/V it meets
(as above).
"""

from __future__ import annotations

from fsdp_jax.app.planner.residuals import ATTN_CORE, rematerialised


def score_block(seq_local: int, q_chunk: int) -> int:
    """Queries per score block: `q_chunk` when a rank's queries split into such chunks, else all."""
    return q_chunk if seq_local > q_chunk and seq_local % q_chunk == 0 else seq_local


def context_attention_bytes(
    model_cfg, remat: str, batch_per_device: int, seq_len: int, compute_bytes: int, context: int, q_chunk: int
) -> dict[str, int]:
    """{"saved": bytes one layer keeps for the backward pass, "working": one layer's backward}
    of context-parallel attention per device (module docstring)."""
    c, n = compute_bytes, context
    b, s = batch_per_device, seq_len // context
    t = b * s
    h = model_cfg.n_heads
    q = h * model_cfg.head_dim
    k = model_cfg.n_kv_heads * model_cfg.head_dim
    policy = rematerialised(remat)
    if policy.keeps_everything:
        saved = n * t * 3 * (c * (q + 2 * k) + 4 * q + 8 * h) // 2
    else:  # every step's f32 score and output dots: dots with batch dims
        saved = n * b * h * s * s * 4 + n * t * 4 * q if policy.keeps(ATTN_CORE) else 0
    block = b * h * score_block(s, q_chunk) * s * (8 + 2 * c)
    if policy.keeps(ATTN_CORE) and not policy.keeps_everything:  # one layer's saved steps, sliced out
        block += (n - 1) * b * h * s * s * 4
    outputs = n * t * (4 * q + 8 * h)
    kv_pass = getattr(model_cfg, "context_kv_pass", "all_gather")
    kv = 2 * b * seq_len * 2 * k * c if kv_pass == "all_gather" else 4 * t * 2 * k * c
    if getattr(model_cfg, "attention", "xla") in ("cudnn", "splash"):  # flash per block: no score block
        saved = t * (c * (2 * q + 2 * k) + 4 * h) if policy.keeps_everything else 0
        grads = t * 4 * q + (b * seq_len * 8 * k if kv_pass == "all_gather" else t * 8 * k)
        return {"saved": saved, "working": t * (4 * q + 4 * h) + grads + kv}
    return {"saved": saved, "working": block + outputs + kv}
