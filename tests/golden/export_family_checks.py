#!/usr/bin/env python
"""Export each family golden, fine-tuned by a little float32 noise, for transformers to check.

Project side (no torch), then the golden venv's `--check` on each directory:

    PYTHONPATH=$PWD python tests/golden/export_family_checks.py OUT
    for d in OUT/*/; do n=$(basename $d)
        /work/venv-golden/bin/python tests/golden/make_hf_family_goldens.py --check $d OUT/$n.safetensors
    done

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
NAMES = ("llama3", "llama32_tied", "llama_yarn", "mistral_swa", "qwen2", "qwen3", "gemma3_text")


def main(out: Path) -> int:
    from fsdp_jax.adapters import from_nnx
    from fsdp_jax.app import hf
    from fsdp_jax.app.config import config_to_dict, load_config
    from fsdp_jax.app.hf_export import export_hf
    from fsdp_jax.app.models import Llama
    from fsdp_jax.checkpoint import Checkpointer
    from fsdp_jax.safetensors_io import SafetensorsFile, write_safetensors

    out.mkdir(parents=True, exist_ok=False)
    for name in NAMES:
        yml = out / f".{name}.yaml"
        yml.write_text(f"init_from: hf:{GOLDEN / name}\ndata: {{seq_len: 32, path: {out / '.d'}}}\n")
        cfg = load_config(yml)
        m = from_nnx(lambda r: Llama(cfg.model, rngs=r))
        params = hf.load_params(hf.HFCheckpoint(GOLDEN / name, base=cfg.model), m.abstract_params)
        keys = iter(jax.random.split(jax.random.key(1), 64))
        params = jax.tree.map(lambda p: p + 1e-3 * jax.random.normal(next(keys), p.shape), params)
        with Checkpointer(out / f".{name}_ck") as ck:
            ck.save(1, {"params": params}, {"config": config_to_dict(cfg)})
        export_hf(out / f".{name}_ck", out / name)
        tokens = SafetensorsFile(GOLDEN / f"{name}_logits.safetensors").read("tokens")
        logits = np.asarray(jax.jit(m.apply)(params, tokens), np.float32)
        arrays = {"tokens": tokens, "logits": logits}
        write_safetensors(out / f"{name}.safetensors", [(k, a.shape, a.dtype) for k, a in arrays.items()],
                          arrays.__getitem__)
        print(f"{out / name}: exported; project logits -> {out / name}.safetensors")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
