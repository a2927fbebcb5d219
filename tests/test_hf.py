"""Hugging Face checkpoints in and out (fsdp_jax.app.hf.load, hf_config, hf_export, scripts/convert.py).

Goldens (tests/golden/hf, regenerated in a separate venv with torch + transformers): two
tiny random LlamaForCausalLMs from make_hf_goldens.py — llama_gqa (8 q / 2 kv heads,
untied, bf16 in 6 shards + index, a BPE tokenizer.json) and llama_tied (4 q / 1 kv head,
tied, rope_theta 5e5, eps 1e-6, fp16 in 3 shards) — and one per family from
make_hf_family_goldens.py (llama3, llama32_tied, llama_yarn, mistral_swa, qwen2, qwen3,
gemma3_text; f32, 2 x 40 tokens past every window and original RoPE context), each with
the logits transformers computes for fixed tokens.
"""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors import safe_open

from fsdp_jax.app.config.parse import config_to_dict
from fsdp_jax.app.hf import load as hf
from fsdp_jax.app.hf.export import export_hf
from fsdp_jax.app.models import Decoder
from fsdp_jax.app.trainer.setup import load_run_config
from fsdp_jax.checkpoint import Checkpointer, CheckpointError
from fsdp_jax.checkpoint.safetensors_io import SafetensorsFile, write_safetensors
from fsdp_jax.errors import ConfigError
from fsdp_jax.model.fns import from_nnx
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.train.build import build
from fsdp_jax.train.step import sharding_context
from helpers import script

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "hf"
MODELS = ("llama_gqa", "llama_tied")
# tiny checkpoints of every family (tests/golden/make_hf_family_goldens.py), 2 x 40 tokens:
# longer than their sliding windows (8) and original RoPE contexts (16)
FAMILY_MODELS = ("llama3", "llama32_tied", "llama_yarn", "mistral_swa", "qwen2", "qwen3", "gemma3_text")
MESHES = {
    "full_shard": (1, 8, 1),
    "shard_grad_op": (1, 8, 1),
    "shard_opt": (1, 8, 1),
    "no_shard": (1, 8, 1),
    "hybrid_shard": (2, 4, 1),
}


def golden_logits(name):
    f = SafetensorsFile(GOLDEN / f"{name}_logits.safetensors")
    return f.read("tokens"), f.read("logits")


def imported(path, strategy="full_shard", mesh_shape=(1, 8, 1), scan=True):
    """(params loaded sharded from hf checkpoint `path`, ModelFns, plan)."""
    ckpt = hf.HFCheckpoint(path, base=hf.DecoderConfig(scan_layers=scan))
    m = from_nnx(lambda r: Decoder(ckpt.config, rngs=r))
    built = build(m, optax.sgd(0.1), make_mesh(*mesh_shape), strategy, min_shard_size=0)
    return hf.load_params(ckpt, built.abstract_state.params), m, built.plan


def logits_of(params, m, plan, tokens):
    batch = jnp.asarray(np.tile(tokens, (4, 1)))  # 8 rows: divisible by every batch sharding
    with sharding_context(plan):
        out = jax.jit(m.apply)(params, batch)
    return np.asarray(out)[: len(tokens)]


def check_against_golden(name, path=None, **kw):
    tokens, want = golden_logits(name)
    params, m, plan = imported(path or GOLDEN / name, **kw)
    err = float(np.abs(logits_of(params, m, plan, tokens) - want).max())
    assert err < 1e-4, (name, kw, err)
    return params


