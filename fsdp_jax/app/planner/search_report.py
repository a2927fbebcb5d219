"""The search's user side: its flags in, its ranked table and YAML snippet out.

    space = SearchSpace(remats=parse_remats("dots,full"), microbatches=parse_microbatches("1,2"))
    print(format_search(doc))          # a `fsdp_jax.app.planner.search.search` document
    print(winner_yaml(doc))            # the winner's overrides as config YAML

Bad input raises `SearchError` (a `PlanError`), whose message names the flag.
"""

from __future__ import annotations

import math
from typing import Any

import yaml

from fsdp_jax.app.config.schema import MODEL_CHOICES
from fsdp_jax.app.planner import nvme_plan
from fsdp_jax.app.planner.flag_values import parse_bytes
from fsdp_jax.app.planner.report import fmt_bytes
from fsdp_jax.app.planner.search_space import OFFLOAD_SETTINGS, PLANNED_ONLY, VARY
from fsdp_jax.errors import SearchError
from fsdp_jax.sharding.remat import REMAT_POLICIES, device_policies


def _items(text: str, flag: str) -> list[str]:
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise SearchError(f"{flag}: {text!r} is empty; the search space needs at least one value")
    return list(dict.fromkeys(items))


def parse_remats(text: str | None) -> tuple[str, ...]:
    """None: the policies searched on the device (`search_rank`); 'all': every record; or a list."""

    if text is None:
        return device_policies()
    if text.strip() == "all":
        return tuple(REMAT_POLICIES)
    names = _items(text, "--remat")
    bad = [n for n in names if n not in REMAT_POLICIES]
    if bad:
        raise SearchError(f"--remat: {bad[0]!r} is not a remat policy; choose from {', '.join(REMAT_POLICIES)}")
    return tuple(names)


def parse_microbatches(text: str | None) -> tuple[int, ...] | None:
    """None: every power of two dividing the per-device batch; or a list of positive ints."""
    if text is None:
        return None
    out = []
    for t in _items(text, "--microbatches"):
        try:
            m = int(t)
        except ValueError:
            raise SearchError(f"--microbatches: {t!r} is not an integer") from None
        if not 1 <= m <= 1 << 16:
            raise SearchError(f"--microbatches: {m} must be in 1..65536")
        out.append(m)
    return tuple(out)


def parse_offloads(text: str | None) -> tuple[str, ...]:
    """None or 'all': every offload setting; or a list."""
    if text is None or text.strip() == "all":
        return OFFLOAD_SETTINGS
    names = _items(text, "--offload")
    bad = [n for n in names if n not in OFFLOAD_SETTINGS + PLANNED_ONLY]
    if bad:
        raise SearchError(f"--offload: {bad[0]!r} is not one of {', '.join(OFFLOAD_SETTINGS + PLANNED_ONLY)} (or all)")
    return tuple(names)


def parse_vary(text: str | None) -> tuple[str, ...]:
    if text is None:
        return ()
    names = _items(text, "--vary")
    bad = [n for n in names if n not in VARY]
    if bad:
        raise SearchError(f"--vary: {bad[0]!r} is not one of {', '.join(VARY)}")
    return tuple(names)


def parse_attentions(text: str | None) -> tuple[str, ...] | None:
    """`--attention`: a comma list of `model.attention` values; None when not given (the
    search then tries `search_space.attention_kernels`: the config's, and with a target XLA's
    and the platform's flash kernel)."""

    if text is None:
        return None
    names = _items(text, "--attention")
    bad = [n for n in names if n not in MODEL_CHOICES["attention"]]
    if bad:
        raise SearchError(f"--attention: {bad[0]!r} is not one of {', '.join(MODEL_CHOICES['attention'])}")
    return tuple(names)


