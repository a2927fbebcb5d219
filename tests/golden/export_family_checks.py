#!/usr/bin/env python
"""Family goldens, project side (no torch): import errors per strategy; exports for transformers.

    PYTHONPATH=$PWD python tests/golden/export_family_checks.py --import-errors [NAME ...]

prints, per golden and per strategy (8 CPU devices; fsdp_x_tensor = full_shard on
fsdp 4 x tensor 2, unscanned layers), the max abs difference of the imported model's
logits from transformers' (docs/hf_models.md records it). Then the export check,
project side first and the golden venv's `--check` on each directory:

    PYTHONPATH=$PWD python tests/golden/export_family_checks.py OUT [NAME ...]
    for d in OUT/*/; do n=$(basename $d)
        .venv-golden/bin/python tests/golden/make_hf_family_goldens.py --check $d OUT/$n.safetensors
    done

(the gpt-oss goldens, gpt_oss and gpt_oss_mxfp4, with make_hf_gpt_oss_goldens.py --check;
deepseek_v3 with make_hf_deepseek_goldens.py --check).

For every golden of make_hf_family_goldens.py this imports the checkpoint, adds
N(0, 1e-3) to every param (so the export carries values no stored golden has), saves
a run checkpoint with its config as the trainer does, exports it with
`export_hf` to OUT/NAME, and writes the project's logits of those params for the
golden tokens to OUT/NAME.safetensors (`tokens`, `logits`). `--check` then loads
OUT/NAME with `AutoModelForCausalLM.from_pretrained` and compares (docs/hf_models.md
records the output).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np

GOLDEN = Path(__file__).resolve().parent / "hf"
NAMES = (
    "llama3",
    "llama32_tied",
    "llama_yarn",
    "mistral_swa",
    "qwen2",
    "qwen3",
    "gemma3_text",
    "gpt_oss",
    "gpt_oss_mxfp4",
)


MESHES = {
    "full_shard": (1, 8, 1),
    "shard_grad_op": (1, 8, 1),
    "shard_opt": (1, 8, 1),
    "no_shard": (1, 8, 1),
    "hybrid_shard": (2, 4, 1),
    "fsdp_x_tensor": (1, 4, 2),
}


def import_errors(names: tuple[str, ...] = ()) -> int:
    import optax

    from fsdp_jax.app.hf import load as hf
    from fsdp_jax.app.models import Decoder
    from fsdp_jax.checkpoint.safetensors_io import SafetensorsFile
    from fsdp_jax.model.fns import from_nnx
    from fsdp_jax.sharding.mesh import make_mesh
    from fsdp_jax.train.build import build
    from fsdp_jax.train.step import sharding_context

    print("| golden | " + " | ".join(MESHES) + " |\n|---|" + "---:|" * len(MESHES))
    for name in names or ("llama_gqa", "llama_tied") + NAMES:
        f = SafetensorsFile(GOLDEN / f"{name}_logits.safetensors")
        tokens, want = f.read("tokens"), f.read("logits")
        row = []
        for strategy, shape in MESHES.items():
            scan = strategy != "fsdp_x_tensor"
            ckpt = hf.HFCheckpoint(GOLDEN / name, base=hf.DecoderConfig(scan_layers=scan))
            m = from_nnx(lambda r: Decoder(ckpt.config, rngs=r))
            built = build(
                m,
                optax.sgd(0.1),
                make_mesh(*shape),
                "full_shard" if strategy == "fsdp_x_tensor" else strategy,
                min_shard_size=0,
            )
            params = hf.load_params(ckpt, built.abstract_state.params)
            with sharding_context(built.plan):
                got = jax.jit(m.apply)(params, np.tile(tokens, (4, 1)))
            row.append(float(np.abs(np.asarray(got)[: len(tokens)] - want).max()))
        print(f"| {name} | " + " | ".join(f"{e:.2g}" for e in row) + " |", flush=True)
    return 0


def main(out: Path, names: tuple[str, ...] = NAMES) -> int:
    from fsdp_jax.app.config.parse import config_to_dict
    from fsdp_jax.app.hf import load as hf
    from fsdp_jax.app.hf.export import export_hf
    from fsdp_jax.app.models import Decoder
    from fsdp_jax.app.trainer.setup import load_run_config
    from fsdp_jax.checkpoint import Checkpointer
    from fsdp_jax.checkpoint.safetensors_io import SafetensorsFile, write_safetensors
    from fsdp_jax.model.fns import from_nnx

    out.mkdir(parents=True, exist_ok=False)
    for name in names:
        yml = out / f".{name}.yaml"
        yml.write_text(f"init_from: hf:{GOLDEN / name}\ndata: {{seq_len: 32, path: {out / '.d'}}}\n")
        cfg = load_run_config(yml)  # the model section from the checkpoint's config.json
        m = from_nnx(lambda r: Decoder(cfg.model, rngs=r))
        params = hf.load_params(hf.HFCheckpoint(GOLDEN / name, base=cfg.model), m.abstract_params)
        keys = iter(jax.random.split(jax.random.key(1), 64))
        params = jax.tree.map(lambda p: p + 1e-3 * jax.random.normal(next(keys), p.shape), params)
        with Checkpointer(out / f".{name}_ck") as ck:
            ck.save(1, {"params": params}, {"config": config_to_dict(cfg)})
        export_hf(out / f".{name}_ck", out / name)
        tokens = SafetensorsFile(GOLDEN / f"{name}_logits.safetensors").read("tokens")
        logits = np.asarray(jax.jit(m.apply)(params, tokens), np.float32)
        arrays = {"tokens": tokens, "logits": logits}
        write_safetensors(
            out / f"{name}.safetensors", [(k, a.shape, a.dtype) for k, a in arrays.items()], arrays.__getitem__
        )
        print(f"{out / name}: exported; project logits -> {out / name}.safetensors")
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    if sys.argv[1] == "--import-errors":
        jax.config.update("jax_num_cpu_devices", 8)
        sys.exit(import_errors(tuple(sys.argv[2:])))
    sys.exit(main(Path(sys.argv[1]), tuple(sys.argv[2:]) or NAMES))
