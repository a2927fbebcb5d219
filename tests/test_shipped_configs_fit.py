"""The shipped planning configs fit the hardware their opening comment names (issue 56 item 4),
with their own strategy, remat, offload and microbatches: `plan --search` restricted to exactly
those settings, analytic only (the memory model on the trainer's abstract step; no compile),
must name a winner within the device memory minus the search's 10% headroom. The compiled
peaks of the same commands are in docs/planning.md.

JAX's backends run before these calls (the suite's 8 CPU devices, as in a notebook): a search for
64 devices re-runs itself in a child process that has them (`fsdp_jax.app.cli.run.plan.search_in_child`)."""

import json

import jax
import pytest
import yaml

from helpers import ROOT, call

# (config, what its comment claims, the hardware flags)
CLAIMS = [
    ("llama2_70b", "which strategy fits on 64 devices ... --device-memory 80GB", ["--target", "h100", "--devices", "64", "--hosts", "8", "--device-memory", "80GB"]),
    ("llama2_7b_finetune", "Fine-tune Llama-2-7B ... on 8 x 80 GB GPUs with ZeRO-3", ["--target", "h100", "--devices", "8"]),
    ("llama3_1_70b", "Full fine-tuning on one node of 8 x 80 GB ... streamed per layer", ["--target", "h100", "--devices", "8"]),
]  # fmt: skip


def own_settings(name: str) -> list[str]:
    """The config's own strategy / remat / offload / microbatches as --search restrictions."""
    doc = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    return [
        "--strategies", doc.get("mesh", {}).get("strategy", "full_shard"),
        "--remat", doc.get("remat", "full"),
        "--offload", doc.get("offload", "none"),
        "--microbatches", str(doc.get("train", {}).get("microbatches", 1)),
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name,claim,hardware", CLAIMS, ids=[c[0] for c in CLAIMS])
def test_shipped_config_fits_what_its_comment_names(name, claim, hardware, capsys):
    assert len(jax.devices()) == 8  # started: whatever ran before, this process cannot grow to 64
    assert claim.split(" ... ")[0] in (ROOT / "configs" / f"{name}.yaml").read_text()
    rc, out, err = call(
        "plan", "--config", f"configs/{name}.yaml", *hardware, "--search", "--max-compiles", "0",
        *own_settings(name), "--json", capsys=capsys,
    )  # fmt: skip
    assert rc == 0, err[-2000:]
    doc = json.loads(out)
    assert doc["winner"] is not None
    assert doc["winner"]["device_peak"] <= doc["budget"], (doc["winner"]["device_peak"], doc["budget"])
