"""The application on top of the library: the reference trainer and its tools.

Config (`config`), data pipeline (`data`), reference model (`models`), optimizer
from config (`optim`), the training loop (`loop`), metrics and sampling
(`metrics_log`, `metrics_plot`), preemption signals (`preemption`), every command
(`cli`: `fsdp-jax` and the scripts/ shims), the planner / inspector front ends
(`planner`, `plan_report`) over the trainer's abstract step (`step_build`) and its memory formulas (`memory_model`), real
tokenizers (`tokenizer`) and Hugging Face Llama checkpoints in (`hf`) and out
(`hf_export`), over the library's sliced safetensors I/O (`fsdp_jax.safetensors_io`).

The library (`fsdp_jax.*` outside this package) never imports from here.
"""
