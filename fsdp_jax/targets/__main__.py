"""`python -m fsdp_jax.targets install [cuda|tpu|all]`: the compile-only plugins (`fsdp_jax.targets.gpu.main`)."""

import sys

from fsdp_jax.targets.gpu import main

sys.exit(main())
