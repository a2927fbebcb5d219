"""The reference trainer: a run config in, a trained run directory out.

setup       config -> `Run`, as named stages (validate, data, model, mesh, build, state)
build       the trainer's model and loss, and the one `build(...)` from a run config
optim       optimizer and schedule from the config
lora_state  a LoRA run's base + adapters, adapter-only checkpoints and the base's fingerprint
loop        `train`: setup, a short loop, hooks (hooks: log, eval, checkpoint, sample, ...)
measures    what the eval and sample hooks measure, by objective (sft, preference, grpo)
metrics     metrics.jsonl (+ TensorBoard, W&B) and samples; plot: their plots
timing      where the wall time goes; preemption: SIGTERM at a step boundary
run_dir     checks before anything is written, one writer at a time
faults      fault injection for tests
"""
