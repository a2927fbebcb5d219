"""`python -m fsdp_jax.app.cli COMMAND ...`: the `fsdp-jax` command without installing it."""

import sys

from fsdp_jax.app.cli.entry import main

sys.exit(main())
