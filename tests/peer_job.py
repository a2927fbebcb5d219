"""One process of a small jax.distributed job for tests/test_peer_watch.py: joins through
fsdp_jax.multihost.distributed.maybe_initialize (the FSDP_JAX_* variables) with a peer watch, then
runs cross-process sums forever; the process named by PEER_JOB_VICTIM kills itself with
SIGKILL after PEER_JOB_STEPS sums, once every other process has finished that sum too (a
ring all-reduce can end on one process before another has its last chunk; the survivors mark
it in the coordination store) (PEER_JOB_VICTIM=-1: every process stops normally after
that many sums and calls finished(), process 0 after PEER_JOB_TAIL_S seconds more of
work alone). Prints `step N` after each sum."""

import os
import signal
import sys

import numpy as np


def main() -> int:
    import jax
    import jax.numpy as jnp
    from jax._src import distributed as jax_distributed
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from fsdp_jax.multihost.distributed import await_peer_verdict, finished, maybe_initialize

    jax.config.update("jax_num_cpu_devices", 2)
    maybe_initialize(timeout_s=60, peer_timeout_s=float(os.environ["PEER_JOB_TIMEOUT_S"]), peer_note="test note")
    victim, steps = int(os.environ["PEER_JOB_VICTIM"]), int(os.environ["PEER_JOB_STEPS"])
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    total = jax.jit(jnp.sum)
    n = jax.device_count()
    step = 0
    while True:
        x = jax.make_array_from_callback((n,), sharding, lambda idx: np.arange(n, dtype=np.float32)[idx])
        try:  # gloo may raise "connection reset by peer" rather than wait: as scripts/train.py
            got = float(total(x))
        except Exception as e:
            await_peer_verdict()
            print(f"error: {' '.join(str(e).split())[:300]}", file=sys.stderr, flush=True)
            return 1
        assert got == n * (n - 1) / 2
        step += 1
        print(f"step {step}", flush=True)
        if step == steps:
            client = jax_distributed.global_state.client
            if victim >= 0 and victim != jax.process_index():
                client.key_value_set(f"peer_job/reached/{jax.process_index()}", "1")
            if victim == jax.process_index():
                for i in range(jax.process_count()):
                    if i != victim:
                        client.blocking_key_value_get(f"peer_job/reached/{i}", 60_000)
                os.kill(os.getpid(), signal.SIGKILL)
            if victim < 0:
                if jax.process_index() == 0:  # work on alone, the watch still on
                    import time

                    time.sleep(float(os.environ.get("PEER_JOB_TAIL_S", "0")))
                finished()
                return 0


if __name__ == "__main__":
    sys.exit(main())
