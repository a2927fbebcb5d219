"""The train step with the stacked optimizer state on disk (`offload: optimizer:nvme`).

    nv = NvmeStep(built, loss_fn, dirs=["/nvme0", "/nvme1"], owner="run-1")
    live = nv.put(state)                  # the stacked leaves' state to files; a live state
    live, metrics = nv.train_step(live, batch)
    state = nv.gather(live)               # the whole state again (a checkpoint, an eval)

`built` is `build(..., offload="none")`: the plan, abstract state and init are those of
a run without offload. The live state is that TrainState with every optimizer-state leaf
stacked over layers (`plan.layered`, Adam's mu and nu of the scanned weights) cut to zero
layers (`x[:0]`: same rank, no elements); layer i of all of them lives in one file
(`fsdp_jax.nvme.layer_files`). A step is:

1. one jitted program: grads (the step's own parts: `microbatched`,
   `compute_value_and_grad`, `normalize`, `clip_grads`), then the update of the leaves
   not stacked, with the stacked ones empty (as `train.stream_update` does: the optimizer's
   counters come from this call); it returns the stacked grads, `ok` and the counters as
   they were;
2. per layer i, a jitted update of layer i alone: its params sliced out of the (donated)
   device params and written back in place, its optimizer state read from its file; the
   same `optimizer.update`, the same non-finite select. While layer i updates, layer i+1
   is read and layer i-1 written (two I/O threads, three page-aligned host buffers of one
   layer each: about 3 layers' state in host memory).

An elementwise optimizer (`train.stream_update.elementwise_reason` is None) updates a
layer's slice exactly as inside its leaf, so this trains bit for bit as without offload
on XLA:CPU's default emitters (tests/test_nvme.py). Optimizers that reduce over a leaf,
models with state or a run key, and frozen params are refused (OffloadError, one line).
"""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fsdp_jax.checkpoint.manifest import tree_paths
from fsdp_jax.checkpoint.shard_files import Unread
from fsdp_jax.errors import OffloadError
from fsdp_jax.nvme import checkpoint_stream
from fsdp_jax.nvme.layer_files import LayerFiles, Layout
from fsdp_jax.sharding import offload, remat
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.train.build import Built
from fsdp_jax.train.state import TrainState, state_shardings
from fsdp_jax.train.step import sharding_context
from fsdp_jax.train.step_parts import TokenSum, clip_grads, compute_value_and_grad, microbatched, normalize
from fsdp_jax.train.stream_update import elementwise_reason
from fsdp_jax.train.trainable import Trainable

LAYERED, FLAT, OTHER = "layered", "flat", "other"
HOST_BUFFERS = 3  # page-aligned host buffers of one layer each: read i+1 | update i | write i-1


def labels_of(optimizer, opt_state, layered):
    """Per optimizer-state leaf: LAYERED / FLAT (param-shaped, like its param) or OTHER."""
    return optax.tree_utils.tree_map_params(
        optimizer, lambda _, lay: LAYERED if lay else FLAT, opt_state, layered, transform_non_params=lambda _: OTHER
    )


def empty_layers(x):
    """`x` cut to zero layers (same rank, no elements); a scalar as it is."""
    return x[:0] if x.ndim else x


def cut(tree, marks, keep, fn=lambda x: x):
    """Leaves marked `keep` through fn, OTHER as they are, the rest empty."""
    return jax.tree.map(lambda x, m: fn(x) if m == keep else x if m == OTHER else empty_layers(x), tree, marks)


def masked_update(optimizer, grads, opt_state, params, ok, skip_nonfinite):
    """(new params, new state) of one `optimizer.update`; the old ones where not `ok` (and skipping)."""
    updates, new_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    if skip_nonfinite:
        new_params = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_params, params)
        new_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, opt_state)
    return new_params, new_state


def check_streamable(built: Built, step_options: dict) -> None:
    """OffloadError (one line) unless `built` and the step options can train with nvme."""
    why = None
    if built.plan.layered is None or not any(jax.tree.leaves(built.plan.layered)):
        why = "the model has no stack of scanned layers (scan_layers) to stream"
    elif built.plan.model_state is not None or step_options.get("rng") is not None:
        why = "the model carries state or draws random numbers, which the nvme step does not thread yet"
    elif step_options.get("trainable") is not None:
        why = "frozen params (trainable) are not supported by the nvme step yet"
    elif step_options.get("has_aux"):
        why = "a loss with aux is not supported by the nvme step yet"
    else:
        st = built.abstract_state
        reason = elementwise_reason(built.optimizer, st.params, st.opt_state)
        if reason is not None:
            why = f"the {reason}, so a layer's slice would not update as its leaf does"
    if why:
        raise OffloadError(f"offload: 'optimizer:nvme' updates one layer at a time from disk, but {why}")


