"""The layer-wise step of `optimizer+params:nvme` against the scanned step: equal? (issue 61)

`fsdp_jax.nvme.layerwise.LayerwiseStep` (params, optimizer state and grads in layer files; the
embedding, each layer forward and its vjp in reverse, and the head as their own jitted programs;
the grad norm, the rest's update and the per-layer update from the files) against the project's
`build(...).train_step` (full_shard, the scanned layers, no offload) from the same init, on
N CPU devices with the same param shardings and batch layout (`sharding_context` of the plan),
float32, no remat, one microbatch, AdamW: per step the loss and grad norm, after the steps
every param and optimizer-state leaf (bits equal, or its largest relative difference). Before
the last step the layer-wise state is gathered whole and put back into the files, as a restore
from a checkpoint would.
`--nan-step`: then one step of each with a NaN in the embedding: both skip it, and the layer
files are left as they were.

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/nvme_layerwise_step.py [--devices 8] [--clip 1.0] [--nan-step] [--json out.json]

Run on XLA:CPU's default emitters (no `--xla_cpu_use_fusion_emitters` in XLA_FLAGS), or with no
FMA (`--xla_cpu_max_isa=AVX`, tests/test_nvme.py `parity_env`), to compare with
tests/test_nvme_layerwise.py, which runs this in a child.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import optax


def _differ(a_tree, b_tree) -> dict:
    out = {}
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(a_tree)[0], jax.tree.leaves(b_tree)):
        a, b = np.asarray(a), np.asarray(b)
        if not np.array_equal(a, b, equal_nan=True):
            out[jax.tree_util.keystr(path)] = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), 1e-30))
    return out


def _batches(n: int, batch: int, seq: int, vocab: int, seed: int = 1):
    """Learnable rows: start + stride * position (mod vocab), as tests/helpers.token_batches."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        start, stride = rng.integers(0, vocab, (batch, 1)), rng.integers(1, 4, (batch, 1))
        out.append(jax.numpy.asarray((start + stride * np.arange(seq + 1)) % vocab, jax.numpy.int32))
    return out


def compare(devices: int, clip: float | None, layers: int = 2, steps: int = 3, nan_step: bool = False) -> dict:
    import fsdp_jax as fj
    from fsdp_jax.app.models import Decoder, DecoderConfig, cross_entropy
    from fsdp_jax.app.models.layer_pieces import decoder_pieces, split_params
    from fsdp_jax.model.fns import from_nnx
    from fsdp_jax.nvme.layerwise import LayerwiseStep
    from fsdp_jax.train.build import build
    from fsdp_jax.train.step import sharding_context

    # tests/test_offload.CFG with `layers` layers
    cfg = DecoderConfig(vocab_size=64, d_model=32, n_layers=layers, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=16)
    m = from_nnx(lambda r: Decoder(cfg, rngs=r, remat="none"))

    def loss_fn(params, tokens):
        return cross_entropy(m.apply(params, tokens[:, :-1]), tokens[:, 1:])

    opt = optax.adamw(1e-3, weight_decay=0.1)
    mesh = fj.make_mesh(fsdp=devices, devices=jax.devices()[:devices])
    b = build(m, opt, mesh, "full_shard", loss_fn=loss_fn, clip_norm=clip)
    state = b.init_state(jax.random.key(0))
    params = split_params(jax.tree.map(lambda x: x.copy(), state.params))
    batches = _batches(steps, 8, 16, cfg.vocab_size)
    ref = []
    for x in batches:
        state, mt = b.train_step(state, x)
        ref.append([float(mt["loss"]), float(mt["grad_norm"])])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    with tempfile.TemporaryDirectory() as d, sharding_context(b.plan):
        lw = LayerwiseStep(decoder_pieces(m, cfg), opt, abstract, [d], "bench", clip, batch_sharding=b.plan.batch)
        live, got = lw.put(params, opt.init(params)), []
        for k, x in enumerate(batches):
            if k == len(batches) - 1:  # as a restore would: the whole state gathered, the files rewritten from it
                live = lw.put(*lw.gather(live))
            live, mt = lw.train_step(live, x)
            got.append([float(mt["loss"]), float(mt["grad_norm"])])
        new_params, new_state = lw.gather(live)
        out = {
            "devices": devices,
            "clip": clip,
            "ref": ref,
            "got": got,
            "params": _differ(split_params(state.params), new_params),
            "state": _differ(state.opt_state, new_state),
            "leaves": len(jax.tree.leaves(new_params)),
            "files": sorted(p.name for p in Path(d).iterdir()),
        }
        out["nan_step"] = _skipped_step(b, state, lw, live, batches[0]) if nan_step else None
        lw.close()
    return out


def _skipped_step(b, state, lw, live, batch) -> dict:
    """One more step of each with a NaN in the embedding (the loss non-finite): both skip, and
    the layer files' params and state are left as they were (bits, NaN equal to NaN)."""
    nan = jax.numpy.float32(np.nan)
    state = state.replace(params={**state.params, "embed": state.params["embed"].at[0, 0].set(nan)})
    live = {**live, "rest": {**live["rest"], "embed": live["rest"]["embed"].at[0, 0].set(nan)}}
    before = lw.gather(live)
    state, ref = b.train_step(state, batch)
    live, got = lw.train_step(live, batch)
    after = lw.gather(live)
    return {"skipped": [int(ref["skipped"]), int(got["skipped"])], "changed": _differ(before, after)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--clip", type=float, default=None)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--nan-step", action="store_true", help="then one step with a NaN in the embedding: skipped?")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", max(a.devices, 1))
    r = compare(a.devices, a.clip, a.layers, a.steps, a.nan_step)
    text = json.dumps(r)
    if a.json:
        a.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
