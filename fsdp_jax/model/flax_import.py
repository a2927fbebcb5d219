"""Flax imported without IPython when the process does not run in IPython.

`flax.nnx` asks at import time whether it runs inside IPython (`reprlib.supports_color`,
`summary.in_ipython`) by importing IPython and calling `get_ipython()`. Where IPython is installed
but not running, that import costs 0.3-0.4 s CPU per process (2.6 -> 2.3 s for `import flax.nnx`
here; BENCHMARKS.md "Issue 55 item 6"), paid by every command and every test's child process, and
the answer is "no". Outside IPython (nothing has imported it yet), flax is imported here with
IPython hidden, which gives flax that same answer; inside IPython (it is in `sys.modules`),
nothing changes. Imported first by `fsdp_jax.model`, before anything in the package imports flax.
"""

import sys

if "IPython" not in sys.modules and "flax.nnx" not in sys.modules:
    sys.modules["IPython"] = None  # `import IPython` raises ImportError while this is set
    try:
        import flax.nnx  # noqa: F401
    finally:
        del sys.modules["IPython"]
