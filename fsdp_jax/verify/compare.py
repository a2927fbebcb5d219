"""The comparison `fsdp_jax.verify.run` runs, in a process that has the devices: the steps on
one device (the reference), then the same steps from the same params and batches under
each strategy, every leaf and the loss and grad norm measured against the reference,
into a `VerifyReport` (`fsdp_jax.verify.report`). The entry point, its input checks and
the child process are `fsdp_jax.verify.run`, which re-exports `strategy_mesh_shape`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from fsdp_jax.errors import VerifyError
from fsdp_jax.hlo.memory import collective_report, compiled_memory, state_bytes_per_device
from fsdp_jax.model.fns import adapt_model
from fsdp_jax.sharding import rules
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.train.build import build
from fsdp_jax.verify.exact import exact_indices, max_abs_at, unequal
from fsdp_jax.verify.report import (
    TOLERANCES,
    Divergence,
    StrategyReport,
    Tolerance,
    VerifyReport,
    default_tolerance,
    leaf_rel,
    optimizer_kind,
    rel_diff,
)

_BUILD_OPTIONS = ("logical_axes", "rules", "min_shard_size", "max_replicated_fraction")
_STEP_OPTIONS = (
    "precision",
    "microbatches",
    "clip_norm",
    "remat",
    "has_aux",
    "trainable",
    "skip_nonfinite",
    "rng",
    "post_update",
)


def compare_runs(
    model,
    optimizer,
    loss_fn,
    batch,
    batches,
    names: list[str],
    devs: list[jax.Device],
    steps: int,
    seed: int,
    tolerance,
    check_init: bool,
    options: Mapping[str, Any],
) -> VerifyReport:
    opts = {"max_replicated_fraction": None, **options}
    context, data = _pop_mesh_options(opts, len(devs))
    routing, exact = _pop_routing(opts), opts.pop("exact", None)
    host_batches = _host_batches(batch, batches, steps, len(devs) // context, opts.get("microbatches", 1))

    key = jax.random.key(seed)
    with _user_code("the model does not initialise"):
        fns, params, mstate = adapt_model(model, key)
    tol = _tolerance(tolerance, optimizer, fns, opts.get("precision"))

    ref = _build(fns, optimizer, make_mesh(1, 1, 1, devices=devs[:1]), "no_shard", loss_fn, opts)
    with _user_code("the model does not initialise"):
        state = ref.init_state(key) if params is None else ref.place(params, mstate)
    # the start in its own dtypes (placed for each strategy as it is: a float64 copy of an
    # integer leaf, e.g. a quantised base's float32 bits as uint32, would come back through
    # float32 and lose its low bits)
    p0, ms0 = jax.device_get(state.params), jax.device_get(state.model_state)
    with _user_code("loss_fn fails on the batch"):
        step = ref.train_step.lower(state, _put(host_batches[0], ref.plan.batch)).compile()
    ref_loss, ref_gnorm, ref_params, ref_routing = _reference_steps(step, state, host_batches, ref.plan.batch, routing)
    del state

    # params, then the model's state (BatchNorm statistics: over the global batch, so they must agree too):
    paths = [rules.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(p0)[0]] + [
        "state:" + rules.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(ms0)[0]
    ]
    exact_idx, start = exact_indices(paths, exact), jax.tree.leaves(_host((p0, ms0)))
    exact_moved = [max_abs_at(jax.tree.leaves(r), start, exact_idx) for r in ref_params] if exact else []
    reports = {}
    for name in names:
        mesh = make_mesh(*strategy_mesh_shape(name, len(devs) // context, data), devices=devs, context=context)
        reports[name] = _run_strategy(
            fns,
            optimizer,
            loss_fn,
            opts,
            mesh,
            name,
            key,
            check_init and params is None,
            (p0, ms0),
            host_batches,
            ref_loss,
            ref_gnorm,
            ref_params,
            paths,
            tol,
            routing,
            ref_routing,
            exact_idx,
        )
    return VerifyReport(
        devices=len(devs),
        steps=steps,
        platform=devs[0].platform,
        tolerance=tol,
        optimizer_kind=optimizer_kind(optimizer, fns.abstract_params),
        precision=str(Policy.parse(opts.get("precision"))),
        reference_loss=ref_loss,
        reference_grad_norm=ref_gnorm,
        strategies=reports,
        routing=routing,
        exact=exact,
        exact_moved=exact_moved,
    )


def _reference_steps(step, state, host_batches, batch_sharding, routing):
    """The reference's per-step losses, grad norms, (params, model state) on the host and
    routing values (empty without `routing`)."""
    ref_loss, ref_gnorm, ref_params, ref_routing = [], [], [], []
    for b in host_batches:
        state, m = step(state, _put(b, batch_sharding))
        ref_loss.append(float(m["loss"]))  # blocking each step bounds the work in flight (CPU)
        ref_gnorm.append(float(m["grad_norm"]))
        ref_params.append(_host((state.params, state.model_state)))
        if routing is not None:
            ref_routing.append(_routing_value(m, routing))
    return ref_loss, ref_gnorm, ref_params, ref_routing


def _routing_diff(value: np.ndarray, ref_value: np.ndarray) -> float:
    """0 where a step's discrete choices equal the reference's, else how far apart (inf: other shapes)."""
    if value.shape != ref_value.shape:
        return float("inf")
    return 0.0 if np.array_equal(value, ref_value) else float(np.max(np.abs(value - ref_value)))


def _over(i: int, paths, leaf_d, loss_d: float, gnorm_d: float, tol, off=()) -> Divergence | None:
    """Step `i`'s divergence (0-based), or None when every measure is within `tol` and no
    exactly compared leaf differs (`off`: `exact.unequal`'s)."""
    bad = sorted(((p, e) for p, e in zip(paths, leaf_d) if not e <= tol.param_rtol), key=lambda pe: -pe[1])
    over_loss, over_gnorm = not loss_d <= tol.loss_rtol, not gnorm_d <= tol.grad_norm_rtol
    if bad or over_loss or over_gnorm or off:
        return Divergence(i + 1, loss_d if over_loss else None, gnorm_d if over_gnorm else None, tuple(bad), exact=off)
    return None


def _run_strategy(
    fns,
    optimizer,
    loss_fn,
    opts,
    mesh,
    name,
    key,
    sharded_init,
    start,
    host_batches,
    ref_loss,
    ref_gnorm,
    ref_params,
    paths,
    tol,
    routing=None,
    ref_routing=(),
    exact=(),
) -> StrategyReport:
    p0, ms0 = start
    built = _build(fns, optimizer, mesh, name, loss_fn, opts)
    init_diff, state = _own_init(built, key, p0, ms0) if sharded_init else (None, None)
    state = built.place(p0, ms0) if state is None else state
    step = built.train_step.lower(state, _put(host_batches[0], built.plan.batch)).compile()
    collectives = {op: dict(v) for op, v in collective_report(step.as_text())["per_step"].items()}
    peak = compiled_memory(step)["peak"]
    loss_d, gnorm_d, param_d, routing_d, exact_d, first, flip = [], [], [], [], [], None, None
    for i, b in enumerate(host_batches):
        state, m = step(state, _put(b, built.plan.batch))
        loss_d.append(rel_diff(float(m["loss"]), ref_loss[i]))
        gnorm_d.append(rel_diff(float(m["grad_norm"]), ref_gnorm[i]))
        leaves, ref_leaves = jax.tree.leaves(_host((state.params, state.model_state))), jax.tree.leaves(ref_params[i])
        leaf_d = [leaf_rel(a, r) for a, r in zip(leaves, ref_leaves)]
        param_d.append(max(leaf_d, default=0.0))
        exact_d.append(max_abs_at(leaves, ref_leaves, exact))
        if routing is not None:  # discrete choices: equal, or a flip (from it on nothing is judged)
            routing_d.append(_routing_diff(_routing_value(m, routing), ref_routing[i]))
            if routing_d[-1] != 0.0 and flip is None:
                flip = i + 1
                if flip == 1 and first is None:  # from the same params: not a flip noise can explain
                    first = Divergence(1, None, None, (), routing=routing_d[-1])
        if first is None and flip is None:
            first = _over(i, paths, leaf_d, loss_d[-1], gnorm_d[-1], tol, unequal(paths, leaves, ref_leaves, exact))
    last = leaves
    worst = int(np.argmax(leaf_d)) if leaf_d else 0
    max_abs = max(
        (float(np.max(np.abs(a - r), initial=0.0)) for a, r in zip(last, jax.tree.leaves(ref_params[-1]))), default=0.0
    )
    return StrategyReport(
        strategy=name,
        mesh={k: int(v) for k, v in mesh.shape.items()},
        passed=first is None,
        loss_rel_diff=loss_d,
        grad_norm_rel_diff=gnorm_d,
        param_rel_diff=param_d,
        param_max_abs_diff=max_abs,
        worst_leaf=paths[worst] if paths else "",
        init_max_abs_diff=init_diff,
        state_bytes=state_bytes_per_device(built.abstract_state),
        peak_bytes=int(peak),
        collectives_per_step=collectives,
        first_divergence=first,
        routing_diff=routing_d,
        routing_flip_step=flip,
        exact_diff=exact_d,
    )


def _own_init(built, key, p0, ms0):
    """(the strategy's own sharded init's largest difference from the one-device `p0`, for the
    record; that init as the start when it equals `p0` and `ms0` bit for bit, else None: training
    starts from p0 either way, and an equal init is what `place(p0, ms0)` would copy, one
    compile of the state's init less)."""
    own = built.init_state(key)
    mine, ref = jax.tree.leaves(_host(own.params)), jax.tree.leaves(_host(p0))
    init_diff = max((float(np.max(np.abs(a - b), initial=0.0)) for a, b in zip(mine, ref)), default=0.0)
    same = init_diff == 0.0 and all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(_host(own.model_state)), jax.tree.leaves(_host(ms0)))
    )
    return init_diff, (own if same else None)


