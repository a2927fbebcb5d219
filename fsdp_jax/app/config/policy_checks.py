"""The run config's policies checked across fields without JAX, in `checks.validate`'s order after
`early_checks`' model, data and mesh checks: remat and offload (names from the library's JAX-free
tables), the distributed fields, precision, the train fields, FP8 (`precision: ...,matmul=fp8`,
the `fp8:` section, docs/fp8.md) and cuDNN attention's compute dtype. The CLI runs them before
JAX loads (`early_checks.check_before_jax`). Every failure is a one-line ConfigError naming the
dotted key, the value and what is allowed.
"""

from __future__ import annotations

import importlib.util

from fsdp_jax.app import extras
from fsdp_jax.app.config.schema import Config
from fsdp_jax.errors import ConfigError
from fsdp_jax.sharding.offload_settings import ALL_OFFLOADS, NVME_OFFLOADS
from fsdp_jax.sharding.precision_names import parse_fields
from fsdp_jax.sharding.remat_names import remat_names
from fsdp_jax.sharding.strategy_names import ALIASES

GATHERING = ("full_shard", "hybrid_shard")  # strategies that gather params per layer (`fp8.gather` applies)


def check(ok: bool, key: str, value, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, f"{value!r} is invalid; {allowed}")


def check_policies(cfg: Config) -> None:
    """remat / offload, distributed, precision, then train (the first failure is raised)."""
    check_memory_policies(cfg)
    check_distributed(cfg)
    check_precision(cfg)
    check_train(cfg)


def check_memory_policies(cfg: Config) -> None:
    """remat and offload name policies of the library's tables."""
    names = remat_names()
    check(cfg.remat in names, "remat", cfg.remat, f"allowed: {', '.join(names)}")
    check(cfg.offload in ALL_OFFLOADS, "offload", cfg.offload, f"allowed: {', '.join(ALL_OFFLOADS)}")
    off = ALL_OFFLOADS[cfg.offload]
    check(  # the streamed update slices leaves per layer: adafactor's factored moments span layers
        not (off.stream and cfg.optimizer.name == "adafactor"),
        "offload",
        cfg.offload,
        "a streamed offload needs an elementwise optimizer (adamw, sgd), not optimizer.name=adafactor; "
        "use offload: " + cfg.offload.split(":")[0],
    )
    check(  # without a layer stack there is nothing to stream: the update would run whole, silently
        not (off.stream and not cfg.model.scan_layers),
        "offload",
        cfg.offload,
        "a streamed offload updates a stack of scanned layers one layer at a time, and model.scan_layers=false "
        "leaves none; set model.scan_layers=true or use offload: " + cfg.offload.split(":")[0],
    )
    u = cfg.model.bias_update_speed
    check(  # the bias rule (`expert_bias`) runs on the jitted step's params, from the router's loads
        not (u and (off.stream or cfg.offload in NVME_OFFLOADS or cfg.objective == "grpo")),
        "model.bias_update_speed",
        u,
        f"the bias rule needs the jitted step's own update (no streamed or nvme offload) and the router's "
        f"loads (not objective grpo); got offload {cfg.offload}, objective {cfg.objective} (use 0)",
    )


def check_distributed(cfg: Config) -> None:
    """This process's id is below the process count; the coordinator is HOST:PORT."""
    dist = cfg.distributed
    check(
        dist.process_id is None or 0 <= dist.process_id < (dist.num_processes or 1),
        "distributed.process_id",
        dist.process_id,
        "must be in [0, num_processes)",
    )
    if dist.coordinator is not None:
        check_coordinator(dist.coordinator, "distributed.coordinator")


def check_precision(cfg: Config) -> None:
    """precision parses as a `fsdp_jax.sharding.precision.Policy` (`precision_names.parse_fields`)."""
    try:
        parse_fields(cfg.precision)
    except (ValueError, TypeError) as e:
        raise ConfigError(
            "precision", f"{cfg.precision!r} is invalid; {e} (e.g. params=float32,compute=bfloat16)"
        ) from None


