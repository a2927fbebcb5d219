"""What `fsdp_jax.verify.run` reports and what it holds the report against: the pass/fail
`Tolerance` presets (`TOLERANCES`, chosen by `default_tolerance` from the optimizer kind
and the compute dtype) and the relative differences they limit (`rel_diff`, `leaf_rel`), the first `Divergence` of a strategy, one `StrategyReport` per
strategy and the whole `VerifyReport` with its JSON round trip and its table. Data
and formatting only: running the comparison is `fsdp_jax.verify.run` (`fsdp_jax.verify.compare`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import numpy as np
import optax

from fsdp_jax.sharding.precision import Policy


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Pass/fail limits. `loss_rtol`: |loss - ref| / |ref| at every step.
    `grad_norm_rtol`: the same for the global grad norm. `param_rtol`: per leaf,
    ||p - p_ref|| / ||p_ref|| (Frobenius) after every step."""

    name: str
    loss_rtol: float
    grad_norm_rtol: float
    param_rtol: float


def rel_diff(x: float, ref: float) -> float:
    if x == ref or (np.isnan(x) and np.isnan(ref)):
        return 0.0
    d = abs(x - ref) / max(abs(ref), 1e-30)
    return float(d) if np.isfinite(d) else float("inf")


def leaf_rel(a: np.ndarray, ref: np.ndarray) -> float:
    """||a - ref|| / ||ref|| (Frobenius, float64); inf for non-finite differences."""
    num = float(np.linalg.norm((a - ref).ravel()))
    if num == 0.0:
        return 0.0
    d = num / max(float(np.linalg.norm(ref.ravel())), 1e-30)
    return d if np.isfinite(d) else float("inf")


# From benchmarks/verify_tolerances.py (docs/verify.md: the table and the
# command): the largest difference any strategy showed on healthy models (the reference
# Llama, a Linen and an NNX MLP; 5 steps on 8 CPU devices), times a margin of 9-30,
# rounded up. Loss differences in bf16 come from the forward pass, so both bf16
# presets share one loss limit; Adam-like updates amplify rounding in near-zero grads,
# hence their looser param limits. Comments: the measured maxima (loss, grad norm, param).
TOLERANCES: dict[str, Tolerance] = {
    t.name: t
    for t in (
        Tolerance("sgd-f32", loss_rtol=2e-6, grad_norm_rtol=2e-6, param_rtol=1e-6),  # 1.2e-7 8.6e-8 5.2e-8
        Tolerance("adaptive-f32", loss_rtol=1e-5, grad_norm_rtol=1e-5, param_rtol=5e-5),  # 3.5e-7 2.0e-7 2.5e-6
        Tolerance("sgd-bf16", loss_rtol=2e-3, grad_norm_rtol=2e-3, param_rtol=1e-2),  # 1.3e-4 1.6e-4 6.2e-4
        Tolerance("adaptive-bf16", loss_rtol=2e-3, grad_norm_rtol=2e-2, param_rtol=5e-2),  # 2.7e-5 9.9e-4 5.6e-3
    )
}

# Optimizer-state fields that make an update scale-free (Adam-like): such updates
# amplify rounding on near-zero grads, so they get the looser limits.
_ADAPTIVE_FIELDS = {"nu", "nu_max", "v_row", "v_col", "v", "sum_of_squares", "grad_sqr", "exp_avg_sq"}


def optimizer_kind(optimizer: optax.GradientTransformation, abstract_params) -> str:
    """`adaptive` when the optimizer keeps second-moment state (Adam, AdamW, Adafactor,
    RMSProp, Adagrad) or is sign-based (Lion), else `sgd`."""
    found = []

    def visit(x):
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            if _ADAPTIVE_FIELDS & set(x._fields) or "Lion" in type(x).__name__:
                found.append(type(x).__name__)
            for v in x:
                visit(v)
        elif isinstance(x, (tuple, list)):
            for v in x:
                visit(v)
        elif isinstance(x, Mapping):
            for v in x.values():
                visit(v)

    visit(jax.eval_shape(optimizer.init, abstract_params))
    return "adaptive" if found else "sgd"


