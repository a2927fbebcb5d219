"""Batched generation from the decoder with a KV cache: one prefill over the left-padded
prompts, then one cached forward per new token (`models/kv_cache.py`), all in one jitted
`lax.while_loop` that stops when every row has emitted a stop token (`prefill`, then
`decode_step` per token: the planner compiles the two alone, `planner/grpo_plan.py`).

    spec = SamplingSpec(max_new_tokens=32, temperature=1.0, top_p=0.9, stop_tokens=(10,))
    prompts, lengths = left_pad([[1, 2, 3], [4, 5]], pad_id=0)   # (B, P), (B,)
    out = generate(decoder, prompts, lengths, key, spec)          # traced: under jit
    out["tokens"] (B, N) int32, pad_id after each row's end; out["lengths"] (B,) int32

Sampling (`sample_logits`), per row and step: logits / temperature, then top-k (k largest
kept), then top-p (the smallest set of most probable tokens whose mass reaches p, as
transformers' `TopPLogitsWarper`), then a categorical draw with the step's key
`fold_in(key, step)`; temperature 0 is greedy. A row's completion ends after its first stop
token (the stop token counted in its length) or at `max_new_tokens`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fsdp_jax.app.models.kv_cache import forward_cached, init_cache


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
    """How new tokens are drawn: `top_k` 0 = off, `top_p` 1.0 = off, `temperature` 0 = greedy."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_tokens: tuple[int, ...] = ()
    pad_id: int = 0


def left_pad(rows, pad_id: int = 0, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> (prompts (B, P) int32 left-padded with `pad_id`, lengths (B,) int32);
    P = `width` or the longest row."""
    p = width or max(len(r) for r in rows)
    out = np.full((len(rows), p), pad_id, np.int32)
    for i, r in enumerate(rows):
        if len(r):
            out[i, p - len(r) :] = r
    return out, np.asarray([len(r) for r in rows], np.int32)


def sample_logits(logits, key, spec: SamplingSpec):
    """(B, V) logits -> (B,) int32 tokens under `spec`'s temperature, top-k and top-p."""
    logits = logits.astype(jnp.float32)
    if spec.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / spec.temperature
    if spec.top_k:
        kth = jax.lax.top_k(logits, spec.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if spec.top_p < 1.0:
        desc = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(desc, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more probable tokens
        kept = jnp.where(before < spec.top_p, desc, jnp.inf)
        logits = jnp.where(logits < jnp.min(kept, axis=-1, keepdims=True), -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def prefill(model, prompts, lengths, max_new_tokens: int):
    """The generation's first forward: (last logits (B, V) float32, KV cache of P +
    `max_new_tokens` slots holding the prompts). `prompts` (B, P) left-padded, `lengths` (B,)."""
    b, p = prompts.shape
    start = (p - lengths).astype(jnp.int32)
    cache = init_cache(model.cfg, b, p + max_new_tokens, model.embed[...].dtype)
    logits, cache = forward_cached(model, prompts, cache, 0, start)
    return logits[:, -1].astype(jnp.float32), cache


def decode_step(model, last, cache, index, start, done, key, spec: SamplingSpec):
    """One decode step: (token (B,) int32 drawn from `last` (B, V) with `key`, `spec.pad_id`
    where `done` (B,) bool, the logits (B, V) float32 after it, the cache with its slot
    `index` written). `start` (B,): each row's first real slot. Done rows still run."""
    tok = jnp.where(done, spec.pad_id, sample_logits(last, key, spec))
    lg, cache = forward_cached(model, tok[:, None], cache, index, start)
    return tok, lg[:, 0].astype(jnp.float32), cache


def generate(model, prompts, lengths, key, spec: SamplingSpec, return_logits: bool = False) -> dict:
    """Sample up to `spec.max_new_tokens` after each left-padded prompt (traced; jit it):
    `prefill`, then `decode_step` in a `lax.while_loop`.

    `model`: a bound `decoder.Decoder` (params in their compute dtype); `prompts` (B, P)
    int32, `lengths` (B,) int32 real tokens per row. Returns {"tokens" (B, N) int32,
    "lengths" (B,) int32 completion lengths} and, with `return_logits`, "logits" (B, N, V)
    float32: the logits each token was drawn from (tests compare them with the full forward)."""
    b, p = prompts.shape
    n = spec.max_new_tokens
    start = (p - lengths).astype(jnp.int32)
    last, cache = prefill(model, prompts, lengths, n)
    stops = jnp.asarray(spec.stop_tokens or (-1,), jnp.int32)
    v = last.shape[-1]
    state = {
        "i": jnp.int32(0),
        "last": last,
        "cache": cache,
        "tokens": jnp.full((b, n), spec.pad_id, jnp.int32),
        "done": jnp.zeros((b,), bool),
        "lengths": jnp.zeros((b,), jnp.int32),
    }
    if return_logits:
        state["logits"] = jnp.zeros((b, n, v), jnp.float32)

    # the weights ride in the loop state (NNX refuses a module captured from an outer trace)
    graphdef, state["weights"] = nnx.split(model)

    def body(st):
        i = st["i"]
        m = nnx.merge(graphdef, st["weights"])
        tok, last, cache = decode_step(
            m, st["last"], st["cache"], p + i, start, st["done"], jax.random.fold_in(key, i), spec
        )
        out = dict(st, i=i + 1, tokens=st["tokens"].at[:, i].set(tok), last=last, cache=cache)
        out["lengths"] = st["lengths"] + (~st["done"]).astype(jnp.int32)
        out["done"] = st["done"] | jnp.isin(tok, stops)
        if return_logits:
            out["logits"] = st["logits"].at[:, i].set(st["last"])
        return out

    def cond(st):
        return (st["i"] < n) & ~jnp.all(st["done"])

    final = jax.lax.while_loop(cond, body, state)
    res = {"tokens": final["tokens"], "lengths": final["lengths"]}
    if return_logits:
        res["logits"] = final["logits"]
    return res