class NvmeStep:
    """See the module docstring. `step_options`: microbatches, clip_norm, precision, remat,
    skip_nonfinite (as `make_train_step`)."""

    def __init__(self, built: Built, loss_fn, dirs, owner: str, **step_options: Any):
        check_streamable(built, step_options)
        self.built, self.plan, self.optimizer = built, built.plan, built.optimizer
        self.skip = step_options.get("skip_nonfinite", True)
        self.labels = labels_of(built.optimizer, built.abstract_state.opt_state, built.plan.layered)
        leaves, self._treedef = jax.tree.flatten(built.abstract_state.opt_state)
        self._stacked = [k for k, m in enumerate(jax.tree.leaves(self.labels)) if m == LAYERED]
        names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(self.labels)[0]]
        self.layout = Layout.of([leaves[k] for k in self._stacked], [names[k] for k in self._stacked])
        saved = [p for p in tree_paths(built.abstract_state) if p.split("/")[0] == "opt_state"]
        self._saved_names = [saved[k] for k in self._stacked]  # as a checkpoint names them
        self.files = LayerFiles.open(dirs, self.layout, owner)
        self._grad_step = _jit_grad_step(built, loss_fn, self.labels, step_options)
        self._layer = _jit_layer_update(built, self.labels, self.layout, self.skip)
        self._slice = jax.jit(lambda xs, i: [jax.lax.dynamic_slice_in_dim(x, i, 1, 0) for x in xs])
        self._cut = jax.jit(lambda t: cut(t, self.labels, FLAT), out_shardings=self.plan.opt_state)
        self._io = (cf.ThreadPoolExecutor(1, "nvme-read"), cf.ThreadPoolExecutor(1, "nvme-write"))
        self._buffers = [self.files.buffer() for _ in range(HOST_BUFFERS)]
        self._saving = None  # (StackWriter, check) of a checkpoint not written yet

    def _saved(self) -> None:
        """Wait until a checkpoint streaming out of the layer files has written them."""
        if self._saving is not None:
            writer, check = self._saving
            writer.wait(check)
            self._saving = None

    @property
    def n_layers(self) -> int:
        return self.layout.n_layers

    def put(self, state: TrainState) -> TrainState:
        """The live state of a whole `state` (an init, a restore): its stacked optimizer
        state written to the layer files (all of them rewritten), cut out of the state."""
        self._saved()
        leaves = jax.tree.leaves(state.opt_state)
        stacked = [leaves[k] for k in self._stacked]
        buf = self._buffers[0]
        for i in range(self.n_layers):
            self.layout.from_arrays(self._slice(stacked, i), buf)
            self.files.write(i, buf)
        return state.replace(opt_state=self._cut(state.opt_state))

    def gather(self, live: TrainState) -> TrainState:
        """The whole state (as `built.abstract_state` lays it out) from `live` and the files:
        for a checkpoint, which saves it from where it is. The stacked leaves are assembled in
        host memory (`pinned_host`, where the backend has it: each file read once, no device
        room needed beyond the live state; `layout.stacked_on_host`), else on the device."""
        self._saved()
        if offload.host_memory_available(self.built.mesh.local_devices):
            stacked = self.layout.stacked_on_host(self.files, self._buffers[0], offload.HOST)
        else:
            per_layer = [
                self.layout.to_arrays(self.files.read(i, self._buffers[0]), copy=True) for i in range(self.n_layers)
            ]
            stacked = [
                jax.jit(jnp.concatenate, out_shardings=s)([layer[j] for layer in per_layer])
                for j, s in enumerate(self.layout.shardings)
            ]
            del per_layer
        leaves = jax.tree.leaves(live.opt_state)
        for k, x in zip(self._stacked, stacked):
            leaves[k] = x
        return live.replace(opt_state=jax.tree.unflatten(self._treedef, leaves))

    def to_save(self, live: TrainState, check=None) -> TrainState:
        """What a checkpoint saves of `live`: the whole state, its stacked leaves
        `shard_files.Streamed`, written layer by layer out of the layer files into the
        checkpoint (`checkpoint_stream`; host memory: two layer buffers) when the save
        commits; until then the layer files are left alone (`_saved`). `check`: the
        checkpointer's, raising on a failed save (polled while waiting)."""
        self._saved()
        writer = checkpoint_stream.StackWriter(self.files, self._buffers[:2], self._io[0])
        self._saving = (writer, check)
        stacks = writer.stacks()
        leaves = jax.tree.leaves(live.opt_state)
        for k, x in zip(self._stacked, stacks):
            leaves[k] = x
        return live.replace(opt_state=jax.tree.unflatten(self._treedef, leaves))

    def drop_save(self) -> None:
        """Forget the save `to_save` prepared (it raised before its commit was scheduled)."""
        self._saving = None

    def restore_target(self, abstract_state: TrainState) -> TrainState:
        """`abstract_state` with its stacked leaves `shard_files.Unread`: a checkpoint restores
        the rest, and `put_restored` the stacked leaves into the layer files."""
        leaves = jax.tree.leaves(abstract_state.opt_state)
        for k in self._stacked:
            leaves[k] = Unread(tuple(leaves[k].shape), leaves[k].dtype)
        return abstract_state.replace(opt_state=jax.tree.unflatten(self._treedef, leaves))

    def put_restored(self, state: TrainState, state_dir) -> TrainState:
        """The live state of `state` (restored onto `restore_target`) and the checkpoint's
        shard files in `state_dir`: the layer files rebuilt a layer at a time."""
        self._saved()
        checkpoint_stream.rebuild(self.files, self._saved_names, Path(state_dir), self._buffers[0])
        leaves = jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, Unread))
        for k, s in zip(self._stacked, self.layout.shardings):
            x = leaves[k]
            leaves[k] = jax.device_put(np.zeros((0, *x.shape[1:]), x.dtype), s)
        return state.replace(opt_state=jax.tree.unflatten(self._treedef, leaves))

    def lower(self, live: TrainState, batch) -> "Lowered":
        """The AOT lowering of the grads program; its `.compile()` returns this step, which
        then runs the compiled program (`memory_analysis()` is that program's)."""
        with sharding_context(self.plan):
            return Lowered(self, self._grad_step.lower(live, jax.device_put(batch, self.plan.batch)))

    def memory_analysis(self):
        return self._compiled.memory_analysis()

    def __call__(self, live: TrainState, batch) -> tuple[TrainState, dict]:
        return self.train_step(live, batch)

    def train_step(self, live: TrainState, batch) -> tuple[TrainState, dict]:
        """One step of the live state (donated) on `batch`; returns the new live state and
        the metrics of `make_train_step` (loss, grad_norm, skipped, tokens)."""
        batch = jax.device_put(batch, self.plan.batch)
        with sharding_context(self.plan):
            live, grads, ok, other, metrics = self._grad_step(live, batch)
            self._saved()  # a checkpoint's stream out of the files overlapped the grads
            params = self._update_layers(live.params, grads, other, ok)
        return live.replace(params=params), metrics

    def _update_layers(self, params, grads, other, ok):
        """The per-layer pipeline: read i+1 | update i | write i-1 (module docstring)."""
        read_ex, write_ex = self._io
        free = list(self._buffers[1:])
        reading = read_ex.submit(self.files.read, 0, self._buffers[0])
        writing = None
        for i in range(self.n_layers):
            buf = reading.result()
            if i + 1 < self.n_layers:
                if not free:
                    free.append(writing.result())
                    writing = None
                reading = read_ex.submit(self.files.read, i + 1, free.pop())
            params, new_s = self._layer(params, grads, self.layout.to_arrays(buf), other, i, ok)
            jax.block_until_ready(new_s)
            if writing is not None:
                free.append(writing.result())
            self.layout.from_arrays(new_s, buf)
            del new_s
            writing = write_ex.submit(self._write, i, buf)
        if writing is not None:
            free.append(writing.result())
        return params

    def _write(self, i, buf):
        self.files.write(i, buf)
        return buf

    def close(self) -> None:
        self._saved()
        for ex in self._io:
            ex.shutdown(wait=True)


