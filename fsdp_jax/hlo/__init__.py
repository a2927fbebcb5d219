"""Reading a compiled program: which collectives run, where, what overlaps them, and bytes.

schedule  collectives, their schedule and overlap (`collective_schedule`, `communication`)
calls     the call structure: computations, callers, loops and trip counts
groups    replica groups as lists of device ids
types     element types and bytes of an instruction's result
findings  problems a user can act on, one sentence each
memory    bytes per device, analytic (from shardings) and compiled (`memory_analysis`)
"""

from fsdp_jax.hlo import memory, schedule
from fsdp_jax.hlo.memory import compiled_memory, shard_bytes, tree_bytes_per_device
from fsdp_jax.hlo.schedule import COLLECTIVES, collective_schedule, communication

__all__ = [
    "COLLECTIVES",
    "collective_schedule",
    "communication",
    "compiled_memory",
    "memory",
    "schedule",
    "shard_bytes",
    "tree_bytes_per_device",
]
