"""Dropless expert parallelism over `jax.lax.ragged_all_to_all` (`model.expert_exchange:
ragged`, `models/moe_exchange.exchange_dropless_ragged`). XLA:CPU cannot run the collective
("HLO opcode `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter", jax 0.10.2), so:
- on CPU the offsets and sizes are checked by training with the collective replaced by an
  emulation written from its documented semantics (all-gathers and a masked gather): the
  same losses and params as the dense exchange, experts over fsdp on 8 devices;
- the real collective is compiled for 8 x H100 (deviceless): the step has ragged-all-to-alls
  and no dense all-to-all of the (n_ep x N k, D) row blocks;
- on CPU the option is refused in one line naming `model.expert_exchange`."""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_moe_ep import _cfg, _train, _worst_leaf

from fsdp_jax.errors import ConfigError
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.sharding.rule_table import DEFAULT_RULES
from helpers import json_child

EP_FSDP = {**DEFAULT_RULES, "expert": "fsdp"}


def _emulated(x, out, in_off, send, out_off, recv, axes):
    """`ragged_all_to_all` from its docstring: sender i's rows in_off_i[j] .. + send_i[j] land
    in receiver j's `out` from row out_off_i[j]."""
    del recv  # implied by the senders' sizes
    me = jax.lax.axis_index(axes)
    xs, ins, sends, outs = (jax.lax.all_gather(a, axes) for a in (x, in_off, send, out_off))  # (n_ep, ...)
    rows = jnp.arange(out.shape[0])
    for i in range(xs.shape[0]):
        start, size = outs[i, me], sends[i, me]
        hit = (rows >= start) & (rows < start + size)
        src = jnp.clip(ins[i, me] + rows - start, 0, x.shape[0] - 1)
        out = jnp.where(hit.reshape(-1, *([1] * (out.ndim - 1))), xs[i][src], out)
    return out


@pytest.mark.slow
def test_ragged_exchange_trains_as_the_dense_exchange_with_the_collective_emulated(monkeypatch):
    import fsdp_jax.app.models.moe as moe_lib
    import fsdp_jax.app.models.moe_exchange as exchange

    monkeypatch.setattr(exchange, "_ragged", _emulated)
    monkeypatch.setattr(moe_lib, "lowering_platform", lambda: "gpu")  # past the CPU refusal
    cfg = _cfg()
    ref, _, p_ref, _ = _train(cfg, make_mesh(1, 8, 1), "full_shard", EP_FSDP)
    got, _, params, _ = _train(
        dataclasses.replace(cfg, expert_exchange="ragged"), make_mesh(1, 8, 1), "full_shard", EP_FSDP
    )
    assert np.abs(got / ref - 1).max() <= 1e-6, (got, ref)
    assert _worst_leaf(params, p_ref) <= 1e-6


def test_ragged_exchange_is_refused_on_cpu():
    with pytest.raises(ConfigError, match=r"^model\.expert_exchange: ragged: XLA:CPU has no ragged-all-to-all"):
        _train(_cfg(expert_exchange="ragged"), make_mesh(1, 8, 1), "full_shard", EP_FSDP, steps=1)


_GPU_CHILD = r"""
import json, re, sys
sys.path.insert(0, "tests")
import jax, jax.numpy as jnp
from test_moe_ep import _cfg, _built
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.sharding.rules import DEFAULT_RULES
from fsdp_jax.targets import gpu as targets

devices = targets.gpu_devices("h100", 1, 8)
out = {}
for exchange in ("dense", "ragged"):
    built = _built(_cfg(expert_exchange=exchange, grouped_matmul="xla"), make_mesh(1, 8, 1, devices=devices),
                   "full_shard", {**DEFAULT_RULES, "expert": "fsdp"})
    batch = jax.ShapeDtypeStruct((8, 17), jnp.int32, sharding=built.plan.batch)
    with jax.default_device(devices[0]):
        text = built.train_step.lower(built.abstract_state, batch).compile().as_text()
    ops = [re.match(r"\s*(?:ROOT )?%\S+ = (.*?) ((?:ragged-)?all-to-all(?:-start)?)\(", l) for l in text.splitlines()]
    out[exchange] = [[m[2], m[1]] for m in ops if m]
# dropless experts through tokamax's kernels inside the dispatch's shard_map: lowered only (the
# Pallas call leaves its result's manual-axis type unset, which a checking shard_map refused), bf16
# compute (tokamax 0.0.17's only GPU kernel without jax_triton, Mosaic GPU, takes no f32): Triton
# calls (tokamax 0.0.12: its Mosaic GPU kernel refuses these dims) or Mosaic GPU ones (0.0.17)
import optax
from fsdp_jax.app.models import Decoder
from fsdp_jax.app.trainer.build import make_loss_fn
from fsdp_jax.model.fns import from_nnx
from fsdp_jax.train.build import build
cfg = _cfg(grouped_matmul="tokamax")
m = from_nnx(lambda r: Decoder(cfg, rngs=r))
built = build(m, optax.sgd(0.5), make_mesh(1, 8, 1, devices=devices), "full_shard", loss_fn=make_loss_fn(m, cfg),
              has_aux=True, rules={**DEFAULT_RULES, "expert": "fsdp"}, min_shard_size=0,
              precision="params=float32,compute=bfloat16")
with jax.default_device(devices[0]):
    lowered = built.train_step.lower(built.abstract_state, batch).as_text()
out["tokamax_triton_calls"] = lowered.count("__gpu$xla.gpu.triton") + lowered.count("@mosaic_gpu")
print(json.dumps(out))
"""


@pytest.mark.slow
def test_ragged_exchange_compiles_to_ragged_all_to_all_for_h100():
    from fsdp_jax.targets import gpu as targets

    assert targets.plugin_installed(), "CUDA plugin missing: python -m fsdp_jax.targets install cuda"
    r = json_child(_GPU_CHILD, env=targets.child_env(dict(os.environ)))
    blocks = re.compile(r"f32\[8,32,32\]")  # the dense exchange's (n_ep, N k, D) row blocks
    assert any(blocks.search(t) for op, t in r["dense"] if op.startswith("all-to-all")), r["dense"]
    assert not any(op.startswith("ragged") for op, _ in r["dense"])
    ragged = [t for op, t in r["ragged"] if op.startswith("ragged-all-to-all")]
    # ids and rows there (into 256-row receive buffers), rows back (the N k = 32 local rows); the
    # backward's two: rows' cotangents back and forth. Each one's result (an async start prints
    # its operands first: jax 0.10 starts all five, jax 0.12 three of them)
    results = sorted(re.sub(r"\{[^{}]*\}", "", t).rsplit(", ", 1)[-1].rstrip(")") for t in ragged)
    assert results == ["f32[256,32]"] * 2 + ["f32[32,32]"] * 2 + ["s32[256]"], r["ragged"]
    assert not any(blocks.search(t) for op, t in r["ragged"] if op.startswith("all-to-all")), r["ragged"]
    # gate, up, down forward; dx and dw of each backward (tokamax's kernels, not XLA's dense ragged_dot)
    assert r["tokamax_triton_calls"] >= 9, r["tokamax_triton_calls"]