@pytest.mark.parametrize("name", MODELS)
def test_import_matches_transformers_logits_full_shard(name):
    params = check_against_golden(name)
    spec = params["blocks"]["attn"]["wq"].sharding.spec
    assert spec == jax.sharding.PartitionSpec(None, "fsdp", None, None)  # really sharded
    assert ("head" in params) == (name == "llama_gqa")  # tied: the embedding is the head


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [s for s in MESHES if s != "full_shard"] + ["fsdp_x_tensor"])
@pytest.mark.parametrize("name", MODELS)
def test_import_matches_transformers_logits_every_strategy(name, strategy):
    if strategy == "fsdp_x_tensor":  # heads / kv heads / mlp / vocab split over tensor too
        check_against_golden(name, strategy="full_shard", mesh_shape=(1, 4, 2))
    else:
        check_against_golden(name, strategy=strategy, mesh_shape=MESHES[strategy])


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_family_import_matches_transformers_logits(name):
    """Scanned full_shard and unscanned fsdp x tensor, each within 1e-4 of transformers."""
    params = check_against_golden(name)
    check_against_golden(name, scan=False, mesh_shape=(1, 4, 2))
    cfg = hf.HFCheckpoint(GOLDEN / name).config
    assert set(params["blocks"]["attn"]) >= ({"bq", "bk", "bv"} if name == "qwen2" else set())
    assert ("q_norm" in params["blocks"]["attn"]) == (name in ("qwen3", "gemma3_text"))
    assert ("post_mlp_norm" in params["blocks"]) == (name == "gemma3_text")
    from fsdp_jax.app.models import count_params

    assert count_params(cfg) == sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [s for s in MESHES if s != "full_shard"])
@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_family_import_matches_transformers_logits_every_strategy(name, strategy):
    check_against_golden(name, strategy=strategy, mesh_shape=MESHES[strategy])


FAMILY_CONFIGS = {  # golden -> the decoder fields its config.json must switch on
    "llama3": dict(
        rope_type="llama3",
        rope_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_len=16,
        rope_theta=5e5,
    ),
    "llama32_tied": dict(rope_type="llama3", rope_factor=32.0, tie_word_embeddings=True, n_kv_heads=1),
    "llama_yarn": dict(
        rope_type="yarn", rope_factor=4.0, rope_original_max_len=16, rope_beta_fast=32.0, rope_beta_slow=1.0
    ),
    "mistral_swa": dict(sliding_window=8, global_every=0, kv_channels=16),
    "qwen2": dict(qkv_bias=True, rope_theta=1e6, qk_norm=False),
    "qwen3": dict(qk_norm=True, kv_channels=32, tie_word_embeddings=True, qkv_bias=False),
    "gemma3_text": dict(
        kv_channels=32,
        sliding_window=8,
        global_every=2,
        rope_local_theta=1e4,
        rope_theta=1e6,
        rope_type="linear",
        rope_factor=2.0,
        query_pre_attn_scalar=24.0,
        attn_softcap=0.0,
        final_softcap=3.0,
        mlp_activation="gelu_pytorch_tanh",
        norm_plus_one=True,
        sandwich_norm=True,
        embed_scale=True,
        qk_norm=True,
        n_layers=3,
    ),
}


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_family_config_mapping(name):
    c = hf.HFCheckpoint(GOLDEN / name).config
    for field, want in FAMILY_CONFIGS[name].items():
        assert getattr(c, field) == want, (field, getattr(c, field), want)


