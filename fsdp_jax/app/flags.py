"""Moved to `fsdp_jax.app.cli.flags` (the command-line package); this name stays so that
older imports keep working."""

from fsdp_jax.app.cli.flags import Parser, UsageError, int_in, real_in  # noqa: F401
