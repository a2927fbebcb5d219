"""What a command does once its flags have parsed: one module per command, named as the
command (`run/train.py` is `fsdp-jax train`'s body).

The command's own module (`fsdp_jax.app.cli.<command>`) holds its parser and `main`, and
imports nothing heavy; it names its body here as `"fsdp_jax.app.cli.run.<command>:run"`, which
`run_command` imports only after the flags have parsed. So `--help` and a bad flag print their
line before JAX and Flax load (~0.2 s of CPU, not ~3.3 s). Commands whose parser and body are
both light (plot, launch) keep the body in their own module.
"""
