"""libtpu flag sets of published runs (`tpu_flags.json`), for TPU-target compiles.

    args = init_args("maxtext-llama2-70b-v5p", environ=os.environ)   # -> LIBTPU_INIT_ARGS

A set is a recipe's flags as published plus the ones this project adds (each with its reason),
less any the pinned libtpu rejects (listed in the file: libtpu aborts on an unknown flag). The
user's own LIBTPU_INIT_ARGS win flag by flag: a flag they set keeps their value. libtpu reads
the variable when it loads, so it goes into the environment of the compiling child
(`fsdp_jax.targets.gpu.child_env`, from `Target.libtpu_args`).
"""

from __future__ import annotations

import functools
import json
import os
from importlib import resources
from typing import Any


@functools.cache
def _file() -> dict[str, Any]:
    return json.loads(resources.files("fsdp_jax.targets").joinpath("tpu_flags.json").read_text())


def flag_set_names() -> list[str]:
    return sorted(_file()["sets"])


def flag_set(name: str) -> tuple[str, ...]:
    """The flags of set `name`: the recipe's (less the rejected) and the added ones.
    ValueError naming the known sets for an unknown name."""
    sets = _file()["sets"]
    if name not in sets:
        raise ValueError(f"{name!r} is not a libtpu flag set; known: {', '.join(flag_set_names())}")
    s = sets[name]
    return tuple(f for f in s["flags"] if f not in s["rejected"]) + tuple(s["added"])


def _name(flag: str) -> str:
    return flag.lstrip("-").split("=", 1)[0]


def merge_init_args(ours: str, user: str) -> str:
    """LIBTPU_INIT_ARGS with `ours` (space-separated flags) under the user's: a flag the user
    sets keeps their value."""
    theirs = {_name(f) for f in user.split()}
    return " ".join([*user.split(), *(f for f in ours.split() if _name(f) not in theirs)])


def init_args(name: str, environ=os.environ) -> str:
    """LIBTPU_INIT_ARGS for flag set `name` under the environment's own."""
    return merge_init_args(" ".join(flag_set(name)), environ.get("LIBTPU_INIT_ARGS", ""))
