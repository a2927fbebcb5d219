"""libtpu flag sets of published runs (fsdp_jax/targets/tpu_flags.json): what a set holds, the
user's LIBTPU_INIT_ARGS winning flag by flag, the compiling child's environment, and (slow) what
the sets change in a compiled TPU program: MaxText's continuation-fusion flags turn the FSDP
all-gathers into async collective fusions that the op walk reads as async collectives."""

import dataclasses
import json
import shlex
from pathlib import Path

import pytest

from fsdp_jax.targets import gpu as target_gpu
from fsdp_jax.targets import tpu_flags
from helpers import plans_in_one_child

ROOT = Path(__file__).resolve().parents[1]


def test_every_set_has_a_source_and_a_reason_for_each_flag_it_adds():
    raw = json.loads((ROOT / "fsdp_jax/targets/tpu_flags.json").read_text())
    assert raw["libtpu"] and set(raw["sets"]) == set(tpu_flags.flag_set_names())
    for name, s in raw["sets"].items():
        assert "maxtext" in s["source"].lower() and s["flags"], name
        assert all(why for why in s["added"].values()), name
        got = tpu_flags.flag_set(name)
        assert got == tuple(f for f in s["flags"] if f not in s["rejected"]) + tuple(s["added"])
        assert all(f.startswith("--xla_") and "=" in f for f in got)
    with pytest.raises(ValueError, match="maxtext-llama2-70b-v5p"):
        tpu_flags.flag_set("nonsense")


def test_the_users_libtpu_flags_win():
    ours = "--xla_a=true --xla_b=1 --xla_c=x"
    got = tpu_flags.merge_init_args(ours, "--xla_b=7 --xla_user=on")
    assert shlex.split(got) == ["--xla_b=7", "--xla_user=on", "--xla_a=true", "--xla_c=x"]
    assert tpu_flags.merge_init_args(ours, "") == ours
    env = {"LIBTPU_INIT_ARGS": "--xla_enable_async_all_gather=false"}
    args = tpu_flags.init_args("maxtext-llama2-70b-v6e", environ=env).split()
    assert "--xla_enable_async_all_gather=false" in args and "--xla_enable_async_all_gather=true" not in args


def test_the_compiling_child_gets_the_targets_flags_under_the_users(monkeypatch):
    monkeypatch.setattr(target_gpu, "plugin_installed", lambda kind="cuda": True)
    t = target_gpu.make_target("v5p", devices=8)
    assert "LIBTPU_INIT_ARGS" not in target_gpu.child_env({}, target=t)
    flags = " ".join(tpu_flags.flag_set("maxtext-llama2-70b-v5p"))
    t = target_gpu.Target(**{**t.as_dict(), "libtpu_args": flags})  # as the child rebuilds it
    assert target_gpu.child_env({}, target=t)["LIBTPU_INIT_ARGS"] == flags
    user = {"LIBTPU_INIT_ARGS": "--xla_tpu_overlap_compute_collective_tc=false"}
    got = target_gpu.child_env(user, target=t)["LIBTPU_INIT_ARGS"].split()
    assert got[0] == "--xla_tpu_overlap_compute_collective_tc=false"
    assert "--xla_tpu_overlap_compute_collective_tc=true" not in got and len(got) == len(flags.split())


@pytest.fixture(scope="module")
def gathers():
    """`gathers(gen, flag_set)`: (`plan --json` document, its full_shard all-gathers) of the tiny
    model planned for 8 `gen` chips under `flag_set` (None: libtpu's defaults), each target in
    one child (`helpers.plans_in_one_child`: the plan's compile child in that process, one
    Python, JAX and libtpu start-up instead of the script's and its compile child's); a target
    planned once for the module (v6e's defaults serve two sets). libtpu reads LIBTPU_INIT_ARGS
    once, when it loads: each flag set needs its own child."""
    done = {}

    def get(gen, name=None):
        if (gen, name) not in done:
            t = target_gpu.make_target(gen, devices=8)
            extra = []
            if name is not None:  # the target `plan --tpu-flags` builds (planner/inputs.py)
                t = dataclasses.replace(t, libtpu_args=" ".join(tpu_flags.flag_set(name)))
                extra = ["--tpu-flags", name]
            argv = ["--config", "configs/tiny.yaml", "--target", gen, "--devices", "8"]
            argv += ["--strategies", "full_shard", "--json", *extra]
            ((rc, out, err),) = plans_in_one_child(t, [argv])
            assert rc == 0, err[-3000:]
            doc = json.loads(out)
            ops = doc["strategies"]["full_shard"]["op_inventory"]
            done[gen, name] = doc, [o for o in ops if o["kind"] == "collective" and o["op"] == "all-gather"]
        return done[gen, name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    "gen, name",
    [("v5p", "maxtext-llama2-70b-v5p"), ("v6e", "maxtext-llama2-70b-v6e"), ("v6e", "maxtext-llama3_1-8b-v6e")],
)
def test_a_sets_flags_turn_the_layer_gathers_into_async_collective_fusions(gen, name, gathers):
    """The tiny model's per-layer gathers: synchronous with libtpu's defaults; with the set (its
    flags all known to the pinned libtpu, which aborts on an unknown one) async collectives
    whose done comes later in the layer loop, from `async-collective-start` fusions."""
    _, plain = gathers(gen)
    doc, flagged = gathers(gen, name)
    assert doc["target"]["libtpu_args"] == " ".join(tpu_flags.flag_set(name))
    in_loop = [o for o in plain if o["loop"]]
    assert in_loop and not any(o["async"] for o in plain)
    fused = [o for o in flagged if o["async"]]
    assert fused and all(o["name"].startswith("async-collective-start") and o["done_pos"] > o["pos"] for o in fused)
    assert all(o["loop"] for o in fused)