def as_4x_config(src: Path, dst: Path, keep_theta: bool) -> Path:
    """A copy of `src` whose config.json is written the transformers 4.x way."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    theta = raw.pop("rope_parameters")["rope_theta"]
    raw.pop("head_dim")
    raw["rope_scaling"] = None
    if keep_theta:
        raw["rope_theta"] = theta
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_transformers_4x_config_and_unscanned_layers(tmp_path):
    tied = as_4x_config(GOLDEN / "llama_tied", tmp_path / "tied4", keep_theta=True)
    check_against_golden("llama_tied", tied, scan=False)
    gqa = as_4x_config(GOLDEN / "llama_gqa", tmp_path / "gqa4", keep_theta=False)  # default 10000
    assert hf.HFCheckpoint(gqa).config.rope_theta == 10000.0
    check_against_golden("llama_gqa", gqa, mesh_shape=(1, 4, 2))


def test_config_mapping():
    c = hf.HFCheckpoint(GOLDEN / "llama_tied").config
    assert (
        c.vocab_size,
        c.d_model,
        c.n_layers,
        c.n_heads,
        c.n_kv_heads,
        c.ffn_dim,
        c.max_seq_len,
        c.rope_theta,
        c.norm_eps,
        c.tie_word_embeddings,
    ) == (256, 64, 2, 4, 1, 128, 64, 5e5, 1e-6, True)


def test_load_config_takes_model_from_config_json(tmp_path):
    yml = tmp_path / "c.yaml"
    yml.write_text(f"init_from: hf:{GOLDEN / 'llama_gqa'}\ndata: {{seq_len: 32}}\n")
    cfg = load_run_config(yml)
    assert (cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.max_seq_len) == (8, 2, 64)
    assert config_to_dict(cfg)["model"]["tie_word_embeddings"] is False  # saved config.yaml is complete
    assert load_run_config(yml, ["model.n_heads=8"]).model.n_heads == 8  # agreeing keys are fine
    with pytest.raises(ConfigError, match=r"model\.d_model.*hidden_size=64"):
        load_run_config(yml, ["model.d_model=128"])


# -- export --------------------------------------------------------------------------------


@jax.jit
def _perturbed(params, key):
    """`params` plus 1e-3 standard normal noise, one key per leaf (one program, not op by op)."""
    keys = iter(jax.random.split(key, 64))
    return jax.tree.map(lambda p: p + 1e-3 * jax.random.normal(next(keys), p.shape), params)


def saved_run(tmp_path, name, perturb=True):
    """A checkpoint dir holding params imported from golden `name` (plus float32 noise no
    bf16/fp16 value has) and the run config, as the trainer saves them."""
    yml = tmp_path / "c.yaml"
    yml.write_text(f"init_from: hf:{GOLDEN / name}\ndata: {{seq_len: 32, path: {tmp_path / 'd'}}}\n")
    cfg = load_run_config(yml)
    params, _, _ = imported(GOLDEN / name)
    if perturb:
        params = _perturbed(params, jax.random.key(1))
    d = tmp_path / "run" / "checkpoints"
    with Checkpointer(d) as ck:
        ck.save(7, {"params": params}, {"config": config_to_dict(cfg)})
    return d, params


def index_and_shapes(d: Path) -> tuple[dict, dict]:
    """(weight_map, {name: shape}) of an HF directory, read with the safetensors library."""
    idx = d / "model.safetensors.index.json"
    wm = (
        json.loads(idx.read_text())["weight_map"]
        if idx.exists()
        else {k: "model.safetensors" for k in safe_open(str(d / "model.safetensors"), "np").keys()}
    )
    shapes = {}
    for f in set(wm.values()):
        with safe_open(str(d / f), "np") as h:
            shapes.update({k: h.get_slice(k).get_shape() for k in h.keys()})
    return wm, shapes


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.fast_cases("llama_gqa")
def test_export_is_what_transformers_expects_and_round_trips_bit_exact(tmp_path, name):
    ck, params = saved_run(tmp_path, name)
    out = tmp_path / "hf_out"
    info = export_hf(ck, out, max_shard_bytes=40_000)
    assert info["step"] == 7 and info["files"] > 1
    # names and shapes as in the golden checkpoint transformers wrote
    wm, shapes = index_and_shapes(out)
    gwm, gshapes = index_and_shapes(GOLDEN / name)
    assert set(wm) == set(gwm) and shapes == gshapes
    assert all((out / f).is_file() for f in wm.values())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(int(np.prod(s)) * 4 for s in shapes.values())
    # config.json: every key transformers wrote, with the same value
    got, want = (json.loads((p / "config.json").read_text()) for p in (out, GOLDEN / name))
    for k, v in want.items():
        if k not in ("transformers_version", "dtype"):
            assert got.get(k) == v, (k, got.get(k), v)
    assert got["dtype"] == "float32"
    if name == "llama_gqa":  # tokenizer files come along from the imported model
        assert (out / "tokenizer.json").read_bytes() == (GOLDEN / name / "tokenizer.json").read_bytes()
    # round trip: re-import is bit-exact, in another layout
    back, _, _ = imported(out, strategy="hybrid_shard", mesh_shape=(2, 4, 1))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


# keys transformers writes that no loader reads back: the BC default of a replaced key
# (Gemma 3's `_sliding_window_pattern`), Qwen's `max_window_layers` while windows are off
_UNREAD_KEYS = ("transformers_version", "dtype", "_sliding_window_pattern", "max_window_layers")


@pytest.mark.parametrize("name", FAMILY_MODELS)
@pytest.mark.fast_cases("qwen3")
def test_family_export_writes_its_family_and_round_trips_bit_exact(tmp_path, name):
    ck, params = saved_run(tmp_path, name)
    out = tmp_path / "hf_out"
    export_hf(ck, out)
    wm, shapes = index_and_shapes(out)
    assert shapes == index_and_shapes(GOLDEN / name)[1]  # the family's tensor names and shapes
    got, want = (json.loads((p / "config.json").read_text()) for p in (out, GOLDEN / name))
    for k, v in want.items():
        if k not in _UNREAD_KEYS:
            assert got.get(k) == v, (k, got.get(k), v)
    rope = got["rope_parameters"].get("full_attention", got["rope_parameters"])
    if rope["rope_type"] != "default":  # 4.x keys too: older transformers must not fall back
        assert got["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
    assert got["rope_theta"] == rope["rope_theta"]
    back, _, _ = imported(out, strategy="hybrid_shard", mesh_shape=(2, 4, 1))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    as4 = tmp_path / "as4x"  # the 4.x keys alone map onto the same architecture
    shutil.copytree(out, as4)
    edit_config(as4, rope_parameters=None, **({"layer_types": None} if "layer_types" in got else {}))
    assert hf.HFCheckpoint(as4).config == hf.HFCheckpoint(out).config


def test_export_refuses_a_model_no_family_computes(tmp_path):
    yml = tmp_path / "c.yaml"
    yml.write_text(
        "model: {vocab_size: 256, d_model: 64, n_layers: 1, n_heads: 4, n_kv_heads: 4, "
        "ffn_dim: 64, max_seq_len: 32, qkv_bias: true, qk_norm: true}\n"
        f"data: {{seq_len: 32, path: {tmp_path / 'd'}}}\n"
    )
    cfg = load_run_config(yml)
    params = jax.jit(from_nnx(lambda r: Decoder(cfg.model, rngs=r)).init)(jax.random.key(0))
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"params": params}, {"config": config_to_dict(cfg)})
    with pytest.raises(CheckpointError, match="no Hugging Face family"):
        export_hf(tmp_path / "ck", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_bf16_single_file_and_refusals(tmp_path):
    ck, params = saved_run(tmp_path, "llama_gqa", perturb=False)
    out = tmp_path / "bf16"
    info = export_hf(ck, out, dtype="bfloat16")
    assert info["files"] == 1 and not (out / "model.safetensors.index.json").exists()
    with safe_open(str(out / "model.safetensors"), "np") as h:
        assert h.metadata() == {"format": "pt"}
        assert {h.get_slice(k).get_dtype() for k in h.keys()} == {"BF16"}
    check_against_golden("llama_gqa", out)  # the golden's bf16 values survive exactly
    with pytest.raises(CheckpointError, match="already exists"):
        export_hf(ck, out)
    with pytest.raises(CheckpointError, match="no checkpoint for step 3"):
        export_hf(ck, tmp_path / "x", step=3)
    assert not (tmp_path / "x").exists()


# -- conversion script and bad input --------------------------------------------------------


def test_convert_script_writes_init_from_params(tmp_path, capsys):
    out = tmp_path / "m.safetensors"
    assert (
        script("convert").main([str(GOLDEN / "llama_gqa"), "--out", str(out), "--config-out", str(tmp_path / "m.yaml")])
        == 0
    )
    from fsdp_jax.checkpoint import load_safetensors

    params, m, plan = imported(GOLDEN / "llama_gqa")
    abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=p.sharding), params)
    loaded = load_safetensors(out, abstract)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert "n_kv_heads: 2" in (tmp_path / "m.yaml").read_text()


def edit_config(d: Path, **changes):
    raw = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            raw.pop(k)
        else:
            raw[k] = v
    (d / "config.json").write_text(json.dumps(raw))


def rewrite_tensor(d: Path, fname: str, name: str, array=None, extra: dict | None = None):
    """Rewrite shard `fname` with tensor `name` replaced by `array` (or dropped) plus `extra`."""
    f = SafetensorsFile(d / fname)
    arrays = {n: f.read(n) for n in f.tensors if n != name}
    if array is not None:
        arrays[name] = array
    arrays.update(extra or {})
    write_safetensors(d / fname, [(n, a.shape, a.dtype) for n, a in arrays.items()], arrays.__getitem__)


def _bad_dirs(tmp):
    """(case, directory, word the error line must contain)."""

    def copy(case):
        return Path(shutil.copytree(GOLDEN / "llama_gqa", tmp / case))

    q = "model.layers.0.self_attn.q_proj.weight"
    qfile = json.loads((GOLDEN / "llama_gqa" / "model.safetensors.index.json").read_text())["weight_map"][q]
    cases = []
    for case, change, word in [
        ("gpt2", {"model_type": "gpt2"}, "model_type"),
        ("gelu", {"hidden_act": "gelu"}, "hidden_act"),
        ("bias", {"attention_bias": True}, "attention_bias"),
        ("mlpbias", {"mlp_bias": True}, "mlp_bias"),
        ("llama3", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rope_parameters"),
        ("scaling4x", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling"),
        ("window", {"model_type": "mistral", "sliding_window": 4096}, "sliding_window"),
        ("headdim", {"head_dim": 16}, "q_proj.weight"),  # config and tensors disagree
        ("nohidden", {"hidden_size": None}, "hidden_size"),
        ("badheads", {"num_key_value_heads": 3}, "num_key_value_heads"),
        ("arch", {"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
    ]:
        d = copy(case)
        edit_config(d, **change)
        cases.append((case, d, word))
    d = copy("noshard")
    (d / qfile).unlink()
    cases.append(("noshard", d, qfile))
    d = copy("shape")
    rewrite_tensor(d, qfile, q, np.zeros((64, 32), np.float32))
    cases.append(("shape", d, "shape"))
    d = copy("unexpected")
    rewrite_tensor(d, qfile, "", extra={"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)})
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.self_attn.q_proj.bias"] = qfile
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    cases.append(("unexpected", d, "q_proj.bias"))
    d = copy("notensor")
    rewrite_tensor(d, qfile, q)
    cases.append(("notensor", d, q))
    d = copy("noweights")
    for f in d.glob("model*"):
        f.unlink()
    (d / "pytorch_model.bin").write_bytes(b"")
    cases.append(("noweights", d, "pytorch_model.bin"))
    d = copy("noconfig")
    (d / "config.json").unlink()
    cases.append(("noconfig", d, "config.json"))
    return cases + _bad_family_dirs(tmp)


def _bad_family_dirs(tmp):
    """Family checkpoints whose config.json and tensors disagree, or that set what the
    decoder does not compute: (case, directory, word the error line must contain)."""
    cases = []
    for case, src, change, word in [
        (
            "l3_missing",
            "llama3",
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 5e5,
                    "factor": 8.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                }
            },
            "low_freq_factor",
        ),
        (
            "l3_4x_missing",
            "llama3",
            {"rope_parameters": None, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "rope_scaling",
        ),
        ("longrope", "llama3", {"rope_parameters": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
        (
            "yarn_extra",
            "llama_yarn",
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mrope_section": [1, 2]}},
            "mrope_section",
        ),
        ("window_ctx", "mistral_swa", {"sliding_window": 4096}, "sliding_window"),
        ("qwen_window", "qwen2", {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
        (
            "pattern",
            "gemma3_text",
            {"layer_types": ["full_attention", "sliding_attention", "sliding_attention"]},
            "layer_types",
        ),
        ("pattern_len", "gemma3_text", {"layer_types": ["sliding_attention"]}, "layer_types"),
        ("softcap", "gemma3_text", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        (
            "local_rope",
            "gemma3_text",
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                }
            },
            "rope_parameters",
        ),
        ("bidir", "gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional"),
        ("arch_mix", "qwen3", {"architectures": ["LlamaForCausalLM"]}, "architectures"),
        ("o_bias", "qwen3", {"attention_bias": True}, "attention_bias"),
        (
            "qwen3_as_qwen2",
            "qwen3",
            {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
            "q_proj.bias",
        ),  # qwen2 wants biases the checkpoint lacks
        (
            "qwen2_as_llama",
            "qwen2",
            {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
            "proj.bias",
        ),  # biases present, the config says none
        ("headdim_norm", "qwen3", {"head_dim": 16}, "q_proj.weight"),
    ]:
        d = Path(shutil.copytree(GOLDEN / src, tmp / case))
        edit_config(d, **change)
        cases.append((case, d, word))
    d = Path(shutil.copytree(GOLDEN / "qwen3", tmp / "qnorm_size"))
    rewrite_tensor(d, "model.safetensors", "model.layers.1.self_attn.q_norm.weight", np.ones(16, np.float32))
    cases.append(("qnorm_size", d, "model.layers.1.self_attn.q_norm.weight"))
    return cases


def test_bad_checkpoints_exit_2_with_one_line_and_write_nothing(tmp_path, capsys):
    convert = script("convert")
    for case, d, word in _bad_dirs(tmp_path):
        out = tmp_path / f"{case}.safetensors"
        rc = convert.main([str(d), "--out", str(out)])
        err = capsys.readouterr().err
        assert rc == 2, (case, err)
        assert err.startswith("error: ") and err.count("\n") == 1 and word in err, (case, err)
        assert not out.exists(), case


def test_trainer_refuses_bad_checkpoint_before_writing(tmp_path):
    from fsdp_jax.app.trainer.setup import setup
    from helpers import synthetic_corpus

    data = synthetic_corpus(tmp_path / "c")
    bad = dict((c, d) for c, d, _ in _bad_dirs(tmp_path))
    for case, exc in (("noshard", CheckpointError), ("shape", CheckpointError), ("noconfig", CheckpointError)):
        yml = tmp_path / f"{case}.yaml"
        run_dir = tmp_path / f"run_{case}"
        yml.write_text(
            f"init_from: hf:{bad[case]}\nmodel: {{vocab_size: 256, d_model: 64, n_heads: 8, "
            f"n_kv_heads: 2, ffn_dim: 128, n_layers: 2, max_seq_len: 64}}\n"
            f"data: {{seq_len: 32, path: {data}, source: none}}\nrun_dir: {run_dir}\n"
        )
        with pytest.raises(exc):
            setup(load_run_config(yml))
        assert not run_dir.exists(), case
    yml = tmp_path / "gelu.yaml"
    yml.write_text(f"init_from: hf:{bad['gelu']}\n")
    with pytest.raises(ConfigError, match="hidden_act"):
        load_run_config(yml)


def test_llama2_7b_finetune_config_agrees_with_the_published_config_json(tmp_path):
    """configs/llama2_7b_finetune.yaml states Llama-2-7b-hf's shapes; its (transformers
    4.31) config.json must map onto exactly them."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "bos_token_id": 1,
                "eos_token_id": 2,
                "hidden_act": "silu",
                "hidden_size": 4096,
                "initializer_range": 0.02,
                "intermediate_size": 11008,
                "max_position_embeddings": 4096,
                "model_type": "llama",
                "num_attention_heads": 32,
                "num_hidden_layers": 32,
                "num_key_value_heads": 32,
                "pretraining_tp": 1,
                "rms_norm_eps": 1e-05,
                "rope_scaling": None,
                "tie_word_embeddings": False,
                "torch_dtype": "float16",
                "transformers_version": "4.31.0.dev0",
                "use_cache": True,
                "vocab_size": 32000,
            }
        )
    )
    path = ROOT / "configs" / "llama2_7b_finetune.yaml"
    planned = load_run_config(path)  # the checkpoint is absent: the stated fields
    assert load_run_config(path, [f"init_from=hf:{tmp_path}"]).model == planned.model
    from fsdp_jax.app.models import count_params

    assert count_params(planned.model) == 6_738_415_616