class Lowered:
    """`NvmeStep.lower`'s result: `compile()` compiles the grads program into the step."""

    def __init__(self, step: NvmeStep, lowered):
        self.step, self.lowered = step, lowered

    def compile(self) -> NvmeStep:
        self.step._compiled = self.step._grad_step = self.lowered.compile()
        return self.step


def _jit_grad_step(built: Built, loss_fn, labels, options: dict):
    """Jitted `(live, batch) -> (live with the unstacked leaves updated, stacked grads, ok,
    the optimizer state's counters before the step, metrics)`; live is donated."""
    plan, optimizer = built.plan, built.optimizer
    policy = Policy.parse(options.get("precision"))
    microbatches, clip_norm = options.get("microbatches", 1), options.get("clip_norm")
    skip = options.get("skip_nonfinite", True)
    loss_fn = jax.named_scope("forward")(remat.with_remat(loss_fn, options.get("remat", "none")))
    pmarks = jax.tree.map(lambda m: LAYERED if m else FLAT, plan.layered)

    def step(state: TrainState, batch):
        wrt = Trainable(state.params, None)
        grad_fn = microbatched(
            compute_value_and_grad(loss_fn, policy, plan, wrt, False), microbatches, wrt.select(plan.grads), wrt.select
        )
        loss, _, grads = grad_fn(state.params, batch)
        tokens = loss.count if isinstance(loss, TokenSum) else None
        loss, grads = normalize(loss, grads)
        grads, grad_norm = clip_grads(grads, clip_norm)
        grads = wrt.full_grads(grads, plan.grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        p_f, s_f, g_f = cut(state.params, pmarks, FLAT), cut(state.opt_state, labels, FLAT), cut(grads, pmarks, FLAT)
        new_pf, new_sf = masked_update(optimizer, g_f, s_f, p_f, ok, skip)
        params = jax.tree.map(lambda old, new, m: old if m == LAYERED else new, state.params, new_pf, pmarks)
        opt_state = jax.tree.map(lambda old, new, m: old if m == LAYERED else new, state.opt_state, new_sf, labels)
        step_no = jnp.where(ok, state.step + 1, state.step) if skip else state.step + 1
        stacked = [g for g, m in zip(jax.tree.leaves(grads), jax.tree.leaves(pmarks)) if m == LAYERED]
        metrics = {"loss": loss.astype(policy.output_dtype), "grad_norm": grad_norm, "skipped": (~ok).astype(jnp.int32)}
        if tokens is not None:
            metrics["tokens"] = tokens
        new = state.replace(step=step_no, params=params, opt_state=opt_state)
        return new, stacked, ok, cut(state.opt_state, labels, OTHER), metrics

    sh = state_shardings(plan)  # the placeholders (no elements) come back with any sharding: not checked
    out_sh = (sh, None, None, None, None)
    return jax.jit(step, out_shardings=out_sh, donate_argnums=(0,))


def _jit_layer_update(built: Built, labels, layout: Layout, skip: bool):
    """Jitted `(params, stacked grads, layer i's stored state, counters, i, ok) -> (params
    with layer i updated in place, layer i's new stored state)`; params are donated."""
    plan, optimizer = built.plan, built.optimizer
    pmarks = jax.tree.map(lambda m: LAYERED if m else FLAT, plan.layered)
    marks = jax.tree.leaves(labels)

    def layer(params, grads, s_i, other, i, ok):
        def take(x):
            return jax.lax.dynamic_slice_in_dim(x, i, 1, 0)

        p_i = cut(params, pmarks, LAYERED, take)
        it = iter(grads)
        g_i = jax.tree.map(lambda p, m: take(next(it)) if m == LAYERED else empty_layers(p), params, pmarks)
        o_leaves, it = jax.tree.leaves(other), iter(s_i)
        opt_i = jax.tree.unflatten(
            jax.tree.structure(labels), [next(it) if m == LAYERED else x for x, m in zip(o_leaves, marks)]
        )
        new_p, new_s = masked_update(optimizer, g_i, opt_i, p_i, ok, skip)
        params = jax.tree.map(
            lambda old, new, m: jax.lax.dynamic_update_slice_in_dim(old, new, i, 0) if m == LAYERED else old,
            params,
            new_p,
            pmarks,
        )
        return params, [x for x, m in zip(jax.tree.leaves(new_s), marks) if m == LAYERED]

    return jax.jit(layer, out_shardings=(plan.params, list(layout.shardings)), donate_argnums=(0,))
