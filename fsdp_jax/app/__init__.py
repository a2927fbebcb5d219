"""The application on top of the library: the reference trainer and its tools.

Config (`config`), data pipeline (`data`), reference model (`models`), optimizer
from config (`optim`), the training loop (`loop`), metrics and sampling
(`metrics_log`), preemption signals (`preemption`), the command-line conventions
(`cli`) and the planner / inspector front ends (`planner`, `plan_report`).

The library (`fsdp_jax.*` outside this package) never imports from here.
"""
