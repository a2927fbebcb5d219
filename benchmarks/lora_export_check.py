"""Train LoRA on every family's golden (tests/golden/hf) from its peft-written adapter
(tests/golden/peft), export each run with --peft and --hf, and write the trained model's
logits on the golden tokens, for `peft` and `transformers` to check in the separate torch
venv (tests/golden/make_peft_goldens.py --check-peft, make_hf_family_goldens.py --check).

    python benchmarks/lora_export_check.py WORK_DIR [NAME ...]     # NAMEs: only these adapters
    while read n b; do
      VENV/bin/python tests/golden/make_peft_goldens.py --check-peft $b WORK_DIR/${n}_adapter WORK_DIR/${n}_ours.safetensors
      VENV/bin/python tests/golden/make_hf_family_goldens.py --check WORK_DIR/${n}_merged WORK_DIR/${n}_ours.safetensors
    done < WORK_DIR/list.txt
"""

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from fsdp_jax.app.cli import export  # noqa: E402
from fsdp_jax.app.hf import load, peft, peft_experts  # noqa: E402
from fsdp_jax.app.trainer.build import lora_spec, trainer_model  # noqa: E402
from fsdp_jax.app.trainer.loop import train  # noqa: E402
from fsdp_jax.app.trainer.setup import load_run_config  # noqa: E402
from fsdp_jax.checkpoint.safetensors_io import SafetensorsFile, write_safetensors  # noqa: E402
from helpers import TINY_RUN_OVERRIDES, synthetic_corpus  # noqa: E402

GOLDEN = ROOT / "tests" / "golden"
RUN = [o for o in TINY_RUN_OVERRIDES if not o.startswith("model.")] + ["train.steps=6", "remat=none"]


def main(work: Path, only: list[str]) -> None:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    corpus = synthetic_corpus(work / "corpus")
    lines = []
    for adapter in sorted(p for p in (GOLDEN / "peft").iterdir() if p.is_dir()):
        name, raw = adapter.name, json.loads((adapter / "adapter_config.json").read_text())
        if only and name not in only:
            continue
        base = Path(raw["base_model_name_or_path"]).name
        lora = [
            f"lora.rank={raw['r']}",
            f"lora.alpha={raw['lora_alpha']}",
            f"lora.rslora={str(raw['use_rslora']).lower()}",
        ]
        # weights a family's PEFT reaches as target_parameters (DeepSeek-V3's MLPs) are lora.targets here
        by_param = peft.parameter_targets(load.HFCheckpoint(GOLDEN / "hf" / base).config)
        params = [peft.full_parameter_name(p, by_param) for p in raw.get("target_parameters") or []]
        targets = raw["target_modules"] + [by_param[p] for p in params if p in by_param]
        lora += [f"lora.targets={','.join(targets)}", f"lora.init_from=peft:{adapter}"]
        lora += [f"lora.target_parameters={','.join([p for p in params if p not in by_param] or ['none'])}"]
        lora += [f"lora.gate_up_rank={peft_experts.pattern_rank(raw)}"]  # peft's rank_pattern (DeepSeek-V3's rewrite)
        over = RUN + lora + [f"data.path={corpus}", f"run_dir={work / name}", f"init_from=hf:{GOLDEN / 'hf' / base}"]
        cfg = load_run_config(ROOT / "configs" / "hf_tiny_finetune.yaml", over)
        params = jax.device_get(train(cfg, progress=False)["run"].state.params)
        assert export.main([str(work / name), "--peft", str(work / f"{name}_adapter")]) == 0
        assert export.main([str(work / name), "--hf", str(work / f"{name}_merged")]) == 0
        tokens = np.asarray(SafetensorsFile(GOLDEN / "peft" / f"{name}_logits.safetensors").read("tokens"))
        logits = np.asarray(jax.jit(trainer_model(cfg.model, "none", lora_spec(cfg)).apply)(params, tokens), np.float32)
        arrays = {"tokens": tokens, "logits": logits}
        write_safetensors(
            work / f"{name}_ours.safetensors", [(k, v.shape, v.dtype) for k, v in arrays.items()], arrays.get
        )
        lines.append(f"{name} {base}")
    (work / "list.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
