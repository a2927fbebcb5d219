"""The `precision:` text as data, no JAX: its fields, the dtype names and aliases it takes, and
`parse_fields`, which reads a precision string to dtype names with `Policy.parse`'s errors.
`fsdp_jax.sharding.precision.Policy` parses through it; the run config's checks read it before
JAX loads (`fsdp_jax.app.config.early_checks`).
"""

from __future__ import annotations

# what a precision string's `key=` may be -> the `Policy` field it sets
FIELDS = {
    "params": "param_dtype",
    "param": "param_dtype",
    "compute": "compute_dtype",
    "reduce": "reduce_dtype",
    "output": "output_dtype",
    "frozen": "frozen_dtype",
    "matmul": "matmul",
}
# what `matmul=` may name: the projections' matmuls in FP8 (fsdp_jax.quant.fp8), or as compute
MATMULS = ("fp8", "compute")
DTYPE_ALIASES = {
    "fp32": "float32",
    "f32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
}
DTYPES = ("float32", "bfloat16", "float16")
DEFAULTS = {"param_dtype": "float32", "compute_dtype": "float32", "reduce_dtype": "float32", "output_dtype": "float32"}


def dtype_name(name: str) -> str:
    """A dtype name or alias ("bf16") -> its name in `DTYPES`; ValueError listing them."""
    key = DTYPE_ALIASES.get(name.lower(), name.lower())
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)} (or {', '.join(DTYPE_ALIASES)})")
    return key


def matmul_name(value: str | None) -> str | None:
    """`matmul=`'s value -> "fp8", or None (compute, or unset); ValueError listing `MATMULS`."""
    if value is not None and str(value).lower() not in MATMULS:
        raise ValueError(f"unknown matmul {value!r}; choose one of {', '.join(MATMULS)}")
    return None if value is None or str(value).lower() == "compute" else str(value).lower()


def split_fields(spec: str) -> dict[str, str]:
    """``"params=float32,compute=bf16"`` -> {Policy field: the text given}; a bare dtype sets
    compute only; ValueError naming an unknown key. Values are not read here (`parse_fields`)."""
    kwargs = {}
    for part in filter(None, (p.strip() for p in str(spec).split(","))):
        if "=" not in part:
            kwargs["compute_dtype"] = part
            continue
        k, v = (x.strip() for x in part.split("=", 1))
        if k not in FIELDS:
            raise ValueError(
                f"precision: unknown field {k!r} in {spec!r}; use {', '.join(sorted(set(FIELDS) - {'param'}))}"
            )
        kwargs[FIELDS[k]] = v
    return kwargs


def parse_fields(spec: str) -> dict[str, str | None]:
    """Every `Policy` field of precision string `spec` as a name: the four dtypes (float32 unless
    given), `frozen_dtype` (None unless given) and `matmul` ("fp8" or None); ValueError as
    `Policy.parse` raises it, checked in the Policy's field order."""
    given = split_fields(spec)
    out: dict[str, str | None] = {**DEFAULTS, "frozen_dtype": None, "matmul": None, **given}
    for field in (*DEFAULTS, "frozen_dtype", "matmul"):
        v = out[field]
        if field == "matmul":
            out[field] = matmul_name(v)
        elif v is not None:
            out[field] = dtype_name(v)
    return out
