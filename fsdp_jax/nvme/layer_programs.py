"""The jitted programs of the layer-wise step (`fsdp_jax.nvme.layerwise.LayerwiseStep`): the
embedding, one layer's forward, the head's loss and grads, one layer's backward (the vjp at the
kept input, its grads' per-leaf sums of squares), the embedding's backward, the global grad norm
and the updates of the rest and of one layer.

Each piece computes what the scanned train step (`fsdp_jax.train.step`) computes for that part of
the model, in the same dtypes, so the two agree bit for bit where their sums run in one order:
- precision (`Policy`): the float params (f32 masters) are cast to the compute dtype in their
  at-rest layout and the grads cast back through the reduce dtype (`precision.cast_leaf`, the
  scanned step's `cast_params_for_compute`); a layer's leaves inside its own vjp; the rest's
  (embedding, final norm, head) once per program, their compute-dtype grads from the head and the
  embedding added before the cast back, as JAX adds a tied table's two cotangents; the pieces are
  traced under `precision.reducing` (weight grads from dots in the reduce dtype);
- a loss that returns a `TokenSum` (packed or document-masked rows: the sum of the weighted
  token losses and their count) is differentiated as its total; the grads are divided once by
  the count of the whole batch (all microbatches), after the last slice, as `step_parts.normalize`;
- a batch is given whole to every piece: the layer reads what it needs besides its input
  (segment ids and positions of packed rows).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from fsdp_jax.nvme.step import FLAT, LAYERED, OTHER, cut, masked_update
from fsdp_jax.sharding.mesh import constrain
from fsdp_jax.sharding.precision import Policy, cast_leaf, reducing
from fsdp_jax.train.step_parts import TokenSum

# how the last slice's layer grads are divided (static): not at all (one slice of a mean loss),
# by the number of slices (a mean loss), by the batch's token count (a TokenSum loss)
NO_DIVISION, BY_SLICES, BY_TOKENS = "none", "slices", "tokens"


def _clip(g, norm, clip_norm):
    """`optax.clip_by_global_norm(clip_norm)` of one leaf, given the global norm."""
    if not clip_norm:
        return g
    return jax.lax.select(jnp.squeeze(norm < clip_norm), g, (g / norm.astype(g.dtype)) * clip_norm)


def _floating(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def casts(policy: Policy, dtypes) -> bool:
    """Does a float leaf of one of `dtypes` change dtype for compute or for the reduction under `policy`?"""
    floats = [d for d in dtypes if jnp.issubdtype(d, jnp.floating)]
    return any(policy.compute_dtype != d or policy.reduce_dtype != d for d in floats)


class Programs:
    """The step's programs (module docstring). `layers_def`: the layer params' treedef;
    `layer_sh` / `rest_sh`: the at-rest shardings of a layer's leaves (1, ...) and of the rest;
    `labels`, `treedef`: the optimizer state's LAYERED / FLAT / OTHER marks and treedef;
    `empty_layers()` / `empty_rest()`: zero-layer stand-ins for the half of the params an update
    does not touch; `state_sh`: the state files' shardings."""

    def __init__(self, pieces, optimizer, policy: Policy, layers_def, layer_sh, rest_sh, state_sh, labels, treedef,
                 empty_layers: Callable, empty_rest: Callable, clip_norm=None, skip_nonfinite=True, microbatches=1):  # fmt: skip
        self.pieces, self.policy, self.k = pieces, policy, microbatches
        dtypes = [x.dtype for x in jax.tree.leaves(empty_layers())] + [x.dtype for x in jax.tree.leaves(empty_rest())]
        self.casts = casts(policy, dtypes)
        self._layers_def, self._layer_sh, self._rest_sh = layers_def, list(layer_sh), rest_sh
        self.embed = jax.jit(self._embed)
        self.fwd = jax.jit(self._fwd)
        self.head = jax.jit(self._head)
        self.bwd = jax.jit(self._bwd, out_shardings=(self._layer_sh, None, None), static_argnums=(5,))
        self.mb_slice = jax.jit(self._mb_slice, static_argnums=(1,))
        self.embed_bwd = jax.jit(self._embed_bwd, out_shardings=rest_sh)
        self.norm = jax.jit(self._norm)
        self.rest_update = jax.jit(
            lambda *a: _rest_update(optimizer, labels, empty_layers, clip_norm, skip_nonfinite, *a)
        )
        self.layer_update = jax.jit(
            lambda *a: _layer_update(optimizer, labels, treedef, layers_def, empty_rest, clip_norm, skip_nonfinite, *a),
            out_shardings=(self._layer_sh, list(state_sh)),
        )

    # ------------------------------------------------------------------ casts

    def _layer(self, p):
        """A layer's arrays (1, ...) -> its params tree (no layer dim), cast for compute."""
        if self.casts:
            c, r = self.policy.compute_dtype, self.policy.reduce_dtype
            p = [cast_leaf(x, s, c, r) for x, s in zip(p, self._layer_sh)]
        return jax.tree.unflatten(self._layers_def, [x[0] for x in p])

    def _to_compute(self, rest):
        """The rest in the compute dtype, in its at-rest layout (the cast's forward)."""
        if not self.casts:
            return rest
        c = self.policy.compute_dtype
        return jax.tree.map(lambda x, s: constrain(x.astype(c) if _floating(x) else x, s), rest, self._rest_sh)

    def _from_compute(self, g, rest):
        """Compute-dtype grads of the rest back in the params' dtypes (the cast's backward)."""
        if not self.casts:
            return g
        r = self.policy.reduce_dtype
        return jax.tree.map(lambda x, s, p: constrain(x.astype(r), s).astype(p.dtype), g, self._rest_sh, rest)

    # ------------------------------------------------------------------ forward and backward

    def _embed(self, rest, batch):
        with reducing(self.policy):
            return self.pieces.embed(self._to_compute(rest), batch)

    def _fwd(self, p, h, batch):
        with reducing(self.policy):
            return self.pieces.layer(self._layer(p), h, batch)

    def _head(self, rest, h, batch):
        """(loss (f32; a TokenSum's total), its count or None, the head's metrics or None (a head
        that returns `(loss, aux)`), grads of the rest in the compute dtype, the cotangent of h)."""

        def f(rc, x):
            with reducing(self.policy):
                out = self.pieces.head(rc, x, batch)
            out, aux = out if isinstance(out, tuple) and not isinstance(out, TokenSum) else (out, None)
            if isinstance(out, TokenSum):  # differentiate the sum; the count rides along
                return out.total.astype(jnp.float32), (out.count.astype(jnp.float32), aux)
            return out.astype(jnp.float32), (None, aux)

        (loss, (count, aux)), (g, ct) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(self._to_compute(rest), h)
        return loss, count, aux, g, ct

    def _bwd(self, p, h, ct, batch, acc, div, n=None):
        """Layer i's grads (plus `acc`, the earlier slices' sum, when given; divided after the
        last slice as `div` says, by `n` the token count), the cotangent of h_i, the grads'
        per-leaf sums of squares (`optax.tree.norm`'s)."""

        def f(q, x):
            with reducing(self.policy):
                return self.pieces.layer(self._layer(q), x, batch)

        g, ct_h = jax.vjp(f, p, h)[1](ct)
        if acc is not None:  # as `microbatched`'s accumulator
            g = [a + b.astype(a.dtype) for a, b in zip(acc, g)]
        if div == BY_SLICES:
            g = [a / self.k for a in g]
        elif div == BY_TOKENS:  # `step_parts.normalize`
            g = [(a / n).astype(a.dtype) for a in g]
        return g, ct_h, [jnp.sum(jnp.square(x)) for x in g]

    def _embed_bwd(self, rest, batch, ct, g_head):
        """The rest's grads: the embedding's vjp added to the head's (compute dtype), cast back."""
        with reducing(self.policy):
            (g,) = jax.vjp(lambda r: self.pieces.embed(r, batch), self._to_compute(rest))[1](ct)
        return self._from_compute(jax.tree.map(jnp.add, g_head, g), rest)

    def _mb_slice(self, b, j):  # rows j, j + k, j + 2k, ...: `step_parts._split_microbatches`' slice j
        k = self.k
        return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:])[:, j], b)

    def _norm(self, g_rest, per_layer):
        sums = [sum(xs[1:], xs[0]) for xs in zip(*per_layer)]  # per leaf, layers 0..L-1 in order
        tree = {"layers": jax.tree.unflatten(self._layers_def, sums), "rest": jax.tree.map(jnp.square, g_rest)}
        leaves = [x if k < len(sums) else jnp.sum(x) for k, x in enumerate(jax.tree.leaves(tree))]
        return jnp.sqrt(sum(leaves[1:], leaves[0]) if len(leaves) > 1 else leaves[0])


