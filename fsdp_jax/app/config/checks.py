"""Checks of a built run config beyond each field's own limits: fields that depend on
each other, the device count, the JAX backend and the corpus on disk. Every failure
is a one-line ConfigError naming the dotted key, the value and what is allowed.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

from fsdp_jax.app import extras
from fsdp_jax.app.config.context_checks import check_context
from fsdp_jax.app.config.fp8_checks import check_fp8
from fsdp_jax.app.config.mtp_checks import check_mtp
from fsdp_jax.app.config.schema import Config, check_fields
from fsdp_jax.app.models import lora, lora_problems
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.models.moe import moe_config_problem
from fsdp_jax.app.models.qlora import quant_problem
from fsdp_jax.errors import ConfigError, MeshError
from fsdp_jax.nvme import NVME_OFFLOADS
from fsdp_jax.sharding import offload
from fsdp_jax.sharding.mesh import resolve_mesh_shape
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.sharding.remat import REMAT_POLICIES
from fsdp_jax.sharding.strategy import ALIASES, STRATEGIES

OFFLOADS = {**offload.OFFLOADS, **NVME_OFFLOADS}  # host memory, and local disks (fsdp_jax.nvme)


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, f"{value!r} is invalid; {allowed}")


def _check_decoder(m: DecoderConfig) -> None:
    """How the family switches of the decoder combine (docs/hf_models.md)."""
    _check(
        m.global_every == 0 or m.sliding_window > 0,
        "model.global_every",
        m.global_every,
        "a layer pattern needs model.sliding_window > 0",
    )
    _check(
        m.rope_local_theta == 0 or m.global_every > 0,
        "model.rope_local_theta",
        m.rope_local_theta,
        "only sliding layers of a pattern (model.global_every > 0) use it",
    )
    _check(
        m.rope_high_freq_factor > m.rope_low_freq_factor,
        "model.rope_high_freq_factor",
        m.rope_high_freq_factor,
        f"must be > model.rope_low_freq_factor={m.rope_low_freq_factor}",
    )
    if m.rope_type in ("llama3", "yarn"):
        _check(
            m.rope_original_max_len > 0,
            "model.rope_original_max_len",
            m.rope_original_max_len,
            f"rope_type {m.rope_type} needs the original context length (> 0)",
        )


def _check_moe(m: DecoderConfig) -> None:
    problem = moe_config_problem(m)
    if problem is not None:
        _check(False, f"model.{problem[0]}", problem[1], problem[2])


def validate(cfg: Config, n_devices: int | None = None) -> None:
    """Each field's limits (`config_schema.check_fields`), then the checks across fields,
    section by section in this order (the first failure is reported); with `n_devices`,
    also the mesh and batch divisibility."""
    check_fields(cfg)
    _check_heads(cfg.model)
    _check_decoder(cfg.model)
    _check_moe(cfg.model)
    _check_data_fields(cfg)
    _check_run_dir(cfg)
    _check_mesh(cfg)
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


def _check_heads(m: DecoderConfig) -> None:
    """Heads, kv heads and head dim agree with each other and with d_model."""
    _check(
        m.kv_channels > 0 or m.d_model % m.n_heads == 0,
        "model.d_model",
        m.d_model,
        f"must be divisible by model.n_heads={m.n_heads} (or set model.kv_channels)",
    )
    _check(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads", m.n_kv_heads, f"must divide model.n_heads={m.n_heads}")
    _check(m.kv_channels >= 0, "model.kv_channels", m.kv_channels, "must be >= 0 (0 = d_model/n_heads)")
    _check(
        m.head_dim % 2 == 0,
        "model.kv_channels" if m.kv_channels else "model.d_model",
        m.kv_channels or m.d_model,
        f"head dim {m.head_dim} must be even for RoPE",
    )


def _check_data_fields(cfg: Config) -> None:
    """The sequence fits the model's context; data.path names a directory."""
    data, m = cfg.data, cfg.model
    _check(data.seq_len <= m.max_seq_len, "data.seq_len", data.seq_len, f"must be <= model.max_seq_len={m.max_seq_len}")
    _check(bool(data.path.strip()), "data.path", data.path, "must be a directory path")


def _check_run_dir(cfg: Config) -> None:
    """run_dir names a directory (an empty one would be the current directory)."""
    _check(
        bool(cfg.run_dir.strip()),
        "run_dir",
        cfg.run_dir,
        "must be a directory path (not empty: the run would write into the current directory)",
    )


def _check_mesh(cfg: Config) -> None:
    """At most one mesh size is -1 (the rest of the devices); the strategy exists."""
    mesh = cfg.mesh
    sizes = (mesh.data, mesh.fsdp, mesh.context, mesh.tensor)
    _check(
        sizes.count(-1) <= 1,
        "mesh",
        dict(zip(("data", "fsdp", "context", "tensor"), sizes)),
        "at most one of data, fsdp, context, tensor may be -1",
    )
    _check(
        mesh.strategy.lower() in STRATEGIES or mesh.strategy.lower() in ALIASES,
        "mesh.strategy",
        mesh.strategy,
        f"allowed: {', '.join(STRATEGIES)} (aliases: {', '.join(ALIASES)})",
    )


