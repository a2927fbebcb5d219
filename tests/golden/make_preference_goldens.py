#!/usr/bin/env python
"""Regenerate tests/golden/preference/: what TRL's own preference losses compute on one batch.

Needs torch + transformers + trl (+ accelerate), which the project never installs; use the
golden venv (tests/golden/README.md):

    .venv-golden/bin/python tests/golden/make_preference_goldens.py          # preference/goldens.json
    .venv-golden/bin/python tests/golden/make_preference_goldens.py --data   # preference/data_goldens.json

Models: the tiny random `llama3` and `qwen3` checkpoints of tests/golden/hf (float32). The
policy is the checkpoint; the reference is the same checkpoint with every weight times
`REF_SCALE` (an elementwise map, so the JAX side builds the same reference exactly from the
imported params). One batch of `PAIRS` (prompt, chosen, rejected) token-id triples is
collated by TRL's `DataCollatorForPreference` (right padding, `max_length` keep_start
truncation: the third pair is cut), then:

- dpo / ipo / hinge (and dpo with label smoothing, as TRL < 1.0 / CPOTrainer's `sigmoid`
  define it when TRL 1.x's `sigmoid` has none): `DPOTrainer._compute_loss` on that batch,
  the trainer's logged metrics read back from `_metrics["train"]`;
- simpo: `CPOTrainer.get_batch_loss_metrics` (loss_type simpo, cpo_alpha 0);
- orpo: `ORPOTrainer.get_batch_loss_metrics`.

The trainers are built without running their `__init__` (no dataset, no tokenizer: the
batch is token ids); each gets the attributes its loss code reads. Written:
`preference/goldens.json` {"batch": {tokens, completion, attention}, "<model>": {"<case>":
{metric: value}}}, with the versions of torch, transformers and trl.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "preference"
REF_SCALE = 0.9
MAX_LENGTH = 14
PAIRS = [  # (prompt, chosen, rejected) token ids, vocab 256
    ([1, 17, 42, 99, 3], [250, 7, 7, 128, 2], [64, 32, 2]),
    ([1, 5, 201, 13], [77, 9, 18, 27, 36, 2], [45, 54, 63, 72, 81, 90, 2]),
    ([1, 99, 108, 117, 126, 135, 144, 153, 162], [171, 180, 189, 198, 2], [207, 216, 2]),
]
CASES = {  # name: (trainer, config)
    "dpo": ("dpo", dict(loss_type="sigmoid", beta=0.1, label_smoothing=0.0)),
    "dpo_beta05": ("dpo", dict(loss_type="sigmoid", beta=0.5, label_smoothing=0.0)),
    "dpo_ls": ("cdpo", dict(beta=0.1, label_smoothing=0.2)),
    "ipo": ("dpo", dict(loss_type="ipo", beta=0.1, label_smoothing=0.0)),
    "hinge": ("dpo", dict(loss_type="hinge", beta=0.1, label_smoothing=0.0)),
    "simpo": ("cpo", dict(loss_type="simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=0.0, cpo_alpha=0.0)),
    "orpo": ("orpo", dict(beta=0.1)),
}
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "nll_loss",
    "log_odds_ratio",
    "log_odds_chosen",
)


def models(name):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(HERE / "hf" / name, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(HERE / "hf" / name, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(REF_SCALE)
    return policy, ref


def collate():
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    examples = [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in PAIRS]
    return DataCollatorForPreference(pad_token_id=0, max_length=MAX_LENGTH)(examples)


def _accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def dpo_case(policy, ref, batch, cfg):
    from trl import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    if not getattr(policy, "_fused", False):  # as DPOTrainer.__init__ patches both heads
        add_fused_lm_head(policy, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
        add_fused_lm_head(ref)
        policy._fused = True
    t = DPOTrainer.__new__(DPOTrainer)
    t._tp_size = 1
    t.model, t.ref_model, t.accelerator = policy, ref, _accelerator()
    t.loss_types, t.loss_weights = [cfg["loss_type"]], [1.0]
    t.beta, t.label_smoothing = cfg["beta"], cfg["label_smoothing"]
    t.ld_alpha, t.precompute_ref_logps, t.f_divergence_type = None, False, "reverse_kl"
    t.use_weighting, t.aux_loss_enabled, t._total_train_tokens = False, False, 0
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t.args = type("Args", (), {"gradient_checkpointing_kwargs": None, "gradient_checkpointing": False})()
    policy.train()  # mode "train" (no dropout in these configs)
    loss = t._compute_loss(policy, dict(batch), return_outputs=False)
    out = {"loss": float(loss)}
    out.update({k: float(v[-1]) for k, v in t._metrics["train"].items() if k in METRICS})
    return out


def cdpo_case(policy, ref, batch, cfg):
    """Conservative DPO (label smoothing): TRL < 1.0's sigmoid loss, written out from the
    logps DPOTrainer computes (TRL 1.x's `sigmoid` takes no label smoothing)."""
    import torch.nn.functional as F

    base = dpo_case(policy, ref, batch, dict(cfg, loss_type="sigmoid", label_smoothing=0.0))
    b, ls = cfg["beta"], cfg["label_smoothing"]
    d = torch.tensor(_logratios(policy, ref, batch))
    losses = -F.logsigmoid(b * d) * (1 - ls) - F.logsigmoid(-b * d) * ls
    return {**base, "loss": float(losses.mean())}


def _logratios(policy, ref, batch):
    from trl.trainer.utils import selective_log_softmax

    def sums(model):
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        lp = selective_log_softmax(logits[:, :-1], batch["input_ids"][:, 1:])
        return (lp * batch["completion_mask"][:, 1:]).sum(1)

    s = sums(policy) - sums(ref)
    c, r = s.chunk(2)
    return (c - r).tolist()


def _concatenated(batch):
    """CPO / ORPO's batch: chosen_* and rejected_* with labels -100 outside the completion."""
    n = batch["input_ids"].shape[0] // 2
    out = {}
    for side, rows in (("chosen", slice(0, n)), ("rejected", slice(n, 2 * n))):
        ids, att, comp = batch["input_ids"][rows], batch["attention_mask"][rows], batch["completion_mask"][rows]
        out[f"{side}_input_ids"], out[f"{side}_attention_mask"] = ids, att
        out[f"{side}_labels"] = torch.where(comp.bool(), ids, torch.full_like(ids, -100))
    return out


def cpo_case(policy, ref, batch, cfg, cls_name="CPOTrainer"):
    import trl.experimental.cpo as cpo_mod
    import trl.experimental.orpo as orpo_mod

    cls = getattr(cpo_mod, "CPOTrainer") if cls_name == "CPOTrainer" else getattr(orpo_mod, "ORPOTrainer")
    t = cls.__new__(cls)
    t.accelerator, t.is_encoder_decoder, t.aux_loss_enabled = _accelerator(), False, False
    t.padding_value = t.pad_token_id = 0
    t.label_pad_token_id = -100
    t.beta = cfg["beta"]
    t.loss_type, t.label_smoothing = cfg.get("loss_type", "sigmoid"), cfg.get("label_smoothing", 0.0)
    t.simpo_gamma, t.cpo_alpha, t.alpha = cfg.get("simpo_gamma", 0.5), cfg.get("cpo_alpha", 0.0), 0.0
    t._peft_has_been_casted_to_bf16 = False
    loss, metrics = t.get_batch_loss_metrics(policy, _concatenated(batch), train_eval="train")
    out = {"loss": float(loss)}
    out.update({k: float(v) for k, v in metrics.items() if k in METRICS and not k.startswith("logits/")})
    return out


def main() -> None:
    import transformers
    import trl

    batch = collate()
    torch.set_grad_enabled(True)
    goldens = {
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "ref_scale": REF_SCALE,
        "batch": {k: batch[k].tolist() for k in ("input_ids", "attention_mask", "completion_mask")},
        "cases": {k: {"trainer": t, **cfg} for k, (t, cfg) in CASES.items()},
    }
    for name in ("llama3", "qwen3"):
        policy, ref = models(name)
        res = {}
        for case, (kind, cfg) in CASES.items():
            if kind == "dpo":
                res[case] = dpo_case(policy, ref, batch, cfg)
            elif kind == "cdpo":
                res[case] = cdpo_case(policy, ref, batch, cfg)
            else:
                res[case] = cpo_case(policy, ref, batch, cfg, "CPOTrainer" if kind == "cpo" else "ORPOTrainer")
            print(name, case, {k: round(v, 6) for k, v in res[case].items()}, file=sys.stderr)
        goldens[name] = res
    OUT.mkdir(exist_ok=True)
    (OUT / "goldens.json").write_text(json.dumps(goldens, indent=1) + "\n")
    print(f"wrote {OUT / 'goldens.json'}")


if __name__ == "__main__" and "--data" not in sys.argv:
    main()


DATA_ROWS = [  # standard, conversational (explicit prompt), UltraFeedback-binarized (implicit prompt)
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    {
        "prompt": [{"role": "user", "content": "What color is the sky?"}],
        "chosen": [{"role": "assistant", "content": "It is blue."}],
        "rejected": [{"role": "assistant", "content": "It is green."}],
    },
    {
        "prompt": "Name a fruit.",
        "chosen": [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Apple."}],
        "rejected": [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Carrot."}],
    },
]


def data_goldens() -> dict:
    """prompt_ids / chosen_ids / rejected_ids as DPOTrainer._prepare_dataset makes them with the
    Llama 3 chat tokenizer of tests/golden/chat/llama3 (standard rows and conversational rows
    separately, as TRL needs one format per dataset; the UltraFeedback row's prompt string is
    dropped and TRL's extract_prompt takes the common prefix)."""
    import tempfile

    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import DPOConfig, DPOTrainer

    tok = PreTrainedTokenizerFast.from_pretrained(HERE / "chat" / "llama3")
    t = DPOTrainer.__new__(DPOTrainer)
    t._tokenizer = tok
    out = []
    with tempfile.TemporaryDirectory() as d:
        args = DPOConfig(output_dir=d, max_length=None, report_to="none", use_cpu=True, bf16=False)
        for row in DATA_ROWS:
            row = dict(row)
            if isinstance(row["chosen"], list) and not isinstance(row["prompt"], list):
                del row["prompt"]
            ds = t._prepare_dataset(Dataset.from_list([row]), tok, args, "train")
            r = ds[0]
            out.append({k: r[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")})
    return {"rows": DATA_ROWS, "ids": out}


if __name__ == "__main__" and "--data" in sys.argv:
    (OUT / "data_goldens.json").write_text(json.dumps(data_goldens(), indent=1) + "\n")