def _rest_update(optimizer, labels, empty_layers, clip, skip, rest, opt_state, g_rest, loss, gnorm):
    ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
    params = {"layers": empty_layers(), "rest": rest}
    grads = {"layers": empty_layers(), "rest": jax.tree.map(lambda g: _clip(g, gnorm, clip), g_rest)}
    new_p, new_s = masked_update(optimizer, grads, cut(opt_state, labels, FLAT), params, ok, skip)
    return new_p["rest"], new_s, ok, cut(opt_state, labels, OTHER)


def _layer_update(optimizer, labels, treedef, layers_def, empty_rest, clip, skip, p, s, g, other, ok, gnorm):
    params = {"layers": jax.tree.unflatten(layers_def, p), "rest": empty_rest()}
    g = [_clip(x, gnorm, clip) for x in g]
    grads = {"layers": jax.tree.unflatten(layers_def, g), "rest": empty_rest()}
    it, marks = iter(s), jax.tree.leaves(labels)
    opt = jax.tree.unflatten(treedef, [next(it) if m == LAYERED else x for x, m in zip(jax.tree.leaves(other), marks)])
    new_p, new_s = masked_update(optimizer, grads, opt, params, ok, skip)
    return jax.tree.leaves(new_p["layers"]), [x for x, m in zip(jax.tree.leaves(new_s), marks) if m == LAYERED]
