"""Plots of a run's metrics.jsonl: train/val loss, tokens/s, and where the wall time
went (the step-time breakdown per logged window, and the goodput of each run segment).
`fsdp-jax plot RUN_DIR` draws them; `read_metrics` and `time_fractions` need no
matplotlib."""

from __future__ import annotations

import json
from pathlib import Path

from fsdp_jax.app.extras import require


def read_metrics(path: Path) -> list[dict]:
    records = []
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a UTF-8 text file") from None
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError(f"{path}:{i}: not a metrics record (an object with an integer step)")
            records.append(rec)
    return records


# The breakdown columns of a train record (fsdp_jax.app.trainer.timing.WINDOW), in stacking order.
CATEGORIES = ("device", "data", "checkpoint", "eval", "compile", "profile", "log", "other")


def time_fractions(train: list[dict]) -> dict[str, list[float]]:
    """{category: [fraction of each window's wall time]} for records with `t_wall_s`."""
    rows = [r for r in train if r.get("t_wall_s")]
    return {k: [r.get(f"t_{k}_s", 0.0) / r["t_wall_s"] for r in rows] for k in CATEGORIES}


def _num(v) -> float:
    """A logged value; null (a non-finite value, see "nonfinite") plots as a gap."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else float("nan")


def plot(records: list[dict], out: Path) -> None:

    matplotlib = require("matplotlib", "plot.py")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    timed = [r for r in train if r.get("t_wall_s")]
    goodputs = [r for r in records if "goodput" in r]
    fig, axes = plt.subplots(1, 3 if timed else 2, figsize=(16 if timed else 11, 4))
    ax1, ax2 = axes[0], axes[1]
    ax1.plot([r["step"] for r in train], [_num(r["loss"]) for r in train], label="train")
    if val:
        ax1.plot([r["step"] for r in val], [_num(r["val_loss"]) for r in val], "o-", label="validation")
    ax1.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.plot([r["step"] for r in train], [r.get("tokens_per_s") or 0 for r in train])
    ax2.set(xlabel="step", ylabel="tokens/s", title="throughput")
    ax2.grid(alpha=0.3)
    if timed:
        ax3, fr, bottom = axes[2], time_fractions(timed), [0.0] * len(timed)
        steps = [r["step"] for r in timed]
        width = [max(1.0, 0.8 * (b - a)) for a, b in zip([0] + steps[:-1], steps)]
        for k in CATEGORIES:
            if any(fr[k]):
                ax3.bar(steps, fr[k], width=width, bottom=bottom, label=k)
                bottom = [b + f for b, f in zip(bottom, fr[k])]
        title = "wall time per logged window"
        if goodputs:
            title += " | goodput " + ", ".join(f"{g['goodput']:.0%} (to step {g['step']})" for g in goodputs)
        ax3.set(xlabel="step", ylabel="fraction of window wall time", title=title, ylim=(0, 1))
        ax3.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