def default_tolerance(optimizer, abstract_params, precision=None) -> Tolerance:
    """The `TOLERANCES` preset for this optimizer (sgd / adaptive) and compute dtype
    (f32, or bf16 for any 16-bit compute)."""
    compute = Policy.parse(precision).compute_dtype
    width = "f32" if np.dtype(compute).itemsize >= 4 else "bf16"
    return TOLERANCES[f"{optimizer_kind(optimizer, abstract_params)}-{width}"]


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The first step (1-based) at which a strategy left the tolerance. `loss` /
    `grad_norm`: relative errors at that step when they exceeded, else None.
    `leaves`: (path, relative error) of every leaf over `param_rtol` after that
    step, worst first; `exact`: (path, max abs difference) of every leaf compared exactly
    (verify's `exact` option) that differs, worst first."""

    step: int
    loss: float | None
    grad_norm: float | None
    leaves: tuple[tuple[str, float], ...]
    routing: float | None = None
    exact: tuple[tuple[str, float], ...] = ()

    def describe(self, tol: Tolerance) -> str:
        parts = []
        if self.routing is not None:
            parts.append(
                f"the routing differs from the reference's by {self.routing:.3g} although both start from the "
                "same params (a routing computed differently under this sharding, or a tie at rounding level: "
                "try another seed)"
            )
        if self.loss is not None:
            parts.append(f"loss rel diff {self.loss:.3g} > {tol.loss_rtol:g}")
        if self.grad_norm is not None:
            parts.append(f"grad-norm rel diff {self.grad_norm:.3g} > {tol.grad_norm_rtol:g}")
        if self.leaves:
            path, err = self.leaves[0]
            more = f" (+{len(self.leaves) - 1} more leaves)" if len(self.leaves) > 1 else ""
            parts.append(f"param {path} rel diff {err:.3g} > {tol.param_rtol:g}{more}")
        if self.exact:
            path, err = self.exact[0]
            more = f" (+{len(self.exact) - 1} more)" if len(self.exact) > 1 else ""
            parts.append(f"param {path} differs by {err:.3g} (compared exactly){more}")
        return f"step {self.step}: " + "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class StrategyReport:
    """One strategy against the one-device reference. Per-step lists are 1-based
    steps in order. `param_rel_diff`: the worst leaf's ||p - p_ref|| / ||p_ref||
    after each step; `param_max_abs_diff`: the largest element difference after
    the last step; `worst_leaf`: the leaf with the largest relative difference
    after the last step. `init_max_abs_diff`: this strategy's own sharded init
    against the reference init (reported, not judged: training starts from the
    reference init either way; None for materialised params). `state_bytes`:
    per-device params / opt_state / step / total; `peak_bytes`: the compiled
    step's peak (memory_analysis); `collectives_per_step`: {op: {count, bytes}}.
    `routing_diff`: with verify's `routing` option, the largest |difference| of that aux value
    from the reference's at each step (0.0: the same discrete choices); `routing_flip_step`:
    the first step at which it differed (a top-k routing flip), None if none did. The steps from
    there on are reported and not judged: `judged_steps` counts the steps that were.
    `exact_diff`: with verify's `exact` option, the largest |difference| of those leaves from the
    reference's after each step (judged: 0.0 up to a routing flip)."""

    strategy: str
    mesh: dict[str, int]
    passed: bool
    loss_rel_diff: list[float]
    grad_norm_rel_diff: list[float]
    param_rel_diff: list[float]
    param_max_abs_diff: float
    worst_leaf: str
    init_max_abs_diff: float | None
    state_bytes: dict[str, int]
    peak_bytes: int
    collectives_per_step: dict[str, dict[str, int]]
    first_divergence: Divergence | None
    routing_diff: list[float] = dataclasses.field(default_factory=list)
    routing_flip_step: int | None = None
    exact_diff: list[float] = dataclasses.field(default_factory=list)

    @property
    def max_loss_rel_diff(self) -> float:
        return max(self.loss_rel_diff)

    @property
    def judged_steps(self) -> int:
        return len(self.loss_rel_diff) if self.routing_flip_step is None else self.routing_flip_step - 1


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """`verify`'s result: the reference run and one StrategyReport per strategy. `exact`: the
    leaf name compared exactly (verify's `exact` option), `exact_moved`: how far those leaves of
    the reference moved from their start, after each step (max abs)."""

    devices: int
    steps: int
    platform: str
    tolerance: Tolerance
    optimizer_kind: str
    precision: str
    reference_loss: list[float]
    reference_grad_norm: list[float]
    strategies: dict[str, StrategyReport]
    routing: str | None = None
    exact: str | None = None
    exact_moved: list[float] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.strategies.values())

    @property
    def failed(self) -> list[str]:
        return [n for n, r in self.strategies.items() if not r.passed]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["passed"] = self.passed
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> VerifyReport:
        d = dict(d)
        d.pop("passed", None)
        d["tolerance"] = Tolerance(**d["tolerance"])
        strategies = {}
        for name, r in d["strategies"].items():
            r = dict(r)
            fd = r["first_divergence"]
            if fd is not None:
                r["first_divergence"] = Divergence(
                    fd["step"],
                    fd["loss"],
                    fd["grad_norm"],
                    tuple((p, e) for p, e in fd["leaves"]),
                    fd.get("routing"),
                    tuple((p, e) for p, e in fd.get("exact", ())),
                )
            strategies[name] = StrategyReport(**r)
        d["strategies"] = strategies
        return cls(**d)

    def format(self) -> str:
        """A table (one row per strategy) and one line per failure."""
        t = self.tolerance
        lines = [
            f"verify: {self.steps} steps, 1 device vs {self.devices} {self.platform} devices, "
            f"{self.optimizer_kind} optimizer, precision {self.precision}; tolerance "
            f"{t.name} (loss {t.loss_rtol:g}, grad norm {t.grad_norm_rtol:g}, "
            f"params {t.param_rtol:g})",
            "reference loss " + " ".join(f"{x:.6f}" for x in self.reference_loss),
        ]
        if self.exact:
            moved = " ".join(f"{x:.3g}" for x in self.exact_moved)
            lines.append(f"{self.exact} compared exactly; the reference's moved from its start by (max abs) {moved}")
        head = (
            f"{'strategy':<14} {'data x fsdp':<12} {'loss rel':>9} {'gnorm rel':>9} {'param rel':>9} "
            f"{'param abs':>9} {'state/dev':>10} {'collectives/step':<34} result"
        )
        lines += [head, "-" * len(head)]
        for name, r in self.strategies.items():
            mesh = f"{r.mesh.get('data', 1)} x {r.mesh.get('fsdp', 1)}"
            coll = (
                ", ".join(
                    f"{op.replace('all-', 'a').replace('reduce-scatter', 'rs')} {c['count']}"
                    for op, c in sorted(r.collectives_per_step.items())
                )
                or "none"
            )
            lines.append(
                f"{name:<14} {mesh:<12} {r.max_loss_rel_diff:>9.2e} {max(r.grad_norm_rel_diff):>9.2e} "
                f"{max(r.param_rel_diff):>9.2e} {r.param_max_abs_diff:>9.2e} "
                f"{_mib(r.state_bytes['total']):>10} {coll:<34} {_result(r)}"
            )
        for name, r in self.strategies.items():
            if r.first_divergence is not None:
                lines.append(f"FAIL {name}: first divergence at {r.first_divergence.describe(t)}")
            if r.routing_flip_step is not None and r.first_divergence is None:
                s = r.routing_flip_step
                lines.append(
                    f"note {name}: the routing ({self.routing}) differs from the reference's at step {s} "
                    f"(by {r.routing_diff[s - 1]:.3g}): a token's top-k choice flipped, a discontinuity no "
                    f"tolerance covers; steps {s}-{self.steps} reported, not judged"
                )
            if r.init_max_abs_diff:
                lines.append(
                    f"note {name}: its own sharded init differs from the one-device init by "
                    f"{r.init_max_abs_diff:.3g} (verify trains both from the same init)"
                )
        flipped = [n for n, r in self.strategies.items() if r.routing_flip_step is not None]
        judged = f" (up to the routing flip of {', '.join(flipped)})" if flipped else ""
        lines.append(
            f"{'PASS' if self.passed else 'FAIL'}: "
            + (
                f"every strategy trains like one device{judged}"
                if self.passed
                else f"{', '.join(self.failed)} diverged from one device"
            )
        )
        return "\n".join(lines)


def _result(r: StrategyReport) -> str:
    if not r.passed:
        return "FAIL"
    return "PASS" if r.routing_flip_step is None else f"PASS (steps 1-{r.judged_steps})"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