def parse_headroom(text: str | None) -> tuple[int, float | None]:
    """(bytes, fraction): '10%' -> (0, 0.1); '8GB' -> (8e9, None); None -> 10%."""
    if text is None:
        return 0, 0.10
    t = str(text).strip()
    if t.endswith("%"):
        try:
            f = float(t[:-1]) / 100
        except ValueError:
            raise SearchError(f"--headroom: {text!r} is not a percentage or a size (10%, 8GB)") from None
        if not 0 <= f < 1:
            raise SearchError(f"--headroom: {text!r} must be at least 0% and under 100% of the device memory")
        return 0, f
    if t in ("0", "0GB"):
        return 0, None
    return parse_bytes(t, "--headroom"), None


def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def format_search(doc: dict[str, Any], rows: int = 10) -> str:
    """The ranked table: the best `rows` candidates that fit and the best 3 at the memory edge
    (not compiled: they may fit), then why the others were dropped, then the winner's overrides."""
    tgt = doc["target"]
    where = f"{tgt['name']} x {doc['devices']}" if tgt else f"{doc['devices']} devices (CPU compile)"
    c = doc["counts"]
    lines = [
        (
            f"search: {doc['config'] or 'config'} on {where}; device memory {fmt_bytes(doc['device_memory'])}, "
            f"headroom {fmt_bytes(doc['headroom'])} -> budget {fmt_bytes(doc['budget'])}; "
            f"ranked by {doc['ranked_by']}"
        ),
        (
            f"{c['candidates']} candidates, {c['dropped']} dropped, {c['compiled']} compiled, "
            f"{c['fits']} fit; {doc['wall_s']} s"
        ),
    ]
    lo = doc.get("lora")
    if lo:
        lines.append(
            f"LoRA rank {lo['rank']} ({lo['targets']}): {lo['adapter_params']:,} adapter params train, with "
            f"optimizer state for them only; the base is frozen at {lo['base_dtype']}"
            + (f", its targets' weights quantised ({lo['base_quant_label']})" if "base_quant" in lo else "")
        )
    hdr = (
        f"{'#':>3} {'device':>9} {'by':<8} {'free':>9} {'host/host':>9} {'step s':>8} "
        f"{'tok/s/' + ('chip' if tgt and tgt.get('topology_name') else 'GPU'):>10} {'MFU':>6}  "
        f"{'status':<6} overrides"
    )
    lines += [hdr, "-" * len(hdr)]
    fits = [x for x in doc["candidates"] if x["status"] == "fits"][:rows]
    edge = [x for x in doc["candidates"] if x["status"] == "edge"][:3]  # maybe: not compiled
    won = [doc["winner"]] if doc.get("winner") is not None and doc["winner"] not in fits else []
    shown = sorted(fits + edge + won, key=lambda x: x["rank"])  # the winner always (a verified fit can rank low)
    for x in shown:
        p, peak = x["predicted"], x["device_peak"]
        lines.append(
            f"{x['rank']:>3} {fmt_bytes(peak):>9} {'compiled' if x['compiled'] else 'analytic':<8} "
            f"{fmt_bytes(x['free']):>9} "
            f"{fmt_bytes(x['analytic']['host_per_host']):>9} "
            f"{p['step_s']:>8.3g} {p['tokens_per_s_per_gpu']:>10,.0f} {p['mfu']:>6.1%}  "
            f"{x['status']:<6} {' '.join(x['overrides'])}"
        )
    if not shown:
        lines.append("    (nothing fits)")
    if doc["dropped"]:
        lines.append(
            "dropped or not shown: "
            + "; ".join(f"{n} {why}" for why, n in sorted(doc["dropped"].items(), key=lambda kv: -kv[1]))
        )
    lines += [f"note: {n}" for n in doc["notes"]]
    w = doc["winner"]
    if w is not None:
        planned = f" (LoRA rank {lo['rank']})" if lo else ""
        lines += ["", f"winner{planned}: {' '.join(w['overrides'])}"]
        lines += [f"  compiled schedule warning: {x}" for x in (w["compiled"] or {}).get("warnings", [])]
        if w["compiled"] and w["compiled"].get("basis") == nvme_plan.BASIS:
            lines.append(
                "  device peak: this step compiled without offload - the stacked optimizer state on disk + two "
                "layers of it; its disk I/O per step is in the step time (fsdp_jax.app.planner.nvme_plan)"
            )
        elif w["compiled"] and w["compiled"].get("basis", "compiled") != "compiled":
            lines.append(
                "  device peak: the target's compile of this step without offload - the state resting "
                "on the host + its transient device copies (fsdp_jax.app.planner.target_offload)"
            )
        if w["compiled"] is None:
            lines.append(
                "  not compiled: judged by the analytic model alone (host offload: no compiler here "
                "measures its device peak; check it on the GPU)"
                if w["offload"] != "none"
                else "  not compiled: judged by the analytic model (raise --max-compiles to compile it)"
            )
        lines += ["as YAML (paste into the config):", winner_yaml(doc).rstrip()]
    return "\n".join(lines)