def check_attention_precision(cfg: Config) -> None:
    """cuDNN attention computes in bfloat16 or float16 only (its flash kernels have no float32
    one: jax raises NotImplementedError while tracing, on a GPU and in the planner's compile
    alike)."""
    compute = parse_fields(cfg.precision)["compute_dtype"]
    check(
        cfg.model.attention != "cudnn" or compute in ("bfloat16", "float16"),
        "model.attention",
        cfg.model.attention,
        f"needs bfloat16 or float16 compute (cuDNN's flash attention has no {compute} kernel) and precision "
        f"computes in {compute}: set precision=params=float32,compute=bfloat16, or use model.attention=xla",
    )


def check_train(cfg: Config) -> None:
    """The profile window lies within the run, microbatches divide the batch, and the
    packages the logging options need are installed."""
    tr = cfg.train
    if tr.profile is not None:
        _, last = parse_profile(tr.profile)
        check(last <= tr.steps, "train.profile", tr.profile, f"END must be <= train.steps={tr.steps}")
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "logging.wandb",
            "true, but the wandb package is not installed; pip install wandb, or set logging.wandb=false",
        )
    check(
        tr.global_batch % tr.microbatches == 0,
        "train.global_batch",
        tr.global_batch,
        f"must be divisible by train.microbatches={tr.microbatches}",
    )
    if tr.tensorboard:
        check(
            extras.available("tensorboardX"),
            "train.tensorboard",
            tr.tensorboard,
            extras.missing_message("tensorboardX", "train.tensorboard=true") + ", or set it to false",
        )


def check_fp8(cfg: Config) -> None:
    """matmul=fp8 trains a whole model with the next-token loss (not LoRA, not a preference loss)."""
    if parse_fields(cfg.precision)["matmul"] != "fp8":
        return
    if cfg.lora.rank != 0:
        raise ConfigError(
            "lora.rank", f"{cfg.lora.rank!r} is invalid; must be 0 with precision matmul=fp8 (FP8 trains whole models)"
        )
    if cfg.objective != "sft":
        raise ConfigError("objective", f"{cfg.objective!r} is invalid; must be sft with precision matmul=fp8")
    check_fp8_gather(cfg)


def check_fp8_gather(cfg: Config) -> None:
    """`fp8.gather: true` only where weights are cast before a per-layer gather: full_shard /
    hybrid_shard; under the rowwise recipe, a model with routed experts (the dense projections
    cast after the gather; the experts cast each shard along the dim each GEMM contracts,
    `fp8_rowwise_experts`). Left unset (null) it applies wherever it can."""
    if cfg.fp8.gather is not True:
        return
    strategy = ALIASES.get(cfg.mesh.strategy.lower(), cfg.mesh.strategy.lower())
    if strategy not in GATHERING:
        raise ConfigError(
            "fp8.gather",
            f"true is invalid with mesh.strategy={cfg.mesh.strategy}: only {' / '.join(GATHERING)} gather "
            "weights per layer (leave it unset or false)",
        )
    if cfg.fp8.recipe == "rowwise" and not cfg.model.n_experts:
        raise ConfigError(
            "fp8.gather",
            "true is invalid with fp8.recipe=rowwise and no routed experts: the projections' scales are per row "
            "and column of each GEMM, cast after the gather (leave it unset or false)",
        )


def parse_profile(text: str) -> tuple[int, int]:
    """`train.profile` "START:END" -> (START, END): steps, 1-based, 1 <= START <= END."""
    head, sep, tail = str(text).partition(":")
    try:
        first, last = int(head), int(tail)
    except ValueError:
        first = last = 0
    check(
        bool(sep) and 1 <= first <= last,
        "train.profile",
        text,
        "must be START:END, steps with 1 <= START <= END (e.g. 2:4)",
    )
    return first, last


def check_coordinator(address: str, key: str) -> None:
    """`address` is host:port with a port in 1..65535 (IPv6 as [addr]:port)."""
    host, sep, port = address.rpartition(":")
    check(
        bool(sep and host.strip("[]") and port.isdigit() and 0 < int(port) < 65536),
        key,
        address,
        "must be HOST:PORT with a port in 1..65535, e.g. 127.0.0.1:1234",
    )
