"""LoRA through the trainer: a Hugging Face base (init_from=hf:) with a PEFT adapter
(lora.init_from=peft:) trains; its checkpoints hold the adapters and their optimizer state
only, plus the base's fingerprint; an interrupted run resumes bit for bit; a checkpoint
restores onto another mesh and strategy; a different base is refused in one line."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from fsdp_jax import checkpoint as ck
from fsdp_jax.app.models import lora as lora_lib
from fsdp_jax.app.trainer.loop import train
from fsdp_jax.app.trainer.setup import load_run_config, setup
from fsdp_jax.checkpoint.safetensors_io import SafetensorsFile, write_safetensors
from fsdp_jax.errors import CheckpointError
from helpers import TINY_RUN_OVERRIDES

pytestmark = pytest.mark.slow  # end-to-end training runs

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
RUN = [o for o in TINY_RUN_OVERRIDES if not o.startswith("model.")] + [
    "train.steps=6",
    "train.checkpoint_every=3",
    "remat=none",
]
LORA = ["lora.rank=4", "lora.alpha=8", f"lora.init_from=peft:{GOLDEN / 'peft' / 'llama3'}"]


def config(corpus, run_dir, *extra, base=GOLDEN / "hf" / "llama3"):
    over = RUN + LORA + [f"data.path={corpus}", f"run_dir={run_dir}", f"init_from=hf:{base}", *extra]
    return load_run_config(ROOT / "configs" / "hf_tiny_finetune.yaml", over)


def records(run_dir: Path):
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            out[r["step"]] = (r["loss"], r["grad_norm"])
    return out


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    summary = train(config(corpus, run_dir), progress=False)
    return {"dir": run_dir, "state": jax.device_get(summary["run"].state), "records": records(run_dir)}


def test_checkpoints_hold_adapters_and_their_optimizer_state_and_the_base_fingerprint(straight):
    d = straight["dir"] / "checkpoints"
    assert ck.Checkpointer(d, read_only=True).steps() == [3, 6]
    run = straight["state"]
    base, adapters = lora_lib.split(run.params)
    saved = ck.Checkpointer(d, read_only=True)
    restored = saved.restore(
        jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
            run.replace(params=adapters),
        )
    )
    assert (
        restored.extras["lora_base"]["path"].startswith("hf:") and len(restored.extras["lora_base"]["checksum"]) == 32
    )
    for a, b in zip(leaves(restored.state), leaves(run.replace(params=adapters))):
        np.testing.assert_array_equal(a, b)
    # every array saved is an adapter, an adapter's optimizer state or a counter
    md = saved.saved_metadata(6)
    saved_bytes = sum(int(np.prod(m.shape)) * np.dtype(m.dtype).itemsize for m in md.values())
    adapter_bytes = sum(x.nbytes for x in leaves(adapters))
    assert all(lora_lib.is_adapter(p) for p in md if p.startswith("params/"))
    assert saved_bytes - adapter_bytes * 3 <= 16, (saved_bytes, adapter_bytes)  # Adam: two moments each
    assert 3 * adapter_bytes < 0.25 * sum(x.nbytes for x in leaves(base))
    # the base left the run as it came: bit for bit the Hugging Face checkpoint's tensors
    f = SafetensorsFile(GOLDEN / "hf" / "llama3" / "model.safetensors")
    np.testing.assert_array_equal(np.asarray(base["embed"]), f.read("model.embed_tokens.weight"))


def test_an_interrupted_lora_run_resumes_bit_for_bit(corpus, straight, tmp_path):
    cfg = config(corpus, tmp_path / "run")
    first = train(cfg, progress=False, stop_after=3)
    assert first["preempted"] == "stop_after=3"
    second = train(cfg, progress=False)
    assert second["run"].start_step == 3
    for a, b in zip(leaves(second["run"].state), leaves(straight["state"])):
        np.testing.assert_array_equal(a, b)
    assert records(tmp_path / "run") == straight["records"]


def test_a_lora_checkpoint_restores_onto_another_mesh_and_strategy(corpus, straight, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(straight["dir"], run_dir)
    cfg = config(corpus, run_dir, "mesh.data=2", "mesh.fsdp=4", "mesh.strategy=hybrid_shard")
    run = setup(cfg)
    assert run.start_step == 6
    for a, b in zip(leaves(run.state), leaves(straight["state"])):
        np.testing.assert_array_equal(a, b)
    spec = run.state.params["blocks"]["attn"]["lora"]["wq"]["lora_a"].sharding.spec
    assert tuple(spec)[:2] == (None, "fsdp")  # A's input dim sharded as wq's


def test_resuming_against_a_different_base_is_refused_in_one_line(corpus, straight, tmp_path):
    other = tmp_path / "other_base"
    shutil.copytree(GOLDEN / "hf" / "llama3", other)
    f = SafetensorsFile(other / "model.safetensors")
    tensors = {k: f.read(k) for k in f.tensors}
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + np.float32(1e-3)
    write_safetensors(other / "model.safetensors", [(k, v.shape, v.dtype) for k, v in tensors.items()], tensors.get)
    run_dir = tmp_path / "run"
    shutil.copytree(straight["dir"], run_dir)
    with pytest.raises(CheckpointError) as e:
        setup(config(corpus, run_dir, base=other))
    msg = str(e.value)
    assert "\n" not in msg and "another base" in msg and "checksum" in msg, msg


def test_export_peft_and_merged_reproduce_the_runs_logits(straight, tmp_path, capsys):
    """--peft: PEFT's names, the trained adapters; --hf: the base with W + scale * B A, which
    a plain decoder reloads with the LoRA model's logits; untouched tensors are the base's bytes."""
    from fsdp_jax.app.hf import load as hf
    from fsdp_jax.app.hf import peft
    from fsdp_jax.app.models.decoder import Decoder
    from fsdp_jax.app.trainer.build import trainer_model
    from fsdp_jax.model.fns import from_nnx
    from helpers import call

    rc, out, err = call("export", str(straight["dir"]), "--peft", str(tmp_path / "adapter"), capsys=capsys)
    assert rc == 0, err
    rc, out, err = call("export", str(straight["dir"]), "--hf", str(tmp_path / "merged"), capsys=capsys)
    assert rc == 0, err
    base_cfg = hf.HFCheckpoint(GOLDEN / "hf" / "llama3").config
    spec = lora_lib.LoraSpec(4, 8.0)
    adapters = peft.read_peft(tmp_path / "adapter", base_cfg, spec)
    _, trained = lora_lib.split(straight["state"].params)
    for a, b in zip(leaves(adapters), leaves(trained)):
        np.testing.assert_array_equal(a, b)

    tokens = np.asarray(SafetensorsFile(GOLDEN / "peft" / "llama3_logits.safetensors").read("tokens"))
    model = trainer_model(base_cfg, "none", spec)
    want = np.asarray(jax.jit(model.apply)(jax.device_get(straight["state"].params), tokens))
    merged = hf.HFCheckpoint(tmp_path / "merged")
    plain = from_nnx(lambda r: Decoder(merged.config, rngs=r))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), plain.abstract_params)
    got = np.asarray(jax.jit(plain.apply)(hf.load_params(merged, abstract), tokens))
    assert float(np.abs(got - want).max()) < 1e-4
    ours = SafetensorsFile(tmp_path / "merged" / "model.safetensors")
    theirs = SafetensorsFile(GOLDEN / "hf" / "llama3" / "model.safetensors")
    touched = [k for k in theirs.tensors if any(f".{p}." in k for p in lora_lib.peft_targets())]
    assert touched and set(ours.tensors) == set(theirs.tensors)
    for k in theirs.tensors:
        same = np.array_equal(ours.read(k), theirs.read(k))
        assert same == (k not in touched), k


def test_peft_export_of_a_run_without_lora_is_refused_in_one_line(corpus, tmp_path, capsys):
    from helpers import call, one_line

    run_dir = tmp_path / "full"
    over = [o for o in RUN if not o.startswith("train.steps")] + ["train.steps=1", f"data.path={corpus}"]
    over += [f"run_dir={run_dir}", f"init_from=hf:{GOLDEN / 'hf' / 'llama3'}"]
    train(load_run_config(ROOT / "configs" / "hf_tiny_finetune.yaml", over), progress=False)
    rc, _, err = call("export", str(run_dir), "--peft", str(tmp_path / "adapter"), capsys=capsys)
    one_line(rc, err, "not a LoRA run")
    assert not (tmp_path / "adapter").exists()


def test_verify_passes_on_a_lora_config_under_every_strategy(capsys):
    """`verify` on a LoRA config: the adapters train like one device under all five
    strategies, the base frozen (the same command is recorded in docs/lora.md)."""
    from helpers import TINY_MODEL_OVERRIDES, call

    over = [*TINY_MODEL_OVERRIDES, "lora.rank=4", "lora.alpha=8"]
    rc, out, err = call("verify", "--config", "configs/tiny.yaml", "--steps", "2", *over, capsys=capsys)
    assert rc == 0, err
    assert "PASS: every strategy trains like one device" in out
    assert out.count(" PASS") == 5
