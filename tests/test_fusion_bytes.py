"""Bytes a fusion moves (fsdp_jax.hlo.fusion_bytes) on hand-built fused computations shaped
like the GRPO decode step's KV-cache fusions (XLA:GPU writes them as `dynamic-update-slice(
bitcast(param), ...)` roots and `dynamic-slice(dynamic-update-slice(bitcast(param), ...))`):
an in-place update moves its update, not the buffer, through bitcasts and in root tuples,
as XLA:GPU's in-place emitter decides; an update into a buffer the fusion builds does not."""

import pytest

from fsdp_jax.hlo.costs import op_inventory

L, B, K, D, S = 32, 8, 8, 128, 1536  # layers, rows, kv heads, head dim, cache length
CACHE = L * B * K * D * S * 2  # bf16
LAYER = CACHE // L
SLOT = B * K * D * 2  # one token's keys for one layer
IDX = 4  # an s32 index operand


def _one(fused: str, params: str, call: str, out: str) -> dict:
    """The op record of the one fusion of a module whose entry calls `fused`."""
    hlo = (
        "HloModule m, is_scheduled=true\n\n"
        f"{fused}\n"
        f"ENTRY %main ({params}) -> {out} {{\n"
        "  %cache = bf16[32,8,8,128,1536]{4,3,2,1,0} parameter(0)\n"
        "  %new = bf16[8,8,128]{2,1,0} parameter(1)\n"
        "  %l = s32[] parameter(2)\n  %p = s32[] parameter(3)\n"
        f"  ROOT %f = {out} {call}\n}}\n"
    )
    (op,) = op_inventory(hlo)
    assert op["kind"] == "memory"
    return op


PARAMS = "cache: bf16[32,8,8,128,1536], new: bf16[8,8,128], l: s32[], p: s32[]"
HEAD = """  %param_0 = bf16[32,8,1536,8,128]{2,4,3,1,0} parameter(0)
  %cache_view = bf16[32,8,8,128,1536]{4,3,2,1,0} bitcast(%param_0)
  %param_1 = bf16[8,8,128]{2,1,0} parameter(1)
  %slot = bf16[1,8,8,128,1]{4,3,2,1,0} bitcast(%param_1)
  %param_2 = s32[] parameter(2)
  %param_3 = s32[] parameter(3)
  %z = s32[] constant(0)
"""
DUS = "dynamic-update-slice(%cache_view, %slot, %param_2, %z, %z, %z, %param_3)"  # the token's keys at (l, p)
SIG = "(param_0: bf16[32,8,1536,8,128], param_1: bf16[8,8,128], param_2: s32[], param_3: s32[])"
CALL = "fusion(%cache, %new, %l, %p), kind=kLoop, calls=%fused"


def test_a_cache_update_through_a_bitcast_moves_the_token_not_the_cache():
    fused = (
        f"%fused {SIG} -> bf16[32,8,8,128,1536] {{\n{HEAD}  ROOT %dus = bf16[32,8,8,128,1536]{{4,3,2,1,0}} {DUS}\n}}\n"
    )
    op = _one(fused, PARAMS, CALL, "bf16[32,8,8,128,1536]{4,3,2,1,0}")
    assert op["bytes"] == SLOT + SLOT + 2 * IDX  # the update read and written, the indices: not 2 x 0.4 GB


def test_the_layer_sliced_out_of_the_just_updated_cache_reads_one_layer():
    fused = (
        f"%fused {SIG} -> bf16[1,8,8,128,1536] {{\n{HEAD}"
        f"  %dus = bf16[32,8,8,128,1536]{{4,3,2,1,0}} {DUS}\n"
        "  ROOT %ds = bf16[1,8,8,128,1536]{4,3,2,1,0} dynamic-slice(%dus, %param_2, %z, %z, %z, %z), "
        "dynamic_slice_sizes={1,8,8,128,1536}\n}\n"
    )
    op = _one(fused, PARAMS, CALL, "bf16[1,8,8,128,1536]{4,3,2,1,0}")
    assert op["bytes"] == LAYER + SLOT + 2 * IDX + LAYER  # the layer (and the token) read, the layer written


