"""The application on top of the library: the reference trainer and its tools.

    cli/      every command (`fsdp-jax <command>`, and the scripts/ shims)
    planner/  will it fit, and how fast: memory model, step-time model, search, report
    trainer/  setup stages, the short loop, hooks, metrics, preemption, run directory
    hf/       Hugging Face checkpoints in (`load`, `config_in`) and out (`export`, `config_out`)
    data/     token corpora, tokenizers, chat / instruction examples, packing, batches
    config/   the run config: schema, YAML + overrides, checks across fields
    models/   the one configurable decoder (Llama, Mistral, Qwen, Gemma families by config)
    exits, devices, extras   what every command's process shares: exit codes, CPU devices,
                             optional features

Imports point down that list; the library (`fsdp_jax.*` outside this package) never imports
from here (`tests/test_layering.py` checks both).
"""
