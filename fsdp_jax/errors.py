"""Every error type the project raises, in one place, and how a command reports it.

Two kinds, and a command's exit code follows the kind (`fsdp_jax.app.cli`):

- **bad input** (a `ValueError`): a config key, flag, environment variable, file,
  checkpoint or tokenizer the user can fix. One line naming the problem; exit code 2.
- **the environment** (a `RuntimeError` or `OSError`): a full disk, a dead peer, a
  run directory another trainer holds. One line; exit code 1.

Each message is one line that names what is wrong (`one_line` makes any exception's
message fit that). Every exception and warning class of the project is defined here
(`tests/test_layering.py` holds it) and imported from here; the public faces re-export the
ones their users catch (`fsdp_jax.MeshError`, `fsdp_jax.checkpoint.CheckpointError`, ...).
The application's errors live here too (the library raises none of them); this module
imports nothing from the project.
"""

from __future__ import annotations


def one_line(e: BaseException, limit: int | None = 240) -> str:
    """An exception's message on one line of at most `limit` characters (None: all of
    it; its type name when it has no message)."""
    msg = " ".join(str(e).split()) or type(e).__name__
    return msg if limit is None or len(msg) <= limit else msg[:limit] + "..."


# ----------------------------------------------------------------------- library: bad input


class MeshError(ValueError):
    """Mesh sizes that cannot be laid over the available devices."""


class ShardingError(ValueError):
    """A leaf or tree that cannot be sharded as asked; the message names the fix."""


class BatchError(ValueError):
    """A batch whose leading dim cannot be split over the devices / microbatches."""


class StateError(ValueError):
    """The model's state is misused: a loss that does not return the updated state, a
    state whose structure or shapes change, a collection nobody declared. One line."""


class OffloadError(ValueError):
    """An offload setting this backend or jax cannot run (or an unknown name)."""


class VerifyError(ValueError):
    """Bad input to `verify`: unknown strategy, a batch that cannot split over the
    devices, a model that does not initialise, a loss that fails, too few devices."""


class TargetError(ValueError):
    """Bad target input (unknown name, topology that does not divide) or a missing plugin
    (`MissingExtra`)."""


class MissingExtra(TargetError, ImportError):
    """An optional install is missing: a feature's optional package (`fsdp_jax[plot]`,
    pyarrow, ...) or the compile-only CUDA plugin / libtpu for this jax. The message says
    how to install it. An `ImportError` (a missing package) and a `TargetError` (a target
    compile without its plugin), as the two classes it replaces were."""


class TopologyError(ValueError):
    """A TPU generation, accelerator type or topology that does not exist."""


class XlaFlagsError(ValueError):
    """XLA_FLAGS holds an entry this jaxlib's XLA does not know (bad input): XLA would
    abort the process with a fatal log when its backend starts."""


class SafetensorsError(ValueError):
    """A file that is not valid safetensors, or a tensor it does not hold. The message
    is one line naming the file."""


class ShardFileError(ValueError):
    """A shard file that does not match its index (missing, resized or changed)."""


class CheckpointError(ValueError):
    """No usable checkpoint, a damaged one, or one that does not fit the model.
    The message is one line naming the directory, step and problem."""


# --------------------------------------------------------------------- library: environment


class CheckpointWriteError(RuntimeError):
    """A save failed in the environment (disk full, permissions, I/O error). The message
    is one line naming the step, the cause and the newest committed step, which is
    intact: fix the cause and run the same command again to resume from it."""


class CompileRefused(RuntimeError):
    """A deviceless compile the target's compiler refused before (kept by
    fsdp_jax.targets.compile_cache): its message, e.g. XLA:TPU's HBM refusal."""


class DistributedInitError(RuntimeError):
    """Joining the other processes failed (a dead or unreachable peer, a timeout): an
    environment failure. The message is one line."""


# --------------------------------------------------------------------------- library: warnings


class UnknownNamesWarning(UserWarning):
    """Logical names the rules table does not map: those dims get no mesh axis."""


class ReplicatedWarning(UserWarning):
    """More than the allowed fraction of parameter bytes is replicated, but so few
    bytes that replicating them costs no memory worth refusing the run for."""


# ------------------------------------------------------------------ application (fsdp_jax.app)


class UsageError(ValueError):
    """Flags that parse one by one but not together (`--bin` without `--val-bin`): a
    command's body raises it before any work; `run_command` prints `error: <message>`,
    as the parser does, and returns exit code 2."""


class ConfigError(ValueError):
    """A bad config value; `key` is the dotted key (or file) the message names."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


class DataError(ValueError):
    """Bad corpus input or a missing/incomplete corpus; the message is one line."""


class TokenizerError(ValueError):
    """A tokenizer that cannot be found or loaded, or lacks an EOS token (one line)."""


class ExampleError(ValueError):
    """A bad example or template; the message is one line naming file and line."""


class PlanError(ValueError):
    """Bad planner input (device count, memory size, strategy list)."""


class SearchError(PlanError):
    """Bad search input: an empty search space or an impossible constraint (exit code 2)."""


class TrainingDiverged(RuntimeError):
    """`train.max_nonfinite_steps` skipped steps in a row; the checkpoints are intact."""


class RunDirBusy(RuntimeError):
    """Another live trainer holds the run directory (an environment failure: exit 1)."""


class RewardError(ValueError):
    """A reward function that cannot be used: a missing module or function, or one that
    returns the wrong number of values (bad input, exit code 2); the message names it."""


class RewardFailed(RuntimeError):
    """A reward function raised, returned NaN or did not return in time (exit code 1, after
    the trainer saved its state); the message names it."""
