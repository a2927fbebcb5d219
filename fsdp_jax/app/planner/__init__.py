"""Will it fit, and how fast? The planner, in one package.

Two meanings of "plan", one word each: the *plan* is what `fsdp-jax plan` reports — a config
estimated on hardware, per-device memory (analytic and compiled) and the predicted step time
(`plan_config`, `plan_strategy`, `PlanError`); the library's *sharding plan* (`ShardingPlan`,
`fsdp_jax.sharding.strategy.make_plan`) is where each array lives, computed once per model
(CONTRIBUTING.md "Words"). This package makes the first from the second:

* `abstract_step` the trainer's train step built from abstract inputs only
* `memory_model` the analytic memory formulas (params, grads, optimizer, activations)
* `step_time`    the predicted step time on a GPU or TPU target: op by op (`op_costs` over
                 `fsdp_jax.hlo.costs`), held against published runs (`published`)
* `estimate`     analytic + compiled memory of a config, per strategy (`plan_config`)
* `one_strategy` one strategy built, analysed and AOT-compiled in this process
                 (`plan_strategy`); what the compiled step holds: `inspection`; a
                 compiler's refusal for memory: `refusal`
* `compile_child` many strategies on N devices, in a child process when this one lacks them
* `inputs`       the user's side in: flags parsed, checked against the config; start-up
* `flag_values`  the flag values that need no JAX (sizes, device counts), checked before it loads
* `report`       the user's side out: warnings, tables, the plot, the inspection
* `search`       the fastest configuration that fits: strategy x remat x microbatches x
                 offload (x batch, seq) (`search_space`), predicted (`search_prediction`),
                 pruned analytically (`search_analytic`), ranked and a few compiled in rounds
                 (`search_rounds`, `search_compile`), reported by `search_report` (plan.py --search)
* `benchmark`    the runners of `fsdp-jax benchmark` (the trainer's step timed on this machine)
"""
