"""XLA:TPU's async collective fusions in the op walk (fsdp_jax.hlo.collective_fusions): one
all-gather written as a start fusion, a carrier fusion that does a GEMM of its own while handing
the collective's buffers on, and a done fusion (as libtpu writes it with MaxText's
CF_FOR_ALL_GATHER flags) costs what the same all-gather as an async start / done pair with that
GEMM between costs; the carrier's own bytes leave the in-flight buffers out."""

import pytest

from fsdp_jax.app.planner import op_costs
from fsdp_jax.hlo.costs import op_inventory
from fsdp_jax.targets.perf_tables import perf_table

V5P = perf_table("v5p")
GROUP = "replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true"
FLIGHT = "(bf16[512,4096]{1,0}, bf16[4096,4096]{1,0}, s32[2]{0})"


def _ag(name: str, param: str) -> str:
    return f"  %{name} = bf16[4096,4096]{{1,0}} all-gather(%{param}), channel_id=7, {GROUP}\n"


FUSED = f"""%fused_start (param_0: bf16[512,4096]) -> {FLIGHT} {{
  %param_0 = bf16[512,4096]{{1,0}} parameter(0)
{_ag("all-gather.1", "param_0")}  ROOT %cc.1 = {FLIGHT} custom-call(%param_0, %all-gather.1), custom_call_target="AsyncCollectiveStart"
}}

%fused_carry (param_0.1: bf16[512,4096], param_1.1: bf16[4096,4096], param_2.1: s32[2], param_3.1: bf16[4096,4096]) -> (bf16[4096,4096], bf16[512,4096], bf16[4096,4096], s32[2]) {{
  %param_0.1 = bf16[512,4096]{{1,0}} parameter(0)
  %param_1.1 = bf16[4096,4096]{{1,0}} parameter(1)
  %param_2.1 = s32[2]{{0}} parameter(2)
  %param_3.1 = bf16[4096,4096]{{1,0}} parameter(3)
{_ag("all-gather.2", "param_0.1")}  %convolution.1 = bf16[4096,4096]{{1,0}} convolution(%param_3.1, %param_3.1), dim_labels=bf_io->bf
  ROOT %tuple.1 = (bf16[4096,4096]{{1,0}}, bf16[512,4096]{{1,0}}, bf16[4096,4096]{{1,0}}, s32[2]{{0}}) tuple(%convolution.1, %param_0.1, %all-gather.2, %param_2.1)
}}

%fused_done (param_0.2: bf16[512,4096], param_1.2: bf16[4096,4096], param_2.2: s32[2]) -> bf16[4096,4096] {{
  %param_0.2 = bf16[512,4096]{{1,0}} parameter(0)
  %param_1.2 = bf16[4096,4096]{{1,0}} parameter(1)
  %param_2.2 = s32[2]{{0}} parameter(2)
{_ag("all-gather.3", "param_0.2")}  ROOT %cc.2 = bf16[4096,4096]{{1,0}} custom-call(%param_0.2, %param_1.2, %param_2.2, %all-gather.3), custom_call_target="AsyncCollectiveDone"
}}

"""

ENTRY = """ENTRY %main (p0: bf16[512,4096], p1: bf16[4096,4096]) -> bf16[4096,4096] {
  %p0 = bf16[512,4096]{1,0} parameter(0)
  %p1 = bf16[4096,4096]{1,0} parameter(1)
BODY  ROOT %convolution.9 = bf16[4096,4096]{1,0} convolution(%WEIGHT, %p1), dim_labels=bf_io->bf
}
"""

