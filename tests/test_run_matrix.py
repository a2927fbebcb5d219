"""Every stage of a run under every feature that trains, through the command line.

Per combination, train (2 steps: eval, the text sample, the final checkpoint) -> resume (the
same command at 3 steps) -> export (--hf; --peft and the merged --hf where LoRA) -> verify (one
step vs one device) -> plan, on the tiny decoder (configs/tiny.yaml shrunk) or the tiny Hugging
Face Llama (configs/hf_tiny_finetune.yaml), 8 CPU devices. Each must exit 0 and leave its files.
The selected combinations' chains run in turn in ONE child process (tests/run_chain.py
--chains: one Python and JAX start-up for them all, each chain's output in its own log), a
module fixture; each combination's test reads its chain's exit codes, log and files.

The combinations are a covering set, not the product: every feature (LoRA, MoE, streamed
optimizer offload, packed rows, document-masked token rows) appears under mesh.context > 1 and
at context 1; contexts 2, 4 and 8 each appear; full_shard, shard_grad_op and hybrid_shard each
run with context > 1. The trainer has no stateful (batch-statistics) models: those are the
drop-in API's (tests/test_stateful_models.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_packing import CHAT, chats

from fsdp_jax.app.data import corpus as data_lib
from fsdp_jax.app.data.sft import prepare_examples
from helpers import TINY_MODEL_OVERRIDES

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TINY = [o for o in TINY_MODEL_OVERRIDES if not o.startswith("train.global_batch")]
RUN = [
    "train.global_batch=8",
    "train.eval_every=2",
    "train.eval_batches=1",
    "train.sample_tokens=3",
    "train.checkpoint_every=0",
    "train.log_every=1",
    "optimizer.warmup_steps=1",
    "data.source=none",
]
# Mixtral's switches (every layer sparse: its ffn_dim is the experts'), so --hf finds its family
MOE = [
    "model.n_experts=4",
    "model.experts_per_token=2",
    "model.moe_ffn_dim=32",
    "model.norm_topk_prob=true",
    "model.ffn_dim=32",
]
LORA = ["lora.rank=4", "lora.targets=q_proj,v_proj,down_proj"]
HF_LORA = ["init_from=hf:tests/golden/hf/llama_gqa", "data.seq_len=32", *LORA]

# name: (strategy, context, corpus, config, overrides, stages)
COMBINATIONS = {
    "lora-hf-c2-full": ("full_shard", 2, "bytes", "hf_tiny_finetune", HF_LORA, "hf,peft,verify"),
    "moe-packed-c4-grad_op": ("shard_grad_op", 4, "packed", "tiny", TINY + MOE, "hf,verify"),
    "offload-docmask-c2-hybrid": (
        "hybrid_shard",
        2,
        "tokens",
        "tiny",
        [*TINY, "offload=optimizer:streamed", "data.document_mask=true", "mesh.data=2"],
        "hf",
    ),
    "dense-c8-full": ("full_shard", 8, "bytes", "tiny", TINY, "hf"),
    "lora-moe-packed-c1-hybrid": ("hybrid_shard", 1, "packed", "tiny", [*TINY, *MOE, *LORA, "mesh.data=2"], "peft,out"),
    "offload-docmask-c1-grad_op": (
        "shard_grad_op",
        1,
        "tokens",
        "tiny",
        [*TINY, "offload=optimizer:streamed", "data.document_mask=true"],
        "hf,verify",
    ),
}


@pytest.fixture(scope="module")
def corpora(corpus, tmp_path_factory):
    """bytes (the session corpus), tokens (a tokenizer's, EOS after each document) and packed
    chat rows of 32 tokens."""
    out = tmp_path_factory.mktemp("matrix_corpora")
    data_lib.prepare_text([corpus.parent / "src"], out / "tokens", val_fraction=0.2, tokenizer=str(CHAT / "llama2"))
    prepare_examples([chats(out / "c.jsonl", 300)], out / "packed", row_len=32, tokenizer=str(CHAT / "llama2"))
    return {"bytes": corpus, "tokens": out / "tokens", "packed": out / "packed"}


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def chains(corpora, request, tmp_path_factory) -> dict:
    """{name: (its stages' {stage: [exit code, seconds]}, its log, its run dir)} for the
    combinations this session selected, all run by one child process."""
    names = [
        i.callspec.params["name"]
        for i in request.session.items
        if i.originalname == "test_every_stage_of_a_run_exits_0_and_leaves_its_files" and i.module is request.module
    ]
    out = tmp_path_factory.mktemp("matrix_runs")
    specs = {}
    for name in names or list(COMBINATIONS):
        strategy, context, corpus, config, overrides, extra = COMBINATIONS[name]
        args = [
            *RUN,
            *overrides,
            f"data.path={corpora[corpus]}",
            f"mesh.context={context}",
            f"mesh.strategy={strategy}",
        ]
        stages = ["train", "resume", *extra.split(","), "plan"]
        specs[name] = dict(
            run_dir=str(out / name), strategy=strategy, stages=stages, config=f"configs/{config}.yaml", overrides=args
        )
    (out / "chains.json").write_text(json.dumps(list(specs.values())))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "tests/run_chain.py", "--chains", str(out / "chains.json")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    done = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        name: (done.get(s["run_dir"], {}), Path(s["run_dir"] + ".log").read_text(errors="replace"), Path(s["run_dir"]))
        for name, s in specs.items()
    }


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_every_stage_of_a_run_exits_0_and_leaves_its_files(name, chains):
    stages = ["train", "resume", *COMBINATIONS[name][5].split(","), "plan"]
    context = COMBINATIONS[name][1]
    done, log, run_dir = chains[name]
    assert {s: rc for s, (rc, _) in done.items()} == dict.fromkeys(stages, 0), log[-4000:]

    recs = _records(run_dir)
    assert {"val_loss", "step"} <= set(next(r for r in recs if "val_loss" in r)), recs
    assert max(r["step"] for r in recs if "loss" in r) == 3
    assert log.count("sample:") == 2 and "resuming from checkpoint step 2" in log, log[-4000:]
    assert {p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()} >= {"2", "3"}
    assert (run_dir / "config.yaml").exists()
    if "hf" in stages:
        assert (run_dir / "hf" / "config.json").exists() and list((run_dir / "hf").glob("*.safetensors"))
    if "peft" in stages:
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (run_dir / "peft").iterdir()}
    if "out" in stages:
        assert (run_dir / "model.safetensors").stat().st_size > 0
    if "verify" in stages:
        assert "PASS: every strategy trains like one device" in log
        assert ("every mesh splits sequences over context" in log) == (context > 1), log[-4000:]
