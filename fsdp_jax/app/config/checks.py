"""Checks of a built run config beyond each field's own limits: fields that depend on
each other, the device count, the JAX backend and the corpus on disk. Every failure
is a one-line ConfigError naming the dotted key, the value and what is allowed.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

from fsdp_jax.app import extras
from fsdp_jax.app.config.context_checks import check_context
from fsdp_jax.app.config.early_checks import check, check_before_jax
from fsdp_jax.app.config.fp8_checks import check_fp8
from fsdp_jax.app.config.mtp_checks import check_mtp
from fsdp_jax.app.config.schema import Config, check_fields
from fsdp_jax.app.models import lora, lora_problems
from fsdp_jax.app.models.qlora import quant_problem
from fsdp_jax.errors import ConfigError, MeshError
from fsdp_jax.nvme import NVME_OFFLOADS
from fsdp_jax.sharding import offload
from fsdp_jax.sharding.mesh import resolve_mesh_shape
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.sharding.remat import REMAT_POLICIES

OFFLOADS = {**offload.OFFLOADS, **NVME_OFFLOADS}  # host memory, and local disks (fsdp_jax.nvme)


def validate(cfg: Config, n_devices: int | None = None) -> None:
    """Each field's limits (`config_schema.check_fields`), then the checks across fields,
    section by section in this order (the first failure is reported); with `n_devices`,
    also the mesh and batch divisibility."""
    check_fields(cfg)
    check_before_jax(cfg)  # heads, decoder, MoE, data fields, run_dir, mesh: no JAX (`early_checks`)
    _check_memory_policies(cfg)
    _check_distributed(cfg)
    _check_precision(cfg)
    _check_train(cfg)
    _check_lora(cfg)
    check_mtp(cfg)
    check_fp8(cfg)
    if n_devices is not None:
        _check_devices(cfg, n_devices)
    _check_attention_precision(cfg)


def _check_memory_policies(cfg: Config) -> None:
    """remat and offload name policies of the library's tables."""
    check(cfg.remat in REMAT_POLICIES, "remat", cfg.remat, f"allowed: {', '.join(REMAT_POLICIES)}")
    check(cfg.offload in OFFLOADS, "offload", cfg.offload, f"allowed: {', '.join(OFFLOADS)}")
    check(  # the streamed update slices leaves per layer: adafactor's factored moments span layers
        not (OFFLOADS[cfg.offload].stream and cfg.optimizer.name == "adafactor"),
        "offload",
        cfg.offload,
        "a streamed offload needs an elementwise optimizer (adamw, sgd), not optimizer.name=adafactor; "
        "use offload: " + cfg.offload.split(":")[0],
    )
    check(  # without a layer stack there is nothing to stream: the update would run whole, silently
        not (OFFLOADS[cfg.offload].stream and not cfg.model.scan_layers),
        "offload",
        cfg.offload,
        "a streamed offload updates a stack of scanned layers one layer at a time, and model.scan_layers=false "
        "leaves none; set model.scan_layers=true or use offload: " + cfg.offload.split(":")[0],
    )

    u, off = cfg.model.bias_update_speed, OFFLOADS[cfg.offload]
    check(  # the bias rule (`expert_bias`) runs on the jitted step's params, from the router's loads
        not (u and (off.stream or cfg.offload in NVME_OFFLOADS or cfg.objective == "grpo")),
        "model.bias_update_speed",
        u,
        f"the bias rule needs the jitted step's own update (no streamed or nvme offload) and the router's "
        f"loads (not objective grpo); got offload {cfg.offload}, objective {cfg.objective} (use 0)",
    )


def _check_distributed(cfg: Config) -> None:
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


def _check_precision(cfg: Config) -> None:
    """precision parses as a `fsdp_jax.sharding.precision.Policy`."""
    try:
        Policy.parse(cfg.precision)
    except (ValueError, TypeError) as e:
        raise ConfigError(
            "precision", f"{cfg.precision!r} is invalid; {e} (e.g. params=float32,compute=bfloat16)"
        ) from None


def _check_attention_precision(cfg: Config) -> None:
    """cuDNN attention computes in bfloat16 or float16 only (its flash kernels have no float32
    one: jax raises NotImplementedError while tracing, on a GPU and in the planner's compile
    alike). Checked last."""
    compute = Policy.parse(cfg.precision).compute_dtype.name
    check(
        cfg.model.attention != "cudnn" or compute in ("bfloat16", "float16"),
        "model.attention",
        cfg.model.attention,
        f"needs bfloat16 or float16 compute (cuDNN's flash attention has no {compute} kernel) and precision "
        f"computes in {compute}: set precision=params=float32,compute=bfloat16, or use model.attention=xla",
    )


def _check_train(cfg: Config) -> None:
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


