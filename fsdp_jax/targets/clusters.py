"""Clusters a user rents, named as `--target`s (`fsdp_jax/targets/clusters.json`): a GPU
device, GPUs per host and the network table (`perf_tables.json`) that costs the plan.

    plan --target a3-high --devices 128 --hosts 16    # H100 compiles, A3 High's TCPX network
    plan --list-targets                               # every target with its network figures

A cluster compiles for its device (`h100`) and is costed with its own table: the same GPUs
over GCP's TCPX, AWS's EFA or NDR InfiniBand differ only across hosts. TPU slices are targets
already (`v5p-512`: ICI within the slice, DCN across slices, from `fsdp_jax.targets.tpu`).
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

from fsdp_jax.errors import TargetError
from fsdp_jax.targets import tpu
from fsdp_jax.targets.perf_tables import perf_table


@functools.cache
def clusters() -> dict[str, dict[str, Any]]:
    """{cluster name: {device, gpus_per_host, table, what, source}}."""
    data = json.loads(resources.files("fsdp_jax.targets").joinpath("clusters.json").read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def resolve(name: str, gpus_per_host: int | None) -> tuple[str, int | None, str | None]:
    """(device target, GPUs per host, cluster name or None) for `--target name`: a cluster
    gives its device and its hosts' GPU count (a different `--gpus-per-host` is refused)."""
    c = clusters().get(name)
    if c is None:
        return name, gpus_per_host, None
    if gpus_per_host is not None and gpus_per_host != c["gpus_per_host"]:
        raise TargetError(f"--gpus-per-host: {name} hosts hold {c['gpus_per_host']} GPUs, not {gpus_per_host}")
    return c["device"], c["gpus_per_host"], name


def _link(link: dict[str, Any]) -> str:
    bw = link.get("bus_bytes_per_s")
    return f"{bw / 1e9:.1f} GB/s, {link['latency_s'] * 1e6:.0f} us" if bw else "unpublished"


def target_rows() -> list[dict[str, str]]:
    """One row per `--target`: GPUs (as one host of the vendor's node), clusters and TPU
    generations, each with its network within a host / slice and across them (bus bytes/s
    per device and latency) and where the figures come from."""
    rows = []
    gpus = sorted(
        p.name.removesuffix(".txtpb") for p in resources.files("fsdp_jax.targets").joinpath("gpu_targets").iterdir()
    )
    for name in (g for g in gpus if not g.startswith((".", "_"))):
        t = perf_table(name)
        what = t.get("what") or f"{name.upper()} SXM, 8 per host, one 400 Gb/s NDR NIC per GPU (the vendor's node)"
        rows.append({"target": name, "kind": "gpu", "what": what, **_net(t)})
    for name, c in clusters().items():
        rows.append({"target": name, "kind": "cluster", "what": c["what"], **_net(perf_table(c["table"]))})
    for gen in tpu.TPU_SPECS:
        what = f"TPU {gen} slices ({gen}-N: N chips): ICI within a slice, DCN across --slices"
        rows.append({"target": f"{gen}, {gen}-N", "kind": "tpu", "what": what, **_net(perf_table(gen))})
    return rows


def _net(t: dict[str, Any]) -> dict[str, str]:
    fast, slow = t["links"]["fast"], t["links"]["slow"]
    return {"within": _link(fast), "across": _link(slow), "source": slow.get("source", "")}


def format_targets() -> str:
    """`plan --list-targets`: one line per target, then where each network figure comes from."""
    rows = target_rows()
    w = max(len(r["target"]) for r in rows)
    lines = [f"{'target':<{w}}  {'within a host/slice':<20} {'across hosts/slices':<20} what"]
    lines += [f"{r['target']:<{w}}  {r['within']:<20} {r['across']:<20} {r['what']}" for r in rows]
    lines += ["", "network across hosts, sources (fsdp_jax/targets/perf_tables.json has them whole):"]
    lines += [f"  {r['target']}: {r['source'][:160]}..." for r in rows]
    return "\n".join(lines)
