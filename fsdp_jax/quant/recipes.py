"""FP8 recipe names, what each is and where the name comes from: data, no JAX (the run
config's `fp8.recipe` is checked against it before JAX loads; `fsdp_jax.quant.fp8` computes them)."""

# recipe name -> what it is and where the name comes from (policies as data, with sources)
RECIPES: dict[str, str] = {
    "tensorwise": "per-tensor current scaling: each operand scaled by its own amax this step "
    "(torchtitan float8 recipe_name 'tensorwise'; torchao Float8LinearRecipeName.TENSORWISE; "
    "Transformer Engine Float8CurrentScaling)",
    "delayed": "per-tensor delayed scaling: inputs, weights and output gradients each scaled by "
    "the max over its own amax history of past steps (Transformer Engine DelayedScaling with "
    "amax_compute_algo='max'; Flax fp8_ops input / kernel / output_grad_amax_history)",
    "rowwise": "axiswise current scaling, e4m3 throughout: a scale per row or column along each "
    "GEMM's contracted dim, rounded down to a power of two (torchtitan float8 recipe_name "
    "'rowwise'; torchao Float8LinearRecipeName.ROWWISE; `fsdp_jax.quant.fp8_rowwise`)",
}
