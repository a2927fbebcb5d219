"""bitsandbytes' NF4, blockwise 8-bit and int8 quantisation of small tensors, for
`fsdp_jax.quant` to equal bit for bit (tests/test_qlora_codes.py).

Run in the golden venv (tests/golden/README.md) with bitsandbytes 0.50 (its CPU backend):

    .venv-golden/bin/pip install torch==2.13.0 bitsandbytes numpy
    .venv-golden/bin/python tests/golden/make_nf4_goldens.py

Writes tests/golden/quant/bnb.npz: for each case `<name>/x` (the input as float32, or its
bits as uint16 for bf16 / fp16, with `<name>/dtype`), `quantize_4bit` (nf4, block 64) with
and without `compress_statistics` (packed codes, absmax; nested: the absmax codes, their
absmax (block 256), the offset), `dequantize_4bit` of both (float32, small cases), `quantize_blockwise`
(dynamic map, block 256 and 64: the CPU C++ kernel's and, `_portable`, the
torch backend's that every other device falls back to) and `int8_vectorwise_quant` (row codes, row absmax); plus
`dynamic_map` (create_dynamic_map()) and `nf4_code`.
"""

from __future__ import annotations

from pathlib import Path

import bitsandbytes as bnb
import bitsandbytes.functional as F
import numpy as np
import torch

OUT = Path(__file__).parent / "quant" / "bnb.npz"
PORTABLE = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)  # the "default" kernels
DYN = F.create_dynamic_map()

CASES = {  # name: (shape, dtype, scale)
    "f32_2d": ((32, 128), torch.float32, 0.02),
    "f32_odd": ((3, 77), torch.float32, 1.0),  # a partial last block, an odd count
    "bf16_2d": ((16, 256), torch.bfloat16, 0.05),
    "f16_2d": ((16, 192), torch.float16, 0.3),
    "bf16_many": ((160, 128), torch.bfloat16, 2.0),  # 320 absmax: two blocks of double quantisation
    "f32_zero_block": ((4, 128), torch.float32, 1.0),  # one block all zero
}


def _x(shape, dtype, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float32) * scale
    x[0, :3] = torch.tensor([scale * 3.5, -scale * 4.0, 0.0])  # outliers and an exact zero
    if shape == (4, 128):
        x[1, :64] = 0.0
    return x.to(dtype)


def _np(t: torch.Tensor) -> np.ndarray:
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def main() -> None:
    out: dict[str, np.ndarray] = {
        "dynamic_map": F.create_dynamic_map().numpy(),
        "nf4_code": F.get_4bit_type("nf4", device="cpu").numpy(),
    }
    for seed, (name, (shape, dtype, scale)) in enumerate(CASES.items()):
        x = _x(shape, dtype, scale, seed)
        out[f"{name}/x"] = _np(x)
        out[f"{name}/dtype"] = np.array(str(dtype).removeprefix("torch."))
        q, st = F.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=False)
        out[f"{name}/nf4_codes"] = q.numpy().reshape(-1)
        out[f"{name}/nf4_absmax"] = st.absmax.numpy()
        if x.numel() <= 4096:
            out[f"{name}/nf4_dequant"] = F.dequantize_4bit(q, st).float().numpy()
        q2, st2 = F.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=True)
        out[f"{name}/dq_codes"] = q2.numpy().reshape(-1)
        out[f"{name}/dq_absmax_codes"] = st2.absmax.numpy()
        out[f"{name}/dq_absmax2"] = st2.state2.absmax.numpy()
        out[f"{name}/dq_offset"] = np.asarray(st2.offset.numpy(), np.float32)
        if x.numel() <= 4096:
            out[f"{name}/dq_dequant"] = F.dequantize_4bit(q2, st2).float().numpy()
        xf = x.float()
        for bs in (256, 64):
            c, s = F.quantize_blockwise(xf, blocksize=bs)  # the CPU backend: its C++ kernel
            out[f"{name}/bw{bs}_codes"] = c.numpy()
            out[f"{name}/bw{bs}_absmax"] = s.absmax.numpy()
            c, a = torch.ops.bitsandbytes.quantize_blockwise.default.redispatch(PORTABLE, xf, DYN, bs)
            out[f"{name}/bw{bs}_portable_codes"] = c.numpy()  # its portable (torch) backend
            out[f"{name}/bw{bs}_portable_absmax"] = a.numpy()
        ci, rs, _ = torch.ops.bitsandbytes.int8_vectorwise_quant.default(x.reshape(-1, shape[-1]).clone())
        out[f"{name}/int8_codes"] = ci.numpy()
        out[f"{name}/int8_absmax"] = rs.numpy()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes) with bitsandbytes {bnb.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
