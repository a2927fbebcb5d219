"""Sizes as people write them, and the host memory a node has for offloaded state.

    need = offload.host_bytes_per_process(built.abstract_state)
    check_host_memory(need, "optimizer")   # ConfigError (one line, exit 2) when over

`parse_size("80GB")` reads the sizes every command takes (`--device-memory`,
`--host-memory`, `FSDP_JAX_HOST_MEMORY`): K/M/G/T decimal (as vendors quote memory),
Ki/Mi/Gi/Ti binary. `host_memory()` is what this node can give: `FSDP_JAX_HOST_MEMORY`
when set (to plan for another machine, or where the kernel's figure is not the one to
trust: a container limit), else `MemAvailable` from /proc/meminfo, else
`os.sysconf` (available pages x page size). A process of a multi-process run counts
its own devices' shards; one process per node is the layout this assumes.
"""

from __future__ import annotations

import os
import re
from typing import Callable

from fsdp_jax.errors import ConfigError

HOST_MEMORY_ENV = "FSDP_JAX_HOST_MEMORY"
MEMINFO = "/proc/meminfo"
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE](\d+))?\s*([KMGTkmgt]i?)?[Bb]?\s*")


def parse_size(text: str | int, what: str, error: Callable[[str], Exception] = ValueError) -> int:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2**30, '141G' -> 141e9, '1.5TB', '4096' (bytes).
    A bad size raises `error("<what>: <why>")`."""
    if isinstance(text, int) and not isinstance(text, bool):
        value, unit = (float(text) if abs(text) < 2**63 else float("inf")), ""
    else:
        m = _SIZE.fullmatch(str(text))
        if not m:
            raise error(f"{what}: {text!r} is not a size; use e.g. 80GB, 80GiB, 141GB")
        value = float(m.group(1) + (f"e{m.group(2)}" if m.group(2) else ""))  # 1e400 -> inf
        unit = (m.group(3) or "").lower()
    total = value * _UNITS[unit]
    if not total < 2**63:  # 1e400GB is inf (and int(inf) raises); nothing has 8 EiB
        raise error(f"{what}: {text!r} is too large; at most 8 EiB")
    n = int(total)
    if n <= 0:
        raise error(f"{what}: {text!r} must be > 0")
    return n


def _env_error(message: str) -> ConfigError:
    return ConfigError(HOST_MEMORY_ENV, message.removeprefix(f"{HOST_MEMORY_ENV}: "))


def stated_host_memory(environ=None) -> int | None:
    """`FSDP_JAX_HOST_MEMORY` in bytes, or None when unset (a bad value: ConfigError)."""
    text = (os.environ if environ is None else environ).get(HOST_MEMORY_ENV, "").strip()
    return parse_size(text, HOST_MEMORY_ENV, _env_error) if text else None


def host_memory(environ=None, meminfo: str = MEMINFO) -> tuple[int | None, str]:
    """(bytes of host memory this node has for the run, where the figure comes from);
    (None, why) when nothing says."""
    stated = stated_host_memory(environ)
    if stated is not None:
        return stated, HOST_MEMORY_ENV
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, f"MemAvailable in {meminfo}"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "os.sysconf available pages"
    except (OSError, ValueError, AttributeError):
        return None, "no reading of host memory on this system"


def fmt_size(n: int) -> str:
    """Bytes as GB (10^9, two decimals), or MB below 0.1 GB."""
    return f"{n / 1e9:.2f} GB" if n >= 10**8 else f"{n / 1e6:.2f} MB"


def host_memory_problem(need: int, have: int | None, source: str, offload: str, per: str = "node") -> str | None:
    """The one line saying `need` bytes of offloaded state do not fit in `have`, or None."""
    if have is None or need <= have:
        return None
    return (
        f"{offload!r} rests {fmt_size(need)} of state in host memory per {per}, but the {per} has {fmt_size(have)} "
        f"({source}): shard over more devices or hosts, offload less "
        f"({'offload: optimizer or none' if 'params' in offload else 'offload: none'}), "
        f"or state the host memory with {HOST_MEMORY_ENV}=SIZE if that figure is wrong"
    )


def check_host_memory(need: int, offload: str, environ=None, meminfo: str = MEMINFO) -> None:
    """ConfigError naming `offload` when `need` bytes (this process's offloaded state) are
    more than this node's host memory (`host_memory`)."""
    have, source = host_memory(environ, meminfo)
    problem = host_memory_problem(need, have, source, offload)
    if problem is not None:
        raise ConfigError("offload", problem)
