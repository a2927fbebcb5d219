"""Will it fit, and how fast? The planner, in one package.

One meaning of "plan" across the project: a *plan* is the sharding plan the library
computes once per model (`fsdp_jax.train.build`, `fsdp_jax.sharding.rules`). This package does not make
plans; it *fits* a config to hardware — per-device memory, analytic and compiled, and
the predicted step time — and reports it:

* `step_build`   the trainer's train step built from abstract inputs only
* `memory_model` the analytic memory formulas (params, grads, optimizer, activations)
* `step_time`    the predicted step time on a GPU or TPU target: op by op (`op_costs` over
                 `fsdp_jax.hlo.costs`), held against published runs (`published`)
* `estimate`     analytic + compiled memory of a config, per strategy (`plan_config`)
* `one_strategy` one strategy built, analysed and AOT-compiled in this process
                 (`plan_strategy`); what the compiled step holds: `inspection`; a
                 compiler's refusal for memory: `refusal`
* `compile_child` many strategies on N devices, in a child process when this one lacks them
* `inputs`       the user's side in: flags parsed, checked against the config; start-up
* `report`       the user's side out: warnings, tables, the plot, the inspection
                 (re-exports `inputs`' names)
* `search`       the fastest configuration that fits: strategy x remat x microbatches x
                 offload (x batch, seq) (`search_space`), predicted (`search_prediction`),
                 pruned analytically (`search_analytic`), ranked and a few compiled in rounds
                 (`search_rounds`, `search_compile`), reported by `search_report` (plan.py --search)

The old module paths (`fsdp_jax.app.planner`, `plan_report`, `memory_model`, `step_time`,
`step_build`) stay importable: `fsdp_jax.app` maps them onto these modules.
"""
