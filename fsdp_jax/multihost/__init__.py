"""Multi-process jobs: start-up with `jax.distributed`, the coordination service, peer watch.

distributed   initialise from the launcher's or the cluster's environment (SLURM, ...)
coordination  JAX's coordination service in a small process of its own, beside process 0
peer_watch    stop the survivors in one line when a peer stops responding
"""