def _check_memory_policies(cfg: Config) -> None:
    """remat and offload name policies of the library's tables."""
    _check(cfg.remat in REMAT_POLICIES, "remat", cfg.remat, f"allowed: {', '.join(REMAT_POLICIES)}")
    _check(cfg.offload in OFFLOADS, "offload", cfg.offload, f"allowed: {', '.join(OFFLOADS)}")
    _check(  # the streamed update slices leaves per layer: adafactor's factored moments span layers
        not (OFFLOADS[cfg.offload].stream and cfg.optimizer.name == "adafactor"),
        "offload",
        cfg.offload,
        "a streamed offload needs an elementwise optimizer (adamw, sgd), not optimizer.name=adafactor; "
        "use offload: " + cfg.offload.split(":")[0],
    )
    _check(  # without a layer stack there is nothing to stream: the update would run whole, silently
        not (OFFLOADS[cfg.offload].stream and not cfg.model.scan_layers),
        "offload",
        cfg.offload,
        "a streamed offload updates a stack of scanned layers one layer at a time, and model.scan_layers=false "
        "leaves none; set model.scan_layers=true or use offload: " + cfg.offload.split(":")[0],
    )

    u, off = cfg.model.bias_update_speed, OFFLOADS[cfg.offload]
    _check(  # the bias rule (`expert_bias`) runs on the jitted step's params, from the router's loads
        not (u and (off.stream or cfg.offload in NVME_OFFLOADS or cfg.objective == "grpo")),
        "model.bias_update_speed",
        u,
        f"the bias rule needs the jitted step's own update (no streamed or nvme offload) and the router's "
        f"loads (not objective grpo); got offload {cfg.offload}, objective {cfg.objective} (use 0)",
    )


def _check_distributed(cfg: Config) -> None:
    """This process's id is below the process count; the coordinator is HOST:PORT."""
    dist = cfg.distributed
    _check(
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
    _check(
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
        _check(last <= tr.steps, "train.profile", tr.profile, f"END must be <= train.steps={tr.steps}")
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "logging.wandb",
            "true, but the wandb package is not installed; pip install wandb, or set logging.wandb=false",
        )
    _check(
        tr.global_batch % tr.microbatches == 0,
        "train.global_batch",
        tr.global_batch,
        f"must be divisible by train.microbatches={tr.microbatches}",
    )
    if tr.tensorboard:
        _check(
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
        _check(lo.init_from is None, "lora.init_from", lo.init_from, "needs lora.rank > 0 (a PEFT adapter's r)")
        _check(
            lo.base_quant == "none", "lora.base_quant", lo.base_quant, "quantises LoRA's frozen base: set lora.rank > 0"
        )
        return
    if lo.base_quant == "nf4":
        _check(lo.quant_block % 2 == 0, "lora.quant_block", lo.quant_block, "must be even (two codes per byte)")
    spec = lora.spec_from_config(lo)
    bad = lora_problems.target_problem(cfg.model, spec) or ("lora.targets", "")
    _check(not bad[1], bad[0], getattr(lo, bad[0].split(".")[1]), bad[1])
    _check((drop := lora_problems.expert_dropout(cfg.model, spec)) is None, "lora.dropout", lo.dropout, str(drop))
    problem = quant_problem(cfg.model, spec)
    _check(problem is None, "lora.base_quant", lo.base_quant, str(problem))
    most = lora.max_rank(cfg.model, spec.targets, spec.experts)
    _check(lo.rank <= most, "lora.rank", lo.rank, f"must be <= {most}, the smallest target's smaller dim")
    if lo.init_from is not None:
        _check(lo.init_from.startswith("peft:"), "lora.init_from", lo.init_from, "use peft:DIR (a PEFT adapter)")


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
    _check(
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
    _check(
        set(axes) <= {"data", "fsdp"} or set(axes) == {"tensor"},
        "mesh.rules.expert",
        entry,
        "must be data, fsdp or [data, fsdp] (experts over batch axes, tokens moved by all-to-all) "
        "or tensor; not context, nor tensor mixed with a batch axis",
    )
    size = math.prod(sizes[a] for a in axes)
    _check(
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
    _check(
        bool(sep) and 1 <= first <= last,
        "train.profile",
        text,
        "must be START:END, steps with 1 <= START <= END (e.g. 2:4)",
    )
    return first, last


def check_coordinator(address: str, key: str) -> None:
    """`address` is host:port with a port in 1..65535 (IPv6 as [addr]:port)."""
    host, sep, port = address.rpartition(":")
    _check(
        bool(sep and host.strip("[]") and port.isdigit() and 0 < int(port) < 65536),
        key,
        address,
        "must be HOST:PORT with a port in 1..65535, e.g. 127.0.0.1:1234",
    )


def check_backend(cfg: Config, backend: str) -> None:
    """Settings that need a particular JAX backend ("cpu", "gpu", "tpu")."""
    _check(
        cfg.model.attention != "cudnn" or backend == "gpu",
        "model.attention",
        cfg.model.attention,
        f"needs a CUDA GPU (cuDNN); this run's JAX backend is {backend}: use model.attention=xla",
    )
    _check(
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
            _check(
                cfg.data.seq_len == m.get("row_len"),
                "data.seq_len",
                cfg.data.seq_len,
                f"must equal the packed corpus' row length {m.get('row_len')} in {meta}",
            )
        elif cfg.data.document_mask:
            _check(
                isinstance(m.get("eos_id"), int) and m["eos_id"] >= 0,
                "data.document_mask",
                True,
                f"needs a corpus with an EOS token ending each document; {meta} has none (prepare it with --tokenizer)",
            )
        _check(
            vocab <= cfg.model.vocab_size,
            "model.vocab_size",
            cfg.model.vocab_size,
            f"must be >= the corpus vocab_size {vocab} in {meta}{by}",
        )
