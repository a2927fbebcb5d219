"""The trainer's side of `offload: optimizer+params:nvme` (`fsdp_jax.nvme.LayerwiseStep`).

The scanned layers' params, their optimizer state and their grads live in layer files under
`offload_dirs`; the step feeds the forward and backward a layer at a time from them. To the
loop this is a step like any other (`ParamsNvmeStep`: `lower(...).compile()`, then
`step(live, batch) -> (live, metrics)`) over a live `TrainState` laid out as a run without
offload's, with every leaf kept in the files (the params' `blocks`, Adam's mu and nu of them)
cut to zero layers. Eval and the end-of-run sample read the params whole (`whole_params`: the
layers read out of the files onto the device, as a run without offload holds them). A
checkpoint streams both sets of files layer by layer into the checkpoint's shard files in the
format of a run without offload (`to_save`); a resume restores the rest and rebuilds the files
from the checkpoint (`restore_target` / `put_restored`), so kill -9 at any moment of a step,
then the same command, resumes from the last checkpoint. The objective is the next-token loss or a
reference-free preference loss (simpo, orpo: `objectives.preference_pieces`, its metrics in
`metrics["aux"]` as the scanned step's).

What the layer-wise step does not run yet is refused before anything is written, one line
naming why (`REFUSALS`, checked by `refusal`).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fsdp_jax.app.models.layer_pieces import decoder_pieces, pieces_problem, split_params
from fsdp_jax.app.objectives.preference import REFERENCE_FREE
from fsdp_jax.app.objectives.preference_pack import max_pairs_for
from fsdp_jax.app.objectives.preference_pieces import pair_inputs, pair_loss
from fsdp_jax.app.objectives.preference_run import is_preference, preference_spec
from fsdp_jax.app.trainer.build import model_inputs, next_token_loss
from fsdp_jax.checkpoint.manifest import tree_paths
from fsdp_jax.checkpoint.shard_files import Unread
from fsdp_jax.nvme.layerwise import LayerwiseStep
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.sharding.remat import remat_policy
from fsdp_jax.train.build import Built
from fsdp_jax.train.state import TrainState
from fsdp_jax.train.step import sharding_context

LAYERWISE_OBJECTIVES = ("sft", *REFERENCE_FREE)  # one policy pass: the next-token loss, simpo, orpo

# (what, why it is refused): each checked by `refusal` in this order
REFUSALS: tuple[tuple[str, str], ...] = (
    ("model", "the layer pieces cover dense decoders with scanned layers only"),
    (
        "objective",
        "the layer files hold the policy alone: DPO / IPO / hinge need a reference model's second forward and GRPO "
        "a sampler over the whole params (sft, simpo and orpo run; docs/offload.md)",
    ),
    (
        "lora",
        "the layer files hold every param with its optimizer state and grads; a frozen base (LoRA) needs a "
        "read-only params set, each layer's vjp and grads for its adapters alone and an update of those only "
        "(not built; docs/offload.md)",
    ),
    ("precision", "FP8 matmuls (precision matmul=fp8) are not cut into layer pieces yet"),
    ("remat", "a policy that offloads to host memory is not combined with the layer files yet"),
    ("mesh", "a context or tensor axis is not cut into layer pieces yet"),
    (
        "mesh.strategy",
        "params on disk is ZeRO-3 (DeepSpeed ZeRO-Infinity offloads params only at stage 3): "
        "use mesh.strategy=full_shard",
    ),
)


def refusal(cfg) -> tuple[str, str] | None:
    """(config key, one line) of the first thing `cfg` asks that the layer-wise step does not run."""
    why, policy, mesh = dict(REFUSALS), Policy.parse(cfg.precision), cfg.mesh
    model_field = pieces_problem(cfg.model)  # "model.<field>" or None
    checks = (  # (what, its key, its value when refused else None)
        ("model", model_field, model_field and getattr(cfg.model, model_field.split(".", 1)[1])),
        ("objective", "objective", cfg.objective if cfg.objective not in LAYERWISE_OBJECTIVES else None),
        ("lora", "lora.rank", cfg.lora.rank or None),
        ("precision", "precision", cfg.precision if policy.matmul else None),
        ("remat", "remat", cfg.remat if remat_policy(cfg.remat).offloads else None),
        (
            "mesh",
            "mesh.context" if mesh.context > 1 else "mesh.tensor",
            max(mesh.context, mesh.tensor) if max(mesh.context, mesh.tensor) > 1 else None,
        ),
        ("mesh.strategy", "mesh.strategy", mesh.strategy if mesh.strategy != "full_shard" else None),
    )
    for what, key, got in checks:
        if got is not None:
            return key, f"{got!r} with offload: optimizer+params:nvme: {why[what]}"
    return None


def _inputs_and_loss(cfg):
    """The pieces' `inputs` and `loss` of the run's objective: the next-token loss, or a
    reference-free preference loss (`preference_pieces`) returning its metrics."""
    if not is_preference(cfg):
        return model_inputs, next_token_loss
    slots = 2 * max_pairs_for(cfg.model.max_segments) if cfg.preference.packing else 0
    return pair_inputs, pair_loss(preference_spec(cfg), slots)


def _names(optimizer, opt_abstract, params_abstract, name_of) -> list[tuple[str, int]]:
    """Per optimizer-state leaf: (its param's name or '' for a counter, its occurrence)."""
    names = jax.tree_util.tree_map_with_path(lambda p, _: name_of(p), params_abstract)
    labels = optax.tree_utils.tree_map_params(
        optimizer, lambda _, n: n, opt_abstract, names, transform_non_params=lambda _: ""
    )
    seen: Counter = Counter()
    out = []
    for n in jax.tree.leaves(labels):
        out.append((n, seen[n]))
        seen[n] += 1
    return out


class ParamsNvmeStep:
    """See the module docstring. `built`: the run's `build(..., offload="none")`."""

    def __init__(self, cfg, built: Built, model_fns, dirs, owner: str):
        self.built, self.plan, self.optimizer = built, built.plan, built.optimizer
        params = built.abstract_state.params
        split = split_params(params)
        with sharding_context(self.plan):
            self.lw = LayerwiseStep(
                decoder_pieces(model_fns, cfg.model, cfg.remat, *_inputs_and_loss(cfg)),
                built.optimizer,
                split,
                dirs,
                owner,
                clip_norm=cfg.optimizer.clip_norm,
                batch_sharding=self.plan.batch,
                microbatches=cfg.train.microbatches,
                precision=cfg.precision,
            )
        keystr = jax.tree_util.keystr
        full = _names(built.optimizer, built.abstract_state.opt_state, params, keystr)
        split_st = jax.eval_shape(built.optimizer.init, split)
        cut = _names(
            built.optimizer,
            split_st,
            split,
            lambda p: f"['blocks']{keystr(p[1:])}" if p[0].key == "layers" else keystr(p[1:]),
        )
        where = {n: k for k, n in enumerate(full)}
        self._to_split = [where[n] for n in cut]  # split leaf j is full leaf _to_split[j]
        self._full_def, self._split_def = (
            jax.tree.structure(built.abstract_state.opt_state),
            jax.tree.structure(split_st),
        )
        self._state_full = [self._to_split[j] for j in self.lw.stacked]  # the state files' leaves, in full order
        names = list(tree_paths(built.abstract_state))
        opt_names = [n for n in names if n.split("/")[0] == "opt_state"]
        self._param_names = [n for n in names if n.startswith("params/blocks/")]
        self._state_names = [opt_names[k] for k in self._state_full]
        self._compiled = None

    # ------------------------------------------------------------------ live <-> layer-wise

    def _split(self, opt_state):
        leaves = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, Unread))
        return jax.tree.unflatten(self._split_def, [leaves[k] for k in self._to_split])

    def _full(self, opt_state):
        leaves = jax.tree.leaves(opt_state)
        out = [None] * len(leaves)
        for j, k in enumerate(self._to_split):
            out[k] = leaves[j]
        return jax.tree.unflatten(self._full_def, out)

    def _with(self, state: TrainState, blocks, stacked) -> TrainState:
        """`state` with the params' blocks leaves and the state files' leaves replaced."""
        params = {**state.params, "blocks": jax.tree.unflatten(jax.tree.structure(state.params["blocks"]), blocks)}
        leaves = jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, Unread))
        for k, x in zip(self._state_full, stacked):
            leaves[k] = x
        return state.replace(params=params, opt_state=jax.tree.unflatten(self._full_def, leaves))

    def _empty(self, state: TrainState) -> TrainState:
        lay_p, lay_s = self.lw.files["params"].layout, self.lw.files["state"].layout

        def empties(layout):
            return [
                jax.device_put(np.zeros((0, *shape[1:]), dt), s)
                for shape, s, dt in zip(layout.shapes, layout.shardings, self._dtypes(layout))
            ]

        return self._with(state, empties(lay_p), empties(lay_s))

    @staticmethod
    def _dtypes(layout):
        by_leaf = {e.leaf: e.dtype for e in layout.entries}
        return [by_leaf[k] for k in range(len(layout.shapes))]

    # ------------------------------------------------------------------ the trainer's calls

    def put(self, state: TrainState) -> TrainState:
        """The live state of a whole `state` (an init, `init_from`): the files written from it."""
        live = self.lw.put(split_params(state.params), self._split(state.opt_state))
        return self._empty(state.replace(opt_state=self._full(live["opt_state"])))

    def restore_target(self, abstract_state: TrainState) -> TrainState:
        """`abstract_state` with the leaves kept in the files `Unread` (`put_restored` reads them)."""
        blocks = jax.tree.leaves(abstract_state.params["blocks"])
        opt = jax.tree.leaves(abstract_state.opt_state)
        return self._with(
            abstract_state,
            [Unread(tuple(x.shape), x.dtype) for x in blocks],
            [Unread(tuple(opt[k].shape), opt[k].dtype) for k in self._state_full],
        )

    def put_restored(self, state: TrainState, state_dir) -> TrainState:
        """The live state of `state` (restored onto `restore_target`): the files rebuilt from the
        checkpoint's shard files in `state_dir`, a layer at a time."""
        self.lw.rebuild(Path(state_dir), self._param_names, self._state_names)
        return self._empty(state)

    def whole_params(self, live: TrainState):
        """The params whole, as the plan lays them out (eval, the sample): the layers read out of the files."""
        params, _ = self.lw.gather(self._lw_live(live))
        blocks = jax.device_put(params["layers"], self.plan.params["blocks"])
        return {**live.params, "blocks": blocks}

    def to_save(self, live: TrainState, check=None) -> TrainState:
        """What a checkpoint saves: `live` with the files' leaves streamed out of them (`LayerwiseStep.save_streams`)."""
        params, state = self.lw.save_streams(check)
        return self._with(live, params, state)

    def drop_save(self) -> None:
        self.lw.drop_save()

    def _lw_live(self, live: TrainState) -> dict:
        rest = {k: v for k, v in live.params.items() if k != "blocks"}
        return {"rest": rest, "opt_state": self._split(live.opt_state)}

    def lower(self, live: TrainState, batch) -> "ParamsNvmeStep":
        """The layer's backward program compiled ahead (`LayerwiseStep.compile_layer`:
        `memory_analysis` is its); `.compile()` returns this step."""
        with sharding_context(self.plan):
            self._compiled = self.lw.compile_layer(self._lw_live(live)["rest"], batch)
        return self

    def compile(self) -> "ParamsNvmeStep":
        return self

    def memory_analysis(self):
        return self._compiled.memory_analysis()

    def __call__(self, live: TrainState, batch) -> tuple[TrainState, dict]:
        with sharding_context(self.plan):
            new, metrics = self.lw.train_step(self._lw_live(live), batch)
        ok = metrics["skipped"] == 0
        step = jnp.where(ok, live.step + 1, live.step)
        params = {**live.params, **new["rest"]}
        return live.replace(step=step, params=params, opt_state=self._full(new["opt_state"])), metrics

    def close(self) -> None:
        self.lw.close()
