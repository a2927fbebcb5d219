"""`fsdp_jax.hlo.calls`: how often each computation of a compiled module runs. XLA:GPU lowers
a lax.cond on a boolean to `conditional(pred, a, b), true_computation=..., false_computation=...`
(XLA:CPU to `branch_computations={...}`); inside a scanned layer its branches run once per trip
of the loop. They were unreachable from the entry, so each counted once per step: the planner
saw the ring attention's later steps once instead of once per layer."""

from fsdp_jax.hlo.calls import call_graph, executions, parse_computations

# the shape of XLA:GPU's scheduled text for a scan of 32 layers with one boolean cond each
GPU_HLO = """HloModule m

%t (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %s = f32[4]{0} sine(%p)
}

%f (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %c = f32[4]{0} cosine(%p)
}

%body (a: (s32[], f32[4])) -> (s32[], f32[4]) {
  %a = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%a), index=0
  %x = f32[4]{0} get-tuple-element(%a), index=1
  %pred = pred[] constant(true)
  %y = f32[4]{0} conditional(%pred, %x, %x), true_computation=%t, false_computation=%f
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %y)
}

%cond (a: (s32[], f32[4])) -> pred[] {
  %a = (s32[], f32[4]{0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%z, %x)
  %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"32"}}
  ROOT %o = f32[4]{0} get-tuple-element(%w), index=1
}
"""


def test_boolean_cond_branches_inside_a_loop_run_per_trip():
    comps, entry = parse_computations(GPU_HLO)
    edges, loops = call_graph(comps)
    runs = executions(comps, edges, entry)
    assert entry == "main" and [lp["trip_count"] for lp in loops] == [32]
    assert runs["body"] == 32
    assert runs["t"] == runs["f"] == 32, runs