FUSIONS = f"""  %async-collective-start.1 = {FLIGHT} fusion(%p0), kind=kCustom, calls=%fused_start
  %g0 = bf16[512,4096]{{1,0}} get-tuple-element(%async-collective-start.1), index=0
  %g1 = bf16[4096,4096]{{1,0}} get-tuple-element(%async-collective-start.1), index=1
  %g2 = s32[2]{{0}} get-tuple-element(%async-collective-start.1), index=2
  %fusion.5 = (bf16[4096,4096]{{1,0}}, bf16[512,4096]{{1,0}}, bf16[4096,4096]{{1,0}}, s32[2]{{0}}) fusion(%g0, %g1, %g2, %p1), kind=kOutput, calls=%fused_carry
  %h1 = bf16[512,4096]{{1,0}} get-tuple-element(%fusion.5), index=1
  %h2 = bf16[4096,4096]{{1,0}} get-tuple-element(%fusion.5), index=2
  %h3 = s32[2]{{0}} get-tuple-element(%fusion.5), index=3
  %async-collective-done.1 = bf16[4096,4096]{{1,0}} fusion(%h1, %h2, %h3), kind=kCustom, calls=%fused_done
"""

PAIR = f"""  %ag-start = (bf16[512,4096]{{1,0}}, bf16[4096,4096]{{1,0}}) all-gather-start(%p0), channel_id=7, {GROUP}
  %convolution.5 = bf16[4096,4096]{{1,0}} convolution(%p1, %p1), dim_labels=bf_io->bf
  %ag-done = bf16[4096,4096]{{1,0}} all-gather-done(%ag-start)
"""


def _program(fused: bool) -> str:
    body = FUSIONS if fused else PAIR
    weight = "async-collective-done.1" if fused else "ag-done"
    return (
        "HloModule m, is_scheduled=true\n\n"
        + (FUSED if fused else "")
        + ENTRY.replace("BODY", body).replace("WEIGHT", weight)
    )


def test_a_collective_fusion_is_one_async_collective_hidden_by_its_carriers():
    ops = op_inventory(_program(fused=True))
    (ag,) = [o for o in ops if o["kind"] == "collective"]
    pos = {o["name"]: o["pos"] for o in ops}
    assert (ag["name"], ag["op"], ag["bytes"], ag["group_size"], ag["async"]) == (
        "async-collective-start.1",
        "all-gather",
        4096 * 4096 * 2,
        8,
        True,
    )
    assert ag["done_pos"] > pos["fusion.5"]  # the done fusion, after the carrier
    assert "async-collective-done.1" not in pos  # the done is the collective's end, no cost of its own
    carrier = next(o for o in ops if o["name"] == "fusion.5")
    assert carrier["kind"] == "gemm" and carrier["flops"] == 2 * 4096**3
    # its own bytes: its GEMM's operand (p1) and result, and the s32[2] sync words in and out; the
    # shard and the gathered buffer it takes and hands on are the collective's
    assert carrier["bytes"] == 2 * 4096 * 4096 * 2 + 2 * 8
    sim, pair = (op_costs.simulate(op_inventory(_program(f)), V5P) for f in (True, False))
    assert sim["breakdown"]["exposed_comm"] == pytest.approx(pair["breakdown"]["exposed_comm"], abs=1e-12)
    assert sim["breakdown"]["gemm"] == pytest.approx(pair["breakdown"]["gemm"], rel=1e-12)
    assert sim["step_s"] == pytest.approx(pair["step_s"], rel=1e-12)


def test_a_collective_fused_alone_is_synchronous():
    """A channel met once in a computation: the collective waits for itself."""
    one = (
        FUSIONS.split("  %g0")[0]
        + "  %w = bf16[4096,4096]{1,0} get-tuple-element(%async-collective-start.1), index=1\n"
    )
    hlo = "HloModule m, is_scheduled=true\n\n" + FUSED + ENTRY.replace("BODY", one).replace("WEIGHT", "w")
    ops = op_inventory(hlo)
    (ag,) = [o for o in ops if o["kind"] == "collective"]
    assert not ag["async"] and ag["done_pos"] is None
    sim = op_costs.simulate(ops, V5P)
    assert sim["breakdown"]["exposed all-gather"] == pytest.approx(op_costs.collective_seconds(ag, V5P), rel=1e-12)
