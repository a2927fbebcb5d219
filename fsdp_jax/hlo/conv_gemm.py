"""A convolution read as a matmul: XLA:TPU writes its GEMMs, batched ones too, as convolutions
with windows, dilations and padding; `conv_dims` gives the m, n, k the MXU computes
(`fsdp_jax.hlo.costs` records them as GEMMs)."""

from __future__ import annotations

import math
import re
from typing import Any

from fsdp_jax.hlo.types import type_dims, type_shapes


def _window(line: str, n: int) -> dict[str, list[int]]:
    """A convolution's window attributes per spatial dim (XLA's defaults where absent)."""
    m = re.search(r"\bwindow=\{([^}]*)\}", line)
    got = dict(kv.split("=", 1) for kv in m.group(1).split()) if m else {}
    out = {
        k: [int(x) for x in got[k].split("x")] if k in got else [1] * n for k in ("stride", "lhs_dilate", "rhs_dilate")
    }
    pads = [p.split("_") for p in got["pad"].split("x")] if "pad" in got else [["0", "0"]] * n
    out["pad_lo"] = [int(p[0]) for p in pads]
    return out


def real_taps(w: int, size_in: int, size_out: int, stride: int, pad_lo: int, lhs_dil: int, rhs_dil: int) -> float:
    """The window taps per output position that land on a real input element (not a hole of
    the input's dilation, not padding), on average over the output positions."""
    dil_len = (size_in - 1) * lhs_dil + 1
    total = 0
    for t in range(w):
        first = t * rhs_dil - pad_lo  # input position of tap t at output 0; then + stride per output
        if stride == 1:
            lo, hi = max(first, 0), min(first + size_out - 1, dil_len - 1)
            total += max(hi // lhs_dil - (lo + lhs_dil - 1) // lhs_dil + 1, 0) if hi >= lo else 0
        else:
            total += sum(1 for o in range(size_out) if 0 <= (q := first + o * stride) < dil_len and q % lhs_dil == 0)
    return total / max(size_out, 1)


def conv_dims(line: str, lhs: str, rhs: str, out: str) -> dict[str, Any] | None:
    """m, n, k of a convolution used as a matmul (XLA:TPU's GEMMs, batched ones written with
    windows, dilations and padding): n = the kernel's output features, m = the output
    elements over n, k = the kernel's input features x, per spatial dim, the window taps that
    land on real input (`real_taps`)."""
    labels = re.search(r"\bdim_labels=(\w+)_(\w+)->(\w+)", line)
    ld, rd, od = type_dims(lhs), type_dims(rhs), type_dims(out)
    if not labels or [len(g) for g in labels.groups()] != [len(ld), len(rd), len(od)] or "o" not in labels.group(2):
        return None
    ll, rl, ol = labels.groups()
    n = rd[rl.index("o")] or 1
    k = float(rd[rl.index("i")]) if "i" in rl else 1.0
    spatial = sorted(c for c in rl if c.isdigit())
    win = _window(line, len(spatial))
    for j, s in enumerate(spatial):
        args = (win["stride"][j], win["pad_lo"][j], win["lhs_dilate"][j], win["rhs_dilate"][j])
        k *= real_taps(rd[rl.index(s)], ld[ll.index(s)], od[ol.index(s)], *args)
    m = max(math.prod(od) // n, 1)
    k = max(int(round(k)), 1)
    dtype = type_shapes(lhs)[0][0] if type_shapes(lhs) else "?"
    return {"m": m, "n": n, "k": k, "batch": 1, "dtype": dtype, "flops": 2 * m * n * k}
