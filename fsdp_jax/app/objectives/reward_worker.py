"""A reward worker process: loads the reward functions, then scores requests, JSON lines in
and out (no pickle). Run by path, `python reward_worker.py '<json specs>'`, so it imports
neither jax nor the project (`fsdp_jax.app.objectives.rewards.RewardPool` starts it).

specs: [{"fn": "module:function" | builtin name, "args": {...}}, ...]. First line out:
{"ready": true} or {"error": "load", "fn": ..., "msg": ...}. Then per request line
{"prompts": [...], "completions": [...], "columns": {name: [...]}} one line out:
{"results": [[value or null, ...] per function]} or {"error": "raise", "fn": ..., "msg": ...}.
The functions' own prints go to stderr (the protocol keeps stdout).
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import sys
import traceback

from reward_builtins import BUILTINS


def load(spec: dict):
    ref, args = spec["fn"], spec.get("args") or {}
    if ref in BUILTINS:
        fn = BUILTINS[ref]
    else:
        mod_name, _, fn_name = ref.partition(":")
        mod = importlib.import_module(mod_name)
        fn = getattr(mod, fn_name, None)
        if fn is None:
            raise AttributeError(f"module {mod_name!r} has no function {fn_name!r}")
        if not callable(fn):
            raise TypeError(f"{ref} is not callable")
    return functools.partial(fn, **args) if args else fn


def _value(v):
    if v is None:
        return None
    f = float(v)
    return "nan" if math.isnan(f) else ("inf" if math.isinf(f) else f)


def main() -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the functions' prints go to stderr
    sys.stdout = sys.stderr
    sys.path.insert(0, os.getcwd())
    specs = json.loads(sys.argv[1])
    fns = []
    for spec in specs:
        try:
            fns.append(load(spec))
        except Exception as e:  # noqa: BLE001 - reported to the trainer, which names the function
            out.write(json.dumps({"error": "load", "fn": spec["fn"], "msg": f"{type(e).__name__}: {e}"}) + "\n")
            return
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        results = []
        for spec, fn in zip(specs, fns):
            try:
                got = fn(req["prompts"], req["completions"], **req["columns"])
                results.append(None if got is None else [_value(v) for v in got])
            except Exception as e:  # noqa: BLE001
                tb = traceback.extract_tb(e.__traceback__)[-1]
                where = f" ({os.path.basename(tb.filename)}:{tb.lineno})"
                out.write(json.dumps({"error": "raise", "fn": spec["fn"], "msg": f"{type(e).__name__}: {e}{where}"}))
                out.write("\n")
                break
        else:
            out.write(json.dumps({"results": results}) + "\n")


if __name__ == "__main__":
    main()