def _build(fns, optimizer, mesh, strategy, loss_fn, opts):
    try:
        return build(fns, optimizer, mesh, strategy, loss_fn=loss_fn, **opts)
    except rules.ShardingError as e:
        raise VerifyError(f"verify: {strategy}: {e}") from None


def _pop_mesh_options(opts: dict, n: int) -> tuple[int, int]:
    """Check `opts` and pop its `context` (default 1: each strategy's mesh splits sequences
    over a `context` axis of that size), a positive divisor of the device count `n`, and its
    `data` (default 1: `strategy_mesh_shape`'s own split), a positive divisor of n / context."""
    allowed = _BUILD_OPTIONS + _STEP_OPTIONS + ("context", "data", "routing", "exact")
    unknown = sorted(set(opts) - set(allowed) - {"max_replicated_fraction"})
    if unknown:
        raise VerifyError(f"verify: unknown option(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    context = opts.pop("context", 1)
    if not isinstance(context, int) or context < 1 or n % context:
        raise VerifyError(f"verify: context={context!r} must be a positive divisor of devices={n}")
    data = opts.pop("data", 1)
    if not isinstance(data, int) or data < 1 or (n // context) % data:
        raise VerifyError(f"verify: data={data!r} must be a positive divisor of devices / context={n // context}")
    return context, data


def _pop_routing(opts: dict) -> str | None:
    """Pop and check `routing`: None, or the key of the loss's aux dict (`has_aux`) holding a
    value of the step's discrete choices only (an MoE router's per-expert load), compared
    exactly: from the first step at which it differs from the reference's (a top-k routing
    flip: a token whose k-th and (k+1)-th router probabilities nearly tie chose the other
    expert, a discontinuity of the loss no tolerance covers) a strategy's steps are reported
    and not judged; a difference at step 1, where both runs start from the same params, fails."""
    key = opts.pop("routing", None)
    if key is None:
        return None
    if not isinstance(key, str) or not key:
        raise VerifyError(f"verify: routing={key!r} must be the name of a key of the loss's aux dict")
    if not opts.get("has_aux"):
        raise VerifyError(f"verify: routing={key!r} names a key of the loss's aux: it needs has_aux=True")
    return key


def _routing_value(metrics, key: str) -> np.ndarray:
    aux = metrics.get("aux")
    if not isinstance(aux, Mapping) or key not in aux:
        have = ", ".join(sorted(map(str, aux))) if isinstance(aux, Mapping) else type(aux).__name__
        raise VerifyError(f"verify: routing={key!r} is not a key of the loss's aux (it has: {have})")
    return np.asarray(jax.device_get(aux[key]), np.float64)


def strategy_mesh_shape(strategy: str, n: int, data: int = 1) -> tuple[int, int, int]:
    """(data, fsdp, tensor): every device on fsdp; hybrid_shard needs a data axis and
    gets data=2 x fsdp=n/2 (as the planner does) when n is even and at least 4. `data` > 1
    (a divisor of n): every strategy's mesh is data x fsdp=n/data (a run whose rules split
    the experts over data or fsdp verifies on its own split)."""
    if data > 1:
        return data, n // data, 1
    if strategy == "hybrid_shard" and n % 2 == 0 and n >= 4:
        return 2, n // 2, 1
    return 1, n, 1


def _host_batches(batch, batches, steps: int, n: int, microbatches: int) -> list:
    """`steps` host copies of the batches, each leaf's leading dim checked against
    n x microbatches."""
    if batches is None:
        batches = [batch] * steps
    batches = list(batches)
    if len(batches) < steps:
        raise VerifyError(f"verify: batches has {len(batches)} batches, fewer than steps={steps}")
    out = [jax.tree.map(np.asarray, b) for b in batches[:steps]]
    _same_shapes(out)
    for path, x in (leaf for one in out for leaf in jax.tree_util.tree_flatten_with_path(one)[0]):
        b = x.shape[0] if x.ndim else None
        if b is None or b % (n * microbatches):
            raise VerifyError(
                f"verify: batch leaf {rules.path_str(path) or '<root>'} has leading dim {b}, "
                f"which cannot split over devices={n} x microbatches={microbatches}; "
                f"use a global batch that is a multiple of {n * microbatches}"
            )
    return out


def _same_shapes(batches: list) -> None:
    """Every batch has batches[0]'s structure and leaf shapes and dtypes (the step compiles
    once); VerifyError naming the first batch and leaf that differ."""
    leaves0, tree0 = jax.tree_util.tree_flatten_with_path(batches[0])
    for i, b in enumerate(batches[1:], 1):
        leaves, tree = jax.tree_util.tree_flatten_with_path(b)
        if tree != tree0:
            raise VerifyError(
                f"verify: batches[{i}] is not structured like batches[0] ({tree} vs {tree0}); "
                "every step's batch must hold the same leaves"
            )
        for (path, x), (_, y) in zip(leaves0, leaves):
            if x.shape != y.shape or x.dtype != y.dtype:
                raise VerifyError(
                    f"verify: batches[{i}] leaf {rules.path_str(path) or '<root>'} is {y.dtype}{list(y.shape)}, "
                    f"batches[0]'s is {x.dtype}{list(x.shape)}; every step's batch must have the same shapes "
                    "and dtypes (the step compiles once)"
                )


def _tolerance(tolerance, optimizer, fns, precision) -> Tolerance:
    if isinstance(tolerance, Tolerance):
        return tolerance
    if tolerance is None:
        return default_tolerance(optimizer, fns.abstract_params, precision)
    if tolerance not in TOLERANCES:
        raise VerifyError(f"verify: tolerance {tolerance!r}: choose a Tolerance or one of {', '.join(TOLERANCES)}")
    return TOLERANCES[tolerance]


class _user_code:
    """Turn an exception raised by the caller's model or loss into a one-line VerifyError
    (the original stays chained as its cause)."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        return self

    def __exit__(self, tp, e, tb):
        if e is None or isinstance(e, VerifyError) or not isinstance(e, Exception):
            return False
        first = (str(e).strip().splitlines() or [""])[0]
        raise VerifyError(f"verify: {self.what}: {type(e).__name__}: {first}") from e


def _put(batch, sharding):
    return jax.device_put(batch, sharding)


def _host(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(tree))
