"""FSDP for a Flax Linen model: a small decoder-only transformer on 8 CPU devices.

    python examples/linen_transformer.py [--steps 20] [--tensor 1]

Parameters and activations carry MaxText-style logical names (`embed`, `mlp`,
`heads`, `kv`, `vocab`, `norm`; `batch`, `length` for activations) through
`nn.with_logical_partitioning` / `nn.with_logical_constraint`. fsdp_jax's rules
table maps `embed -> fsdp` and `mlp`, `heads`, `vocab -> tensor`, so
`--tensor 2` runs FSDP x tensor parallel on a 4 x 2 mesh with the same model code.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)  # CPU only: 8 fake devices (drop on GPU)

import argparse  # noqa: E402
import dataclasses  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402

import fsdp_jax as fj  # noqa: E402
from fsdp_jax.model.fns import from_linen  # noqa: E402
from fsdp_jax.train.shard_model import shard_model  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 128
    d_model: int = 64
    n_heads: int = 4
    head_dim: int = 16
    mlp_dim: int = 256
    n_layers: int = 2
    max_len: int = 32


def param(module: nn.Module, name: str, shape, names, init=nn.initializers.normal(0.02)):
    """A parameter whose dims are named `names` (logical names, no mesh axes)."""
    return module.param(name, nn.with_logical_partitioning(init, names), shape)


def constrain(x, names):
    return nn.with_logical_constraint(x, names)


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = param(self, "scale", (x.shape[-1],), ("norm",), nn.initializers.ones)
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


class Attention(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x):  # (B, S, D)
        c = self.cfg
        qkv = [param(self, n, (c.d_model, c.n_heads, c.head_dim), ("embed", "heads", "kv")) for n in ("wq", "wk", "wv")]
        wo = param(self, "wo", (c.n_heads, c.head_dim, c.d_model), ("heads", "kv", "embed"))
        q, k, v = (
            constrain(jnp.einsum("bsd,dhk->bshk", x, w), ("batch", "length", "heads", "kv")) for w in qkv
        )  # (B, S, H, Dh)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # (B, S, H, Dh)
        return jnp.einsum("bshk,hkd->bsd", o, wo)


class MLP(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x):  # (B, S, D)
        c = self.cfg
        wi = param(self, "wi", (c.d_model, c.mlp_dim), ("embed", "mlp"))
        wo = param(self, "wo", (c.mlp_dim, c.d_model), ("mlp", "embed"))
        h = constrain(jax.nn.gelu(x @ wi), ("batch", "length", "mlp"))  # (B, S, F)
        return h @ wo


class Block(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x):
        x = constrain(x, ("batch", "length", "embed"))
        x = x + Attention(self.cfg, name="attn")(RMSNorm(name="attn_norm")(x))
        x = x + MLP(self.cfg, name="mlp")(RMSNorm(name="mlp_norm")(x))
        return constrain(x, ("batch", "length", "embed"))


class Transformer(nn.Module):
    """tokens (B, S) int -> logits (B, S, vocab)."""

    cfg: Config

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        table = param(self, "embed", (c.vocab, c.d_model), ("vocab", "embed"))
        pos = param(self, "pos_embed", (c.max_len, c.d_model), (None, "embed"))
        # gather the table over its embed dim before the lookup (as for any FSDP param)
        x = jnp.take(constrain(table, ("vocab", None)), tokens, axis=0) + pos[: tokens.shape[1]]
        for i in range(c.n_layers):
            x = Block(c, name=f"block_{i}")(x)
        x = RMSNorm(name="final_norm")(x)
        head = param(self, "head", (c.d_model, c.vocab), ("embed", "vocab"))
        return constrain(x @ head, ("batch", "length", "vocab"))


CFG = Config()


def make_model(cfg: Config = CFG):
    """Adapted for fsdp_jax: only shapes of the example input matter."""
    return from_linen(Transformer(cfg), jax.ShapeDtypeStruct((1, cfg.max_len), jnp.int32))


def make_batches(n: int, batch: int = 16, cfg: Config = CFG, seed: int = 1):
    """Learnable sequences of max_len + 1 tokens: start + stride * position (mod vocab)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        start = rng.integers(0, cfg.vocab, (batch, 1))
        stride = rng.integers(1, 4, (batch, 1))
        out.append(jnp.asarray((start + stride * np.arange(cfg.max_len + 1)) % cfg.vocab, jnp.int32))
    return out


def make_loss_fn(model):
    def loss_fn(params, tokens):  # tokens (B, S + 1)
        logits = model.apply(params, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss_fn


def main(steps: int = 20, tensor: int = 1):
    model = make_model()
    mesh = fj.make_mesh(fsdp=-1, tensor=tensor)
    opt = optax.adamw(3e-3)
    sm = shard_model(model, opt, mesh, "full_shard", rng=jax.random.key(0))
    print(sm.explain())
    step = sm.train_step(make_loss_fn(model))
    state = sm.state
    for i, tokens in enumerate(make_batches(steps)):
        state, metrics = step(state, tokens)
        print(f"step {i} loss {float(metrics['loss']):.6f}")  # blocks: bounds steps in flight on CPU
    b = sm.bytes_per_device(state)
    print(f"per-device bytes: params {b['params']} opt_state {b['opt_state']} total {b['total']}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tensor", type=int, default=1, help="tensor-parallel axis size (1, 2, 4, 8)")
    a = p.parse_args()
    main(a.steps, a.tensor)