def test_export_of_a_run_trained_from_scratch_carries_the_corpus_tokenizer(tmp_path):
    from fsdp_jax.app.data.corpus import prepare_text

    prepare_text(
        [ROOT / "configs"], tmp_path / "d", val_fraction=0.3, tokenizer=str(GOLDEN / "llama_gqa" / "tokenizer.json")
    )
    yml = tmp_path / "c.yaml"
    yml.write_text(
        f"model: {{vocab_size: 256, d_model: 64, n_layers: 1, n_heads: 4, n_kv_heads: 4, "
        f"ffn_dim: 64, max_seq_len: 32, tie_word_embeddings: true}}\n"
        f"data: {{seq_len: 32, path: {tmp_path / 'd'}}}\n"
    )
    cfg = load_run_config(yml)
    params = jax.jit(from_nnx(lambda r: Decoder(cfg.model, rngs=r)).init)(jax.random.key(0))
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"params": params}, {"config": config_to_dict(cfg)})
    export_hf(tmp_path / "ck", tmp_path / "out")
    got = json.loads((tmp_path / "out" / "config.json").read_text())
    assert got["eos_token_id"] == 2 and got["tie_word_embeddings"] is True and got["head_dim"] == 16
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (GOLDEN / "llama_gqa" / "tokenizer.json").read_bytes()
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    back = hf.HFCheckpoint(tmp_path / "out")
    assert back.config.n_layers == 1 and "lm_head.weight" not in back.where


