"""Checks of a built run config beyond each field's own limits: fields that depend on
each other, the device count, the JAX backend and the corpus on disk. Every failure
is a one-line ConfigError naming the dotted key, the value and what is allowed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from fsdp_jax.app.config.context_checks import check_context
from fsdp_jax.app.config.early_checks import check_before_jax
from fsdp_jax.app.config.policy_checks import check
from fsdp_jax.app.config.schema import Config, check_fields
from fsdp_jax.app.models import lora, lora_problems
from fsdp_jax.app.models.qlora import quant_problem
from fsdp_jax.errors import ConfigError, MeshError
from fsdp_jax.sharding.mesh import resolve_mesh_shape


def validate(cfg: Config, n_devices: int | None = None) -> None:
    """Each field's limits (`config_schema.check_fields`), then the checks across fields,
    section by section in this order (the first failure is reported): those that need no JAX
    (`early_checks.check_before_jax`: heads, decoder, MoE, data fields, run_dir, mesh, remat,
    offload, distributed, precision, train, MTP, FP8, cuDNN attention's compute dtype), LoRA
    against the decoder; with `n_devices`, also the mesh and batch divisibility."""
    check_fields(cfg)
    check_before_jax(cfg)
    _check_lora(cfg)
    if n_devices is not None:
        _check_devices(cfg, n_devices)


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
