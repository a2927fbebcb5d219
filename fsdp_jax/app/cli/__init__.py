"""The command line: `fsdp-jax <command>` (installed by `[project.scripts]`) and the
`scripts/*.py` shims over the same commands.

    flags     the one parser (`Parser`: errors are one line, exit code 2) and number types
    args      argument groups the commands share (config + overrides, target + hosts, devices)
    command   `run_command`: the one main wrapper (parse, run, map errors to exit codes)
    entry     the `fsdp-jax` dispatcher and the table of commands
    <command> one module per command (train, plan, inspect, verify, ...), each with
              `build_parser(prog)` and `main(argv, prog)`
    run       each command's body (`run/<command>.py`), imported once its flags have parsed

Which errors are bad input (exit 2) or the environment's (exit 1) is `fsdp_jax.app.exits`, and
a command's CPU devices and compilation cache are `fsdp_jax.app.devices`: the planner's and
verify's child processes use both, and they sit below the commands. This package imports
nothing heavy before a command's flags have parsed: `--help` and a refused flag answer before
JAX loads.
"""
