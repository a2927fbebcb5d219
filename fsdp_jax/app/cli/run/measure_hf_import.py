"""`fsdp-jax measure-hf-import` once its flags have parsed (they and its description: fsdp_jax.app.cli.measure_hf_import)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import optax

from fsdp_jax.app.hf.load import HFCheckpoint, expected_tensors, leaf_sources, load_params
from fsdp_jax.app.models import families, lora
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.models.lora import LoraSpec
from fsdp_jax.app.trainer.build import trainer_model
from fsdp_jax.app.trainer.qlora_load import load_quantised, plain_abstract
from fsdp_jax.checkpoint import tree_paths
from fsdp_jax.checkpoint.safetensors_io import write_safetensors
from fsdp_jax.quant.weight import QuantSpec
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.train.build import build


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Peak:
    """Highest VmRSS seen while the block runs (2 ms sampling)."""

    def __enter__(self):
        self.peak, self._stop = rss(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())


def write_checkpoint(d: Path, args) -> int:

    base = families.families()[0]  # the reference family (the registry's first)
    cfg = DecoderConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.d_model // 64,
        n_kv_heads=max(1, args.d_model // 256),
        ffn_dim=int(args.d_model * 8 / 3) // 64 * 64,
        max_seq_len=256,
    )
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": [base.architectures[0]],
                "model_type": base.model_type,
                "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model,
                "num_hidden_layers": cfg.n_layers,
                "num_attention_heads": cfg.n_heads,
                "num_key_value_heads": cfg.n_kv_heads,
                "intermediate_size": cfg.ffn_dim,
                "max_position_embeddings": 256,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "hidden_act": "silu",
                "tie_word_embeddings": False,
            }
        )
    )
    rng = np.random.default_rng(0)
    shapes = list(expected_tensors(cfg).items())
    files, weight_map, total = [[]], {}, 0
    for name, shape in shapes:  # ~4 shards
        if (
            files[-1]
            and sum(int(np.prod(s)) for _, s in files[-1]) * 2 > sum(int(np.prod(s)) for _, s in shapes) * 2 / 4
        ):
            files.append([])
        files[-1].append((name, shape))
    for i, group in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        total += write_safetensors(
            d / fname,
            [(n, s, np.dtype(ml_dtypes.bfloat16)) for n, s in group],
            lambda n: rng.standard_normal(dict(shapes)[n], np.float32).astype(ml_dtypes.bfloat16),
        )
        weight_map.update({n: fname for n, _ in group})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total


def measure(path: str, mode: str, quant: str = "none", scan: bool = True) -> dict:

    jax.config.update("jax_num_cpu_devices", 8)

    ckpt = HFCheckpoint(path, base=DecoderConfig(scan_layers=scan))
    naive = mode == "naive"
    spec = None if quant == "none" else LoraSpec(16, 32.0, base_quant=QuantSpec(quant, 64, quant == "nf4"))
    m = trainer_model(ckpt.config, "none", spec)
    built = build(m, optax.sgd(0.1), make_mesh(1, 8, 1), "full_shard")
    abstract = built.abstract_state.params if spec is None else lora.split(built.abstract_state.params)[0]
    params_bytes = sum(
        int(np.prod(x.shape)) * 4
        for x in jax.tree.leaves(plain_abstract(abstract, spec.base_quant if spec else QuantSpec("int8")))
    )
    loaded_bytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(abstract))
    before, hwm_before = rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with Peak() as p:
        if spec is not None:
            stream = ckpt if mode == "streamed" else None
            params = load_quantised(lambda a: load_params(ckpt, a), abstract, spec.base_quant, int(scan), stream)
        elif naive:  # the whole model as host arrays first, then placed
            want = tree_paths(abstract)
            full = [
                ckpt.read(
                    names,
                    kind,
                    tuple(slice(0, n) for n in want[k].shape),
                    tuple(want[k].shape),
                    np.float32,
                    k.startswith("blocks/"),
                )
                for k, (names, kind) in ((k, leaf_sources(ckpt.config)[k]) for k in want)
            ]
            params = jax.device_put(
                jax.tree.unflatten(jax.tree.structure(abstract), full), jax.tree.map(lambda x: x.sharding, abstract)
            )
        else:
            params = load_params(ckpt, abstract)
        jax.block_until_ready(params)
    after = rss()
    hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = max(p.peak, hwm if hwm > hwm_before else 0)
    return {
        "naive": naive,
        "mode": mode,
        "scan_layers": scan,
        "stored_bytes": ckpt.nbytes(),
        "params_bytes_f32": params_bytes,
        "loaded_bytes": loaded_bytes,
        "rss_before": before,
        "rss_after": after,
        "rss_peak": peak,
        "peak_increase": peak - before,
    }


def run(args) -> int:
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], args.base_quant, not args.unscanned)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp), args)
        rows = []
        for mode in ("sharded", "naive") if args.base_quant == "none" else ("streamed", "whole"):
            r = subprocess.run(
                [sys.executable, "-m", "fsdp_jax.app.cli", "measure-hf-import", "--child", tmp, mode]
                + ["--base-quant", args.base_quant]
                + (["--unscanned"] if args.unscanned else []),
                capture_output=True,
                text=True,
                env=dict(os.environ, JAX_PLATFORMS="cpu"),
            )
            if r.returncode:
                print(r.stderr[-2000:], file=sys.stderr)
                return 1
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    mib = 2**20
    print(
        f"checkpoint: {rows[0]['stored_bytes'] / mib:.1f} MiB bf16 -> "
        f"{rows[0]['loaded_bytes'] / mib:.1f} MiB params over 8 CPU devices ({args.base_quant} base)"
    )
    print(f"{'import':<9}{'RSS before':>12}{'peak':>10}{'peak - before':>15}{'/ params':>10}{'/ stored':>10}")
    for r in rows:
        inc = r["rss_peak"] - r["rss_before"]
        print(
            f"{r['mode']:<9}{r['rss_before'] / mib:>10.1f}M"
            f"{r['rss_peak'] / mib:>9.1f}M{inc / mib:>13.1f}M{inc / r['loaded_bytes']:>10.2f}"
            f"{inc / r['stored_bytes']:>10.2f}"
        )
    return 0