def test_export_script_hf_bad_input_exits_2_with_one_line(tmp_path, capsys):
    ck, _ = saved_run(tmp_path, "llama_tied", perturb=False)
    export = script("export")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    for args, word in [
        (["--hf", str(tmp_path / "full")], "already exists"),
        (["--hf", str(tmp_path / "a"), "--max-shard-size", "5 parsecs"], "--max-shard-size"),
        (["--hf", str(tmp_path / "no" / "b")], "parent directory"),
        (["--hf", str(tmp_path / "c"), "--step", "9"], "step 9"),
    ]:
        rc = export.main([str(ck.parent), *args])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and word in err, (args, err)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(("c.", "run", "d"))) == ["full"]
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    assert export.main([str(ck.parent), "--hf", str(tmp_path / "ok"), "--max-shard-size", "60KB"]) == 0
    assert len(list((tmp_path / "ok").glob("model-*-of-*.safetensors"))) > 1


# The published config.json of each family's reference model (as on the Hugging Face Hub;
# Gemma 3 4B: the text_config of the multimodal checkpoint, as a gemma3_text config), the
# shipped config that must state exactly its architecture, and the published total.
PUBLISHED = {
    "llama3_1_8b": (
        8_030_261_248,
        {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "max_position_embeddings": 131072,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.43.0.dev0",
            "use_cache": True,
            "vocab_size": 128256,
        },
    ),
    "qwen2_5_7b": (
        7_615_616_512,
        {
            "architectures": ["Qwen2ForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151643,
            "hidden_act": "silu",
            "hidden_size": 3584,
            "initializer_range": 0.02,
            "intermediate_size": 18944,
            "max_position_embeddings": 131072,
            "max_window_layers": 28,
            "model_type": "qwen2",
            "num_attention_heads": 28,
            "num_hidden_layers": 28,
            "num_key_value_heads": 4,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "sliding_window": 131072,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.40.1",
            "use_cache": True,
            "use_mrope": False,
            "use_sliding_window": False,
            "vocab_size": 152064,
        },
    ),
    "qwen3_8b": (
        8_190_735_360,
        {
            "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 12288,
            "max_position_embeddings": 40960,
            "max_window_layers": 36,
            "model_type": "qwen3",
            "num_attention_heads": 32,
            "num_hidden_layers": 36,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.51.0",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
    ),
    "mistral_7b": (
        7_241_732_096,
        {
            "architectures": ["MistralForCausalLM"],
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "max_position_embeddings": 32768,
            "model_type": "mistral",
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0,
            "sliding_window": 4096,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.34.0.dev0",
            "use_cache": True,
            "vocab_size": 32000,
        },
    ),
    "gemma3_4b": (
        3_880_263_168,
        {  # keys the published text_config omits take Gemma3TextConfig's defaults
            "architectures": ["Gemma3ForCausalLM"],
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
            "vocab_size": 262208,
            "max_position_embeddings": 131072,
        },
    ),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_family_configs_state_the_published_architectures_and_counts(tmp_path, name):
    """configs/NAME.yaml states the published model's architecture: its config.json maps
    onto exactly that model section, and count_params is the published total."""
    from fsdp_jax.app.models import count_params

    total, published = PUBLISHED[name]
    (tmp_path / "config.json").write_text(json.dumps(published))
    path = ROOT / "configs" / f"{name}.yaml"
    planned = load_run_config(path)
    assert load_run_config(path, [f"init_from=hf:{tmp_path}"]).model == planned.model
    assert count_params(planned.model) == total
