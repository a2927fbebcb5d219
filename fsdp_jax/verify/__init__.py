"""Does my model train the same under every strategy? One call, before renting a cluster.

run      `verify`: the entry point, and the child process that has the devices
compare  the comparison itself: the steps on one device and under each strategy
report   the report, and the tolerances it is held against
"""

from fsdp_jax.verify.report import TOLERANCES, Divergence, StrategyReport, Tolerance, VerifyReport

__all__ = ["Divergence", "StrategyReport", "TOLERANCES", "Tolerance", "VerifyReport"]
