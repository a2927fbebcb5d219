"""`fsdp-jax plan` once its flags have parsed (they and its description: fsdp_jax.app.cli.plan)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from fsdp_jax.app.cli.args import check_out_file, require
from fsdp_jax.app.host_memory import HOST_MEMORY_ENV, fmt_size, host_memory, stated_host_memory
from fsdp_jax.app.objectives.grpo_run import is_grpo
from fsdp_jax.app.planner import search_report
from fsdp_jax.app.planner.estimate import format_offload_table, plan_config
from fsdp_jax.app.planner.flag_values import (
    check_plan_flags,
    parse_bytes,
    parse_devices,
    parse_offloads,
    parse_strategies,
)
from fsdp_jax.app.planner.inputs import load_planning_config, resolve_target
from fsdp_jax.app.planner.nvme_plan import disk_bytes_per_s
from fsdp_jax.app.planner.report import format_table, plot_plan
from fsdp_jax.app.planner.search import search
from fsdp_jax.app.planner.search_space import Limits, SearchSpace, attention_kernels
from fsdp_jax.errors import PlanError, SearchError
from fsdp_jax.nvme import NVME_OFFLOADS
from fsdp_jax.targets.gpu import device_memory
from fsdp_jax.verify.run import devices_for


def plan_host_memory(args, target) -> tuple[int, str] | None:
    """(host memory per host, where it comes from) to plan offload against: --host-memory,
    else FSDP_JAX_HOST_MEMORY, else (no --target: this machine is the host) what this
    machine has available; None with a --target and neither given."""

    if args.host_memory is not None:
        return parse_bytes(args.host_memory, "--host-memory"), "--host-memory"
    stated = stated_host_memory()
    if stated is not None:
        return stated, HOST_MEMORY_ENV
    have, source = host_memory()
    return (have, f"this machine's {source}") if target is None and have is not None else None


def plan_disk(args, target, offloads) -> float | None:
    """--disk-gbps in bytes/s (None: the target's figure); PlanError (one line) when it is not a
    positive number, or when an nvme offload is planned for a target that states no disk
    bandwidth and none is given."""
    if args.disk_gbps is not None:
        if not args.disk_gbps > 0:
            raise PlanError(f"--disk-gbps: {args.disk_gbps} must be a positive number of GB/s")
        return args.disk_gbps * 1e9
    if target is not None and any(o in NVME_OFFLOADS for o in offloads or ()):
        try:
            disk_bytes_per_s(target.table)
        except ValueError as e:
            raise PlanError(f"--offload: {e}") from None
    return None


def refuse_over_host(docs: dict[str, dict], host: tuple[int, str] | None) -> None:
    """PlanError (one line, exit 2) when host memory was stated and the offloaded state of
    every strategy under every offload setting planned is over it."""

    if host is None or host[1] not in ("--host-memory", HOST_MEMORY_ENV):  # this machine's figure: a note
        return
    rows = [(o, n, r) for o, d in docs.items() for n, r in d["strategies"].items()]
    if rows and all(r.get("fits_host") is False for _, _, r in rows):
        o, n, r = min(rows, key=lambda t: t[2]["analytic"]["host_per_host"])
        raise PlanError(
            f"{host[1]}: {fmt_size(host[0])} of host memory per host is less than any plan's offloaded state "
            f"(least: {n} with offload {o}, {fmt_size(r['analytic']['host_per_host'])} per host); "
            "shard over more devices or hosts, or offload less"
        )


SEARCH_CHILD = "FSDP_JAX_PLAN_SEARCH_CHILD"  # set in that child: it never starts another


def search_in_child(argv: list[str]) -> int:
    """The same `plan` command in a child process that starts JAX with the devices the search's
    analytic pass builds its step on (this one started its backends with fewer: a notebook, a
    test); its output and exit code pass through."""
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_jax.app.cli", "plan", *argv],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, SEARCH_CHILD: "1"},
    )
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    return proc.returncode


def search_command(args) -> int:
    """plan --search: parse, search, print; nothing fits -> one line, exit 2."""

    if args.plot:
        raise SearchError("--plot: not with --search")
    n, target = resolve_target(args)
    if args.device_memory is not None:
        mem = parse_bytes(args.device_memory)
    elif target is not None:
        mem = device_memory(target.name)
    else:
        raise SearchError("--search: give --device-memory (or a --target, whose memory is known)")
    headroom, fraction = search_report.parse_headroom(args.headroom)
    space = SearchSpace(
        strategies=tuple(parse_strategies(args.strategies)),
        remats=search_report.parse_remats(args.remat),
        microbatches=search_report.parse_microbatches(args.microbatches),
        offloads=search_report.parse_offloads(args.offload),
        vary=search_report.parse_vary(args.vary),
    )
    attentions = search_report.parse_attentions(args.attention)
    limits = Limits(
        device_memory=mem,
        headroom=headroom,
        headroom_fraction=fraction,
        host_memory=None if args.host_memory is None else parse_bytes(args.host_memory, "--host-memory"),
        disk_bytes_per_s=plan_disk(args, target, space.offloads if args.offload else ()),
        max_compiles=(
            4
            if args.max_compiles is None
            else 0
            if args.max_compiles.strip() == "0"
            else parse_devices(args.max_compiles, "--max-compiles")
        ),
    )
    rows = 10 if args.rows is None else parse_devices(args.rows, "--rows")
    cfg = load_planning_config(args.config, args.overrides, n, target)
    if is_grpo(cfg):  # the search ranks training steps: it knows neither generation nor what GRPO refuses
        raise SearchError(
            "--search: objective=grpo is not searched (it ranks training steps alone and would try offload, "
            "which GRPO refuses); plan the GRPO step without --search (docs/grpo.md)"
        )
    if devices_for(n) is None and args.argv is not None and not os.environ.get(SEARCH_CHILD):
        return search_in_child(args.argv)
    space = dataclasses.replace(space, attentions=attentions or attention_kernels(cfg, target and target.platform))
    show = args.progress or sys.stderr.isatty()  # else stderr holds only an error's one line
    progress = (lambda msg: print(f"search: {msg}", file=sys.stderr, flush=True)) if show else None
    doc = search(cfg, n, space, limits, target=target, config_name=args.config, progress=progress)
    doc["yaml"] = search_report.winner_yaml(doc)
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        print(search_report.format_search(doc, rows))
    if doc["winner"] is None:
        smaller = None
        if "batch" not in space.vary:  # which batch would fit: the analytic pass alone, no compile
            smaller = search(
                cfg,
                n,
                dataclasses.replace(space, vary=(*space.vary, "batch")),
                dataclasses.replace(limits, max_compiles=0),
                target=target,
                config_name=args.config,
            )
        raise SearchError(search_report.nothing_fits_message(doc, smaller))
    return 0


def run(args) -> int:

    if args.search:
        return search_command(args)
    check_plan_flags(args)  # run before JAX too: fsdp_jax.app.cli.plan's `before`

    n, target = resolve_target(args)
    if args.explain_time and target is None:
        raise PlanError("--explain-time: only with --target (the op-by-op prediction needs a GPU/TPU compile)")
    mem = parse_bytes(args.device_memory) if args.device_memory is not None else None
    strategies = parse_strategies(args.strategies)
    offloads = parse_offloads(args.offload)
    if args.plot:
        check_out_file(args.plot, "--plot")
        require("matplotlib", "--plot")
    host = plan_host_memory(args, target)
    disk = plan_disk(args, target, offloads)
    cfg = load_planning_config(args.config, args.overrides, n, target)  # JAX: n CPU devices, from here on

    docs = {}
    for o in offloads or [cfg.offload]:
        docs[o] = plan_config(
            dataclasses.replace(cfg, offload=o),
            n,
            strategies,
            device_memory=mem,
            config_name=args.config,
            target=target,
            host_memory=host,
            disk_bytes_per_s=disk,
        )
    refuse_over_host(docs, host)  # before the plot is written
    return _print_plans(args, docs)


def _print_plans(args, docs: dict[str, dict]) -> int:

    if len(docs) > 1:
        if args.json:
            json.dump({"offload": docs}, sys.stdout, indent=1)
            print()
        else:
            for o, doc in docs.items():
                print(f"=== offload {o}\n{format_table(doc)}\n")
            print(format_offload_table(docs))
        return 0
    doc = next(iter(docs.values()))
    doc["explain_time"] = args.explain_time
    if args.plot:
        plot_plan(doc, args.plot)
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        print(format_table(doc))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0
