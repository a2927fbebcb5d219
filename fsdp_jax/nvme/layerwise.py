"""The layer-wise train step of `offload: optimizer+params:nvme`: the scanned layers' params,
optimizer state and grads in layer files, the forward and backward fed a layer at a time.

    pieces = Pieces(embed, layer, head)              # the model cut at its layer boundaries
    lw = LayerwiseStep(pieces, optimizer, abstract, dirs, owner="run-1", clip_norm=1.0)
    live = lw.put(params, opt_state)                 # layers to the files; what stays on the device
    live, metrics = lw.train_step(live, batch)
    params, opt_state = lw.gather(live)              # the whole state again (compare, checkpoint)

`params` is `{"layers": stacked, "rest": ...}`: `layers` the scanned layers' leaves (dim 0 =
layer, unsharded), `rest` the rest (embedding, final norm, head), which stays on the device;
`opt_state` is `optimizer.init(params)`. Three sets of layer files (`LayerFiles`, kinds
"params", "state", "grads") hold, per layer, the layer's params, its optimizer-state slices
(Adam's mu and nu) and its grads. A step is:

1. `embed(rest, batch)` -> h_0; per layer i: `layer(p_i, h_i, batch)` -> h_{i+1}, p_i read from its
   file (layer i+1 read while i computes), h_i kept; `head(rest, h_L, batch)` -> loss, its
   grads and the cotangent of h_L;
2. per layer in reverse: p_i read again, `jax.vjp` of `layer` at (p_i, h_i) -> layer i's grads
   (written to its grads file) and the cotangent of h_i; the embedding's vjp last;
3. the global grad norm from each layer's per-leaf sums of squares (added over layers in order)
   and the rest's grads; `ok` = loss and norm finite; the rest updated on the device;
   With `microbatches` k > 1, steps 1-2 run per slice of the batch (rows j, j + k, ...), each
   layer's grads summed through its grads file in slice order and divided by k after the last
   (a `TokenSum` loss: by the batch's token count);
4. per layer: params, state and grads read (i+1 while i updates), clipped as
   `optax.clip_by_global_norm` clips with that norm, the same `optimizer.update` as on the
   whole tree and the same non-finite select, params and state written back.

Host memory: two page-aligned buffers per set of files read (6 layers' worth of params /
state / grads in all) plus two for writes. Exactness against the scanned step is measured in
tests/test_nvme_layerwise.py and docs/offload.md ("Params on disk"). `precision` (a `Policy` or
its string): the float params cast for compute inside the pieces' programs, as the scanned step
casts them (`layer_programs`). The trainer runs it through `app.trainer.params_nvme`.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fsdp_jax.errors import OffloadError
from fsdp_jax.nvme import checkpoint_stream, layer_programs
from fsdp_jax.nvme.layer_files import LayerFiles, Layout
from fsdp_jax.nvme.step import FLAT, LAYERED, OTHER, empty_layers
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.train.stream_update import elementwise_reason


@dataclasses.dataclass(frozen=True)
class Pieces:
    """The model at its layer boundaries (each jitted by the step):
    `embed(rest, batch) -> h` (B, S, D); `layer(p, h, batch) -> h`, p one layer's params with no
    layer dim (the batch for what a layer reads besides h: packed rows' segment ids and
    positions); `head(rest, h, batch) -> loss` (a float scalar, or a `TokenSum` averaged over the
    batch's tokens), or `(loss, aux)`: aux the loss's metrics (a preference loss's rewards), not
    differentiated, returned as the step's `metrics["aux"]`. The params arrive in the compute
    dtype (`precision`)."""

    embed: Callable
    layer: Callable
    head: Callable


KINDS = ("params", "state", "grads")


def _marks(params):
    return {
        "layers": jax.tree.map(lambda _: LAYERED, params["layers"]),
        "rest": jax.tree.map(lambda _: FLAT, params["rest"]),
    }


class LayerwiseStep:
    """See the module docstring. `abstract`: `{"layers", "rest"}` of sharded
    ShapeDtypeStructs (or arrays); `batch_sharding`: where a batch is put (None: as given)."""

    def __init__(self, pieces: Pieces, optimizer, abstract, dirs, owner: str, clip_norm=None, skip_nonfinite=True,
                 batch_sharding=None, microbatches: int = 1, precision=None):  # fmt: skip
        self.pieces, self.optimizer, self.clip, self.skip = pieces, optimizer, clip_norm, skip_nonfinite
        self.batch_sharding, self.microbatches = batch_sharding, microbatches
        if microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {microbatches}")
        st = jax.eval_shape(optimizer.init, abstract)
        reason = elementwise_reason(optimizer, abstract, st)
        if reason is not None:  # before any file is written
            raise OffloadError(
                f"offload: 'optimizer+params:nvme' updates one layer at a time from disk, but the {reason}, "
                "so a layer's slice would not update as its leaf does"
            )
        self.labels = optax.tree_utils.tree_map_params(
            optimizer, lambda _, m: m, st, _marks(abstract), transform_non_params=lambda _: OTHER
        )
        marks = jax.tree.leaves(self.labels)
        self._treedef = jax.tree.structure(st)
        self._stacked = [k for k, m in enumerate(marks) if m == LAYERED]
        opt_sh = optax.tree_utils.tree_map_params(
            optimizer, lambda _, x: x.sharding, st, abstract, transform_non_params=lambda _: None
        )
        st_leaves, sh_leaves = jax.tree.leaves(st), jax.tree.leaves(opt_sh, is_leaf=lambda x: x is None)
        state_spec = [jax.ShapeDtypeStruct(st_leaves[k].shape, st_leaves[k].dtype, sharding=sh_leaves[k])
                      for k in self._stacked]  # fmt: skip
        p_layout, s_layout = Layout.of(jax.tree.leaves(abstract["layers"])), Layout.of(state_spec)
        self.files = LayerFiles.open_sets(dirs, dict(zip(KINDS, (p_layout, s_layout, p_layout))), owner)
        self.n_layers = p_layout.n_layers
        self._layers_def = jax.tree.structure(abstract["layers"])
        self._layer_dtypes = [np.dtype(x.dtype) for x in jax.tree.leaves(abstract["layers"])]
        self._rest_sh = jax.tree.map(lambda x: x.sharding, abstract["rest"])
        self._rest_abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract["rest"])
        self._io = (cf.ThreadPoolExecutor(1, "nvme-read"), cf.ThreadPoolExecutor(1, "nvme-write"))
        self._read_bufs = {k: [f.buffer(), f.buffer()] for k, f in self.files.items()}
        self._writes: list = []  # (future, buffer) of writes in flight
        self._saving: list = []  # (StackWriter, check) of a checkpoint streaming out of the files
        self._jit_programs(p_layout, precision)

    @property
    def stacked(self) -> list[int]:
        """The indices, among `optimizer.init(params)`'s leaves, of those kept in the state files."""
        return list(self._stacked)

    # ------------------------------------------------------------------ the programs

    def _jit_programs(self, p_layout: Layout, policy) -> None:
        self._prog = layer_programs.Programs(
            self.pieces, self.optimizer, Policy.parse(policy), self._layers_def, p_layout.shardings, self._rest_sh,
            self.files["state"].layout.shardings, self.labels, self._treedef, self._empty_layers, self._empty_rest,
            self.clip, self.skip, self.microbatches,
        )  # fmt: skip

    def _empty_layers(self):
        shapes = self.files["params"].layout
        return jax.tree.unflatten(self._layers_def, [jnp.zeros((0, *s[1:]), e)
                                                     for s, e in zip(shapes.shapes, self._layer_dtypes)])  # fmt: skip

    def _empty_rest(self):
        return jax.tree.map(lambda x: jnp.zeros((0, *x.shape[1:]) if x.ndim else (), x.dtype), self._rest_abstract)

    # ------------------------------------------------------------------ the files

    def _stream(self, kinds, order):
        """Yield (i, per kind layer i's arrays) for i in `order`, layer order[k+1] read while k is used."""
        order = list(order)

        def read(i, slot):
            return [self.files[k].read(i, self._read_bufs[k][slot]) for k in kinds]

        pending = self._io[0].submit(read, order[0], 0)
        for k, i in enumerate(order):
            bufs = pending.result()
            arrays = [self.files[kind].layout.to_arrays(b, copy=True) for kind, b in zip(kinds, bufs)]
            if k + 1 < len(order):
                pending = self._io[0].submit(read, order[k + 1], (k + 1) % 2)
            yield i, arrays

    def _write(self, kind: str, i: int, arrays) -> None:
        """Layer i's `arrays` into its `kind` file, in the background (two writes in flight)."""
        jax.block_until_ready(arrays)
        if len(self._writes) >= 2:
            self._writes.pop(0)[0].result()
        files = self.files[kind]
        buf = files.buffer()
        files.layout.from_arrays(arrays, buf)
        self._writes.append((self._io[1].submit(files.write, i, buf), buf))

    def _flush(self) -> None:
        while self._writes:
            self._writes.pop(0)[0].result()

    def put(self, params, opt_state) -> dict:
        """Write the layers' params and stacked optimizer state to the files; returns the live
        state `{"rest", "opt_state"}` (the stacked leaves cut to zero layers)."""
        self._saved()
        layers, st = jax.tree.leaves(params["layers"]), jax.tree.leaves(opt_state)
        for i in range(self.n_layers):
            self._write("params", i, [x[i : i + 1] for x in layers])
            self._write("state", i, [st[k][i : i + 1] for k in self._stacked])
        self._flush()
        return {"rest": params["rest"], "opt_state": jax.tree.map(lambda x, m: empty_layers(x) if m == LAYERED else x,
                                                                 opt_state, self.labels)}  # fmt: skip

    def gather(self, live: dict):
        """(params, opt_state) whole from `live` and the files (each layer read once)."""
        self._saved()
        per = [arrays for _, arrays in self._stream(("params", "state"), range(self.n_layers))]
        layers = [jnp.concatenate(xs) for xs in zip(*(a[0] for a in per))]
        stacked = [jnp.concatenate(xs) for xs in zip(*(a[1] for a in per))]
        leaves = jax.tree.leaves(live["opt_state"])
        for k, x in zip(self._stacked, stacked):
            leaves[k] = x
        params = {"layers": jax.tree.unflatten(self._layers_def, layers), "rest": live["rest"]}
        return params, jax.tree.unflatten(self._treedef, leaves)

    # ------------------------------------------------------------------ the step

    def train_step(self, live: dict, batch) -> tuple[dict, dict]:
        """One step (module docstring); returns the new live state and {loss, grad_norm, skipped}
        (and `tokens`, the batch's trained token count, for a `TokenSum` loss; `aux`, the head's
        metrics, for a head that returns them)."""
        self._saved()  # a checkpoint streaming out of the files ends before they change
        batch = batch if self.batch_sharding is None else jax.device_put(batch, self.batch_sharding)
        rest, n, pr = live["rest"], self.n_layers, self._prog
        loss, g_rest, sums, tokens, aux = self._grads(rest, batch)
        gnorm = pr.norm(g_rest, sums)
        new_rest, opt_state, ok, other = pr.rest_update(rest, live["opt_state"], g_rest, loss, gnorm)
        for i, (p, s, g) in self._stream(KINDS, range(n)):
            new_p, new_s = pr.layer_update(p, s, g, other, ok, gnorm)
            self._write("params", i, new_p)
            self._write("state", i, new_s)
        self._flush()
        out = pr.policy.output_dtype
        metrics = {"loss": loss.astype(out), "grad_norm": gnorm, "skipped": (~ok).astype(jnp.int32)}
        if tokens is not None:
            metrics["tokens"] = tokens
        if aux is not None:
            metrics["aux"] = aux
        return {"rest": new_rest, "opt_state": opt_state}, metrics

    def _grads(self, rest, batch):
        """(loss, the rest's grads, per layer its grads' per-leaf sums of squares, the token count
        of a `TokenSum` loss or None, the head's metrics or None), the layers' grads written to
        their files: steps 1-2 of the module docstring, over `microbatches` slices of the batch
        (rows j, j + k, ... as `train.step_parts.microbatched` takes them), the layers' grads
        summed through their files in slice order, then divided by k (a `TokenSum`: by the
        batch's token count); with k > 1 the slices' metrics stacked on a leading dim, as
        `microbatched` stacks them."""
        n, k, pr = self.n_layers, self.microbatches, self._prog
        sums: list = [None] * n
        loss_sum = g_sum = count = None
        auxes = []
        for j in range(k):
            mb = batch if k == 1 else pr.mb_slice(batch, j)
            hs = [pr.embed(rest, mb)]
            for i, (p,) in self._stream(("params",), range(n)):
                hs.append(pr.fwd(p, hs[i], mb))
            loss, c, aux, g_head, ct = pr.head(rest, hs.pop(), mb)
            auxes.append(aux)
            loss_sum = loss if j == 0 else loss_sum + loss
            count = c if j == 0 or c is None else count + c
            tokens = None if count is None else jnp.maximum(count, 1.0)
            last = j == k - 1
            div = layer_programs.BY_TOKENS if tokens is not None and last else layer_programs.NO_DIVISION
            div = layer_programs.BY_SLICES if tokens is None and last and k > 1 else div
            for i, arrays in self._stream(("params",) if j == 0 else ("params", "grads"), reversed(range(n))):
                acc = None if j == 0 else arrays[1]  # the earlier slices' sum, read back from the grads file
                g, ct, sums[i] = pr.bwd(arrays[0], hs.pop(), ct, mb, acc, div, tokens if last else None)
                self._write("grads", i, g)
            g_rest = pr.embed_bwd(rest, mb, ct, g_head)
            self._flush()  # the grads files whole before the next slice reads them
            g_sum = g_rest if j == 0 else jax.tree.map(lambda a, b: a + b.astype(a.dtype), g_sum, g_rest)
        aux = auxes[0] if k == 1 or auxes[0] is None else jax.tree.map(lambda *xs: jnp.stack(xs), *auxes)
        if count is not None:  # `step_parts.normalize`
            return loss_sum / tokens, jax.tree.map(lambda g: (g / tokens).astype(g.dtype), g_sum), sums, count, aux
        if k == 1:
            return loss_sum, g_sum, sums, None, aux
        return loss_sum / k, jax.tree.map(lambda g: g / k, g_sum), sums, None, aux

    def compile_layer(self, rest, batch):
        """One layer's backward program (params read, vjp, grads out: the largest of the step's
        programs) compiled ahead for `batch`'s shape; its `memory_analysis()` is the step's peak."""
        lay, pr = self.files["params"].layout, self._prog
        p = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d, sh in zip(lay.shapes, self._layer_dtypes, lay.shardings)]
        batch = batch if self.batch_sharding is None else jax.device_put(batch, self.batch_sharding)
        h = jax.eval_shape(pr.embed, rest, batch)
        return pr.bwd.lower(p, h, h, batch, None, layer_programs.NO_DIVISION).compile()

    # ------------------------------------------------------------------ checkpoints

    def save_streams(self, check=None) -> tuple[list, list]:
        """(the params files' stacks, the state files' stacks): per stored leaf its whole stack
        as a `shard_files.Streamed` leaf (`checkpoint_stream.LayerStack`), written layer by layer
        out of the files when the checkpoint commits; the files are left alone until then (the
        next `train_step`, `gather` or `put` waits). `check`: the checkpointer's, raising on a
        failed save (polled while waiting)."""
        self._saved()
        out = []
        for kind in ("params", "state"):
            writer = checkpoint_stream.StackWriter(self.files[kind], self._read_bufs[kind], self._io[0])
            self._saving.append((writer, check))
            out.append(writer.stacks())
        return out[0], out[1]

    def drop_save(self) -> None:
        """Forget the save `save_streams` prepared (it raised before its commit was scheduled)."""
        self._saving = []

    def _saved(self) -> None:
        while self._saving:
            writer, check = self._saving.pop(0)
            writer.wait(check)

    def rebuild(self, state_dir, param_names: list[str], state_names: list[str]) -> None:
        """The params and state files from a checkpoint's shard files in `state_dir` (the stored
        leaves saved as `param_names` / `state_names`), a layer at a time (`checkpoint_stream`)."""
        self._saved()
        for kind, names in (("params", param_names), ("state", state_names)):
            checkpoint_stream.rebuild(self.files[kind], names, Path(state_dir), self._read_bufs[kind][0])

    def close(self) -> None:
        self._saved()
        self._flush()
        for ex in self._io:
            ex.shutdown(wait=True)