def winner_yaml(doc: dict[str, Any]) -> str:
    """The winner's overrides as a nested YAML mapping ('' when nothing fits), with the `lora:`
    section it was planned with."""
    w = doc["winner"]
    if w is None:
        return ""
    lo = doc.get("lora")
    tree: dict[str, Any] = {}
    if lo:
        tree["lora"] = {k: lo[k] for k in ("rank", "alpha", "rslora", "dropout", "targets")}
        if lo.get("target_parameters", "auto") != "auto":
            tree["lora"]["target_parameters"] = lo["target_parameters"]
        for k in ("base_quant", "quant_block", "double_quant"):
            if k in lo:
                tree["lora"][k] = lo[k]
    for o in w["overrides"]:
        key, value = o.split("=", 1)
        *parents, leaf = key.split(".")
        node = tree
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = yaml.safe_load(value)
    return yaml.safe_dump(tree, sort_keys=False)


def ceil_gb(n: int) -> str:
    """Bytes as GB rounded up to 0.01 GB (a memory size that still holds `n`)."""
    return f"{math.ceil(n / 1e7) / 100:.2f}GB"


def nothing_fits_message(doc: dict[str, Any], smaller: dict[str, Any] | None = None) -> str:
    """The one line for a search that found nothing, naming the least device memory that fits,
    why the config's batch did not fit as microbatches where a compile refused one (the f32
    gradient accumulator they add), and, from `smaller` (the same search varying the batch,
    analytic only), the largest smaller global batch that would fit in one microbatch, and how."""
    need = doc["smallest_fitting_memory"]
    tail = (
        "" if need is None else f"; the smallest device memory that would fit is {ceil_gb(need)} (same headroom rule)"
    )
    over = [
        c
        for c in doc["candidates"]
        if c.get("compiled") is not None and c["status"] != "fits" and c.get("microbatches", 1) > 1
    ]
    if over:
        c = min(over, key=lambda c: c["device_peak"])
        tail += (
            f"; {c['microbatches']} microbatches of the global batch {c['global_batch']} compiled to "
            f"{ceil_gb(c['device_peak'])} (microbatches add a gradient accumulator in the params' dtype)"
        )
    asked = max((c["global_batch"] for c in doc["candidates"]), default=0)  # the searched batch
    # without microbatches: the gradient accumulator is what the compile refused above
    fits = [
        c
        for c in (smaller or {}).get("candidates", [])
        if c["status"] == "fits" and c["global_batch"] < asked and c["microbatches"] == 1
    ]
    if fits:
        best = max(fits, key=lambda c: (c["global_batch"], c["predicted"]["tokens_per_s_per_gpu"]))
        tail += (
            f"; at a smaller batch, train.global_batch={best['global_batch']} fits analytically at "
            f"{ceil_gb(best['device_peak'])} ({' '.join(best['overrides'])}): rerun with --vary batch to compile it"
        )
    elif smaller is not None:
        tail += "; no smaller global batch fits either (analytic)"
    return (
        f"--search: none of {doc['counts']['candidates']} configurations fits in "
        f"{fmt_bytes(doc['device_memory'])} per device minus {fmt_bytes(doc['headroom'])} headroom{tail}"
    )