def _check_lora(cfg: Config) -> None:
    """The `lora:` section against the decoder: targets that exist, a rank they allow."""
    lo = cfg.lora
    for key, resolve in (("targets", lora.resolve_targets), ("target_parameters", lora.resolve_experts)):
        try:
            resolve(getattr(lo, key))
        except ValueError as e:
            raise ConfigError(f"lora.{key}", str(e)) from None
    if not lo.rank:
        check(lo.init_from is None, "lora.init_from", lo.init_from, "needs lora.rank > 0 (a PEFT adapter's r)")
        check(
            lo.base_quant == "none", "lora.base_quant", lo.base_quant, "quantises LoRA's frozen base: set lora.rank > 0"
        )
        return
    if lo.base_quant == "nf4":
        check(lo.quant_block % 2 == 0, "lora.quant_block", lo.quant_block, "must be even (two codes per byte)")
    spec = lora.spec_from_config(lo)
    bad = lora_problems.target_problem(cfg.model, spec) or ("lora.targets", "")
    check(not bad[1], bad[0], getattr(lo, bad[0].split(".")[1]), bad[1])
    check((drop := lora_problems.expert_dropout(cfg.model, spec)) is None, "lora.dropout", lo.dropout, str(drop))
    problem = quant_problem(cfg.model, spec)
    check(problem is None, "lora.base_quant", lo.base_quant, str(problem))
    most = lora.max_rank(cfg.model, spec.targets, spec.experts)
    check(lo.rank <= most, "lora.rank", lo.rank, f"must be <= {most}, the smallest target's smaller dim")
    if lo.init_from is not None:
        check(lo.init_from.startswith("peft:"), "lora.init_from", lo.init_from, "use peft:DIR (a PEFT adapter)")


def _check_devices(cfg: Config, n_devices: int) -> None:
    """The mesh resolves on `n_devices` and each microbatch splits over data*fsdp."""
    tr, mesh = cfg.train, cfg.mesh
    try:
        data_n, fsdp_n, context_n, tensor_n = resolve_mesh_shape(
            (mesh.data, mesh.fsdp, mesh.context, mesh.tensor), n_devices
        )
    except MeshError as e:
        raise ConfigError("mesh", str(e)) from None
    check_context(cfg, context_n)
    check_experts(cfg, {"data": data_n, "fsdp": fsdp_n, "context": context_n, "tensor": tensor_n})
    micro = tr.global_batch // tr.microbatches
    check(
        micro % (data_n * fsdp_n) == 0,
        "train.global_batch",
        tr.global_batch,
        f"global_batch / microbatches = {micro} must be divisible by the batch-sharding "
        f"devices data*fsdp = {data_n}*{fsdp_n} = {data_n * fsdp_n} on {n_devices} devices",
    )


def check_experts(cfg: Config, sizes: dict[str, int]) -> None:
    """Expert parallelism (`mesh.rules.expert`): over batch axes (`data`, `fsdp` or both:
    tokens moved by all-to-all; an `fsdp` expert dim is never gathered for compute) or
    `tensor` (tokens replicated over it), not a mix of the two, never `context`; n_experts
    divides the size."""
    entry = cfg.mesh.rules.get("expert")
    axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
    if not cfg.model.n_experts or not axes:
        return
    check(
        set(axes) <= {"data", "fsdp"} or set(axes) == {"tensor"},
        "mesh.rules.expert",
        entry,
        "must be data, fsdp or [data, fsdp] (experts over batch axes, tokens moved by all-to-all) "
        "or tensor; not context, nor tensor mixed with a batch axis",
    )
    size = math.prod(sizes[a] for a in axes)
    check(
        cfg.model.n_experts % size == 0,
        "model.n_experts",
        cfg.model.n_experts,
        f"must be divisible by the expert mesh axes {', '.join(axes)} (mesh.rules.expert; size {size})",
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


def check_backend(cfg: Config, backend: str) -> None:
    """Settings that need a particular JAX backend ("cpu", "gpu", "tpu")."""
    check(
        cfg.model.attention != "cudnn" or backend == "gpu",
        "model.attention",
        cfg.model.attention,
        f"needs a CUDA GPU (cuDNN); this run's JAX backend is {backend}: use model.attention=xla",
    )
    check(
        cfg.model.attention != "splash" or backend == "tpu",
        "model.attention",
        cfg.model.attention,
        f"needs a TPU (Pallas splash kernel); this run's JAX backend is {backend}: use model.attention=xla",
    )


def check_data(cfg: Config) -> None:
    """The corpus at data.path exists (train.bin) and its vocabulary fits model.vocab_size."""
    path = Path(cfg.data.path)
    if not (path / "train.bin").is_file():
        how = (
            "run scripts/prepare.py --out DIR, or set data.source=stdlib"
            if cfg.data.source == "none"
            else "prepare it with scripts/prepare.py"
        )
        raise ConfigError("data.path", f"{str(path)!r}: train.bin not found; {how}")
    meta = path / "meta.json"
    if meta.is_file():
        try:
            m = json.loads(meta.read_text())
            vocab = int(m["vocab_size"])
        except (ValueError, KeyError, TypeError):
            raise ConfigError("data.path", f"{str(meta)!r} is not a valid meta.json") from None
        tok = m.get("tokenizer")
        by = f" (tokenizer {tok})" if tok not in (None, "bytes", "external") else ""
        if m.get("format") == "packed":  # fine-tuning rows (fsdp_jax.app.data.sft): fixed length
            check(
                cfg.data.seq_len == m.get("row_len"),
                "data.seq_len",
                cfg.data.seq_len,
                f"must equal the packed corpus' row length {m.get('row_len')} in {meta}",
            )
        elif cfg.data.document_mask:
            check(
                isinstance(m.get("eos_id"), int) and m["eos_id"] >= 0,
                "data.document_mask",
                True,
                f"needs a corpus with an EOS token ending each document; {meta} has none (prepare it with --tokenizer)",
            )
        check(
            vocab <= cfg.model.vocab_size,
            "model.vocab_size",
            cfg.model.vocab_size,
            f"must be >= the corpus vocab_size {vocab} in {meta}{by}",
        )