def test_a_bitcast_root_and_a_root_tuple_of_updates_are_in_place():
    keys = f"  %dus = bf16[32,8,8,128,1536]{{4,3,2,1,0}} {DUS}\n"
    bitcast = f"%fused {SIG} -> bf16[32,8,1536,8,128] {{\n{HEAD}{keys}  ROOT %b = bf16[32,8,1536,8,128]{{2,4,3,1,0}} bitcast(%dus)\n}}\n"
    op = _one(bitcast, PARAMS, CALL, "bf16[32,8,1536,8,128]{2,4,3,1,0}")
    assert op["bytes"] == 2 * SLOT + 2 * IDX
    values = keys.replace("%dus", "%dus_v").replace("%cache_view", "%param_4")
    sig = SIG.replace(")", ", param_4: bf16[32,8,8,128,1536])")
    out = "(bf16[32,8,8,128,1536], bf16[32,8,8,128,1536])"
    tup = (
        f"%fused {sig} -> {out} {{\n{HEAD}  %param_4 = bf16[32,8,8,128,1536]{{4,3,2,1,0}} parameter(4)\n"
        f"{keys}{values}  ROOT %t = {out} tuple(%dus, %dus_v)\n}}\n"
    )
    call = CALL.replace("%p)", "%p, %cache2)")
    params = PARAMS + ", cache2: bf16[32,8,8,128,1536]"
    hlo_params = "  %cache2 = bf16[32,8,8,128,1536]{4,3,2,1,0} parameter(4)\n"
    hlo = (
        "HloModule m, is_scheduled=true\n\n"
        f"{tup}\nENTRY %main ({params}) -> {out} {{\n"
        "  %cache = bf16[32,8,8,128,1536]{4,3,2,1,0} parameter(0)\n  %new = bf16[8,8,128]{2,1,0} parameter(1)\n"
        f"  %l = s32[] parameter(2)\n  %p = s32[] parameter(3)\n{hlo_params}  ROOT %f = {out} {call}\n}}\n"
    )
    (op,) = op_inventory(hlo)
    assert op["bytes"] == SLOT + 2 * SLOT + 2 * IDX  # one update read (both use it), written into both caches


@pytest.mark.parametrize("buffer", ["broadcast", "tuple_with_a_plain_output"])
def test_an_update_that_is_not_in_place_writes_the_whole_result(buffer):
    if buffer == "broadcast":  # a zero buffer built inside the fusion: XLA:GPU writes every element
        body = (
            "  %zero = bf16[] constant(0)\n"
            "  %fresh = bf16[32,8,8,128,1536]{4,3,2,1,0} broadcast(%zero), dimensions={}\n"
            f"  ROOT %dus = bf16[32,8,8,128,1536]{{4,3,2,1,0}} {DUS.replace('%cache_view', '%fresh')}\n"
        )
        fused = f"%fused {SIG} -> bf16[32,8,8,128,1536] {{\n{HEAD}{body}}}\n"
        op = _one(fused, PARAMS, CALL, "bf16[32,8,8,128,1536]{4,3,2,1,0}")
        assert op["bytes"] == CACHE + SLOT + 2 * IDX + CACHE  # the whole result written (an unused operand: read)
        return
    out = "(bf16[32,8,8,128,1536], bf16[8,8,128])"  # every output must be an update for XLA:GPU's in-place kernel
    fused = (
        f"%fused {SIG} -> {out} {{\n{HEAD}  %dus = bf16[32,8,8,128,1536]{{4,3,2,1,0}} {DUS}\n"
        "  %neg = bf16[8,8,128]{2,1,0} negate(%param_1)\n  ROOT %t = " + out + " tuple(%dus, %neg)\n}\n"
    )
    op = _one(fused, PARAMS, CALL, out)
    assert op["bytes"] == CACHE + SLOT + 2 * IDX + CACHE + SLOT  # read and rewritten whole


def test_the_recost_script_names_the_fusions_the_rule_costs_differently(tmp_path, capsys):
    """benchmarks/fusion_bytes_recost.py (which ops of a program issue 58's rule re-costs): the
    bitcast cache update above is one such op: the rule before read the whole cache through its bitcast;
    a path that is not there is one line, exit 2."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from fusion_bytes_recost import main

    fused = (
        f"%fused {SIG} -> bf16[32,8,8,128,1536] {{\n{HEAD}  ROOT %dus = bf16[32,8,8,128,1536]{{4,3,2,1,0}} {DUS}\n}}\n"
    )
    hlo = (
        f"HloModule m, is_scheduled=true\n\n{fused}\nENTRY %main ({PARAMS}) -> bf16[32,8,8,128,1536] {{\n"
        "  %cache = bf16[32,8,8,128,1536]{4,3,2,1,0} parameter(0)\n  %new = bf16[8,8,128]{2,1,0} parameter(1)\n"
        "  %l = s32[] parameter(2)\n  %p = s32[] parameter(3)\n"
        f"  ROOT %f = bf16[32,8,8,128,1536]{{4,3,2,1,0}} {CALL}\n}}\n"
    )
    (tmp_path / "m.txt").write_text(hlo)
    assert main([str(tmp_path / "m.txt")]) == 0
    out = capsys.readouterr().out
    assert "1 ops, 1 costed differently" in out
    assert f"f (memory, x1): {CACHE + 2 * SLOT + 2 * IDX:,} -> {2 * SLOT + 2 * IDX:,} bytes" in out
    assert main([str(tmp_path / "absent.txt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "absent.txt" in err and len(err.strip().splitlines()) == 1
