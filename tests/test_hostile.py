"""Hostile inputs and faults, by class (issue #13).

The contract: a bad value (config key, flag, environment variable, file) gets ONE
line on stderr naming it, exit code 2, and nothing written; an environment failure
(disk full, a run directory in use) gets one line and exit 1 with nothing lost;
never a traceback. Each test walks a whole class, so the next key, flag or file of
the kind is caught too:
- every config field with a wrong-typed and an out-of-range value (the table of
  ranges must cover every field: a new field without an entry fails here);
- the trainer's other inputs (paths, init_from files, config files, env vars);
- every script's flags;
- hostile safetensors files; checkpoint bytes flipped without changing sizes;
- faults: a failed (full-disk) save, two trainers on one run_dir, a stale lock after
  kill -9, the coordinator's listening address, metrics after a crash.
"""

import ast
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import typing
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from fsdp_jax import checkpoint as ck
from fsdp_jax.app import config as config_lib
from fsdp_jax.app.config.schema import Rules, all_keys, field_type
from fsdp_jax.app.data.corpus import prepare_bin
from fsdp_jax.app.trainer.metrics import MetricsLog
from fsdp_jax.app.trainer.run_dir import LOCK_NAME, RunDirLock
from fsdp_jax.errors import TrainingDiverged
from fsdp_jax.multihost.distributed import bind_address, is_loopback
from helpers import TINY_RUN_OVERRIDES, call, one_line, synthetic_corpus

ROOT = Path(__file__).resolve().parents[1]
TINY = [*TINY_RUN_OVERRIDES, "train.checkpoint_every=0", "train.steps=3"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return synthetic_corpus(tmp_path_factory.mktemp("hostile_corpus"))


def listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*")) if d.exists() else []


# -- every config field: wrong type, out of range --------------------------------------------------

# A value outside what each key allows (None: every value of its type is allowed). A new
# config field must get an entry here: test_every_config_field_is_in_the_range_table.
OUT_OF_RANGE: dict[str, typing.Any] = {
    "model.vocab_size": 0,
    "model.d_model": 0,
    "model.n_layers": 0,
    "model.n_heads": 0,
    "model.n_kv_heads": 0,
    "model.ffn_dim": -1,
    "model.max_seq_len": 0,
    "model.max_segments": 0,
    "model.rope_theta": 0.0,
    "model.norm_eps": -1e-5,
    "model.scan_layers": None,
    "model.attention": "flash",
    "model.context_kv_pass": "telepathy",
    "model.grouped_matmul": "cutlass",
    "model.expert_exchange": "sparse",
    "mesh.data": 0,
    "mesh.fsdp": -2,
    "mesh.tensor": 0,
    "mesh.context": 0,
    "mesh.strategy": "zero9",
    "mesh.min_shard_size": -1,
    "mesh.max_replicated_fraction": 1.5,
    "optimizer.name": "adam9",
    "optimizer.lr": 0.0,
    "optimizer.warmup_steps": -1,
    "optimizer.min_lr_ratio": 2.0,
    "optimizer.b1": 1.0,
    "optimizer.b2": -0.1,
    "optimizer.eps": 0.0,
    "optimizer.weight_decay": -0.1,
    "optimizer.momentum": 1.0,
    "optimizer.clip_norm": 0.0,
    "data.path": "",
    "data.source": "web",
    "data.seq_len": 0,
    "data.seed": -1,
    "data.document_mask": None,
    "train.steps": 0,
    "train.global_batch": 0,
    "train.microbatches": 0,
    "train.seed": -1,
    "train.log_every": 0,
    "train.eval_every": -1,
    "train.eval_batches": -1,
    "train.checkpoint_every": -1,
    "train.keep_checkpoints": 0,
    "train.tensorboard": None,
    "train.sample_tokens": -1,
    "train.max_inflight_steps": 0,
    "train.max_nonfinite_steps": 0,
    "distributed.coordinator": "nohost",
    "distributed.num_processes": 0,
    "distributed.process_id": -1,
    "distributed.init_timeout_s": 0,
    "distributed.peer_timeout_s": -1.0,
    "precision": "params=float99",
    "remat": "sometimes",
    "run_dir": "",
    "xla_gpu_flags": "yes",
    "init_from": "/nonexistent/model.safetensors",
    "mesh.min_replicated_bytes": -1,
    "lora.rank": -1,
    "lora.alpha": 0.0,
    "lora.rslora": None,
    "lora.dropout": 1.0,
    "lora.targets": "q_proj nothing",
    "lora.target_parameters": "mlp.experts.nothing",
    "lora.gate_up_rank": -1,
    "lora.init_from": "peft:/nonexistent",
    "mesh.rules": {"embed": "nowhere"},
    "model.tie_word_embeddings": None,
    "model.kv_channels": -2,
    "model.rope_type": "dynamic",
    "model.rope_factor": 0.0,
    "model.rope_low_freq_factor": 0.0,
    "model.rope_high_freq_factor": 0.5,
    "model.rope_original_max_len": -1,
    "model.rope_beta_fast": 0.0,
    "model.rope_beta_slow": -1.0,
    "model.rope_attention_factor": -1.0,
    "model.rope_mscale": -1.0,
    "model.rope_mscale_all_dim": -1.0,
    "model.rope_truncate": None,
    "model.qkv_bias": None,
    "model.qk_norm": None,
    "model.sliding_window": -1,
    "model.global_every": -1,
    "model.rope_local_theta": -1.0,
    "model.attn_softcap": -1.0,
    "model.query_pre_attn_scalar": -1.0,
    "model.mlp_activation": "relu",
    "model.norm_plus_one": None,
    "model.sandwich_norm": None,
    "model.embed_scale": None,
    "model.final_softcap": -1.0,
    "model.n_experts": -1,
    "model.experts_per_token": -1,
    "model.moe_ffn_dim": -1,
    "model.norm_topk_prob": None,
    "model.shared_expert_ffn_dim": -1,
    "model.decoder_sparse_step": 0,
    "model.mlp_only_layers": None,  # layer indices are checked against n_layers with experts on
    "model.router_aux_loss_coef": -1.0,
    "model.router_z_loss_coef": -1.0,
    "model.bias_update_speed": -1.0,
    "model.seq_aux_loss_coef": -1.0,
    "model.capacity_factor": -1.0,
    "model.swiglu_limit": 0.0,
    "model.swiglu_alpha": -1.0,
    "model.q_lora_rank": -1,
    "model.kv_lora_rank": -1,
    "model.qk_nope_head_dim": -1,
    "model.v_head_dim": -1,
    "model.n_group": -1,
    "model.topk_group": -1,
    "model.routed_scaling_factor": 0.0,
    "model.shared_experts_ffn_dim": -1,
    "model.mtp_depth": -1,
    "model.mtp_loss_weight": -0.5,
    "train.profile": "4:2",
    "logging.wandb": None,
    "logging.wandb_project": None,
    "logging.wandb_run_name": None,
    "offload": "everything",
    "lora.base_quant": "nf3",
    "lora.quant_block": 0,
    "lora.double_quant": None,
    "fp8.recipe": "mxfp8",
    "fp8.amax_history": 0,
    "fp8.gather": None,
    "fp8.emulate": None,
    "model.family": None,  # any registered family; an unknown one is refused at model build (tests/test_families.py)
    "objective": "ppo",
    "preference.beta": 0.0,
    "preference.label_smoothing": 0.5,
    "preference.simpo_gamma": None,
    "preference.cpo_alpha": -1.0,
    "preference.max_length": -1,
    "preference.truncation": "keep_middle",
    "preference.tokenizer": None,
    "preference.prompt_key": None,
    "preference.chosen_key": None,
    "preference.rejected_key": None,
    "preference.precompute_ref_log_probs": None,
    "preference.eval_path": None,
    "preference.packing": None,
    "grpo.num_generations": 1,
    "grpo.max_prompt_len": 0,
    "grpo.max_new_tokens": 0,
    "grpo.temperature": -1.0,
    "grpo.top_p": 0.0,
    "grpo.top_k": -1,
    "grpo.stop_tokens": None,
    "grpo.epsilon": 1.0,
    "grpo.epsilon_high": -0.1,
    "grpo.beta": -0.1,
    "grpo.loss_type": "ppo",
    "grpo.scale_rewards": "yes",
    "grpo.num_iterations": 0,
    "grpo.rewards": None,
    "grpo.reward_weights": None,
    "grpo.answer_column": None,
    "grpo.format_pattern": None,
    "grpo.reward_workers": 0,
    "grpo.reward_timeout": 0.0,
    "grpo.on_nan": "ignore",
    "grpo.eval_path": None,  # a path, or null (no eval): a missing file is tests/test_grpo_trainer.py's
    "grpo.prompt_key": None,
    "grpo.tokenizer": None,
    "offload_dirs": None,  # any string: its dirs are checked when offload is optimizer:nvme (tests/test_nvme.py)
}


def _base(type_hint):
    if typing.get_origin(type_hint) is tuple:
        return tuple
    args = [a for a in typing.get_args(type_hint) if a is not type(None)]
    return args[0] if args else type_hint


def wrong_types(tp) -> list:
    """Values of the wrong type for a field annotated `tp` (as YAML would deliver them)."""
    values = {
        int: ["abc", 1.5, True, [1]],
        float: ["abc", True, [1.0], {"a": 1}],
        bool: ["maybe", 2, None],
        str: [[[1], 2], {"a": "b"}, 3],  # [1, 2] is a list of names (token ids) for a name-list key
        Rules: ["embed", 3, [1, 2], {"embed": 3}],
        tuple: ["abc", 3, [1.5], ["a"], {"a": 1}],  # tuple[int, ...]
    }[_base(tp)]
    return [v for v in values if v is not None or type(None) not in typing.get_args(tp)]  # null: an optional's default


def field_types() -> dict[str, typing.Any]:
    return {k: field_type(k) for k in all_keys()}


def base_raw(corpus, run_dir) -> dict:
    raw = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    return config_lib.apply_overrides(raw, TINY + [f"data.path={corpus}", f"run_dir={run_dir}"])


def with_value(raw: dict, key: str, value) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    head, _, tail = key.partition(".")
    if tail:
        out.setdefault(head, {})[tail] = value
    else:
        out[key] = value
    return out


def test_every_config_field_is_in_the_range_table():
    missing = sorted(set(field_types()) - set(OUT_OF_RANGE))
    assert not missing, f"add an out-of-range value for {missing} to OUT_OF_RANGE (None if none)"


@pytest.mark.slow
def test_every_config_field_rejects_wrong_types_and_out_of_range_values(corpus, tmp_path, capsys):
    """Through the trainer's entry (scripts/train.py main): every field, each wrong type
    (from a YAML file), its out-of-range value (as a key=value override), and for numbers
    non-finite / overflowing values -> one line naming the key, exit 2, nothing written."""
    run_dir = tmp_path / "run"
    raw = base_raw(corpus, run_dir)
    cfg_file = tmp_path / "bad.yaml"
    corpus_before = listing(corpus)
    cases = []
    for key, tp in field_types().items():
        for v in wrong_types(tp):
            cases.append((key, "yaml", v))
        if OUT_OF_RANGE[key] is not None:
            cases.append((key, "override", OUT_OF_RANGE[key]))
        if _base(tp) is float:
            cases += [(key, "yaml", v) for v in (float("inf"), float("-inf"), float("nan"), 10**400)]
        if _base(tp) is int:
            cases += [(key, "yaml", v) for v in (2**31, -(2**63), 10**30)]
    for key, how, value in cases:
        if how == "yaml":
            cfg_file.write_text(yaml.safe_dump(with_value(raw, key, value)))
            args = ["--config", cfg_file, "--no-progress"]
        else:
            cfg_file.write_text(yaml.safe_dump(raw))
            text = value if isinstance(value, str) else json.dumps(value)
            args = ["--config", cfg_file, "--no-progress", f"{key}={text}"]
        rc, _, err = call("train", *args, capsys=capsys)
        try:
            one_line(rc, err, key)
        except AssertionError as e:
            raise AssertionError(f"{key} = {value!r} ({how}): {e}") from None
        assert not run_dir.exists(), (key, value, listing(run_dir))
    assert listing(corpus) == corpus_before
    assert len(cases) > 150


# -- the trainer's other inputs ---------------------------------------------------------------------


def _safetensors_bytes(header: dict | bytes, n: int | None = None, data: bytes = b"") -> bytes:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(head) if n is None else n).to_bytes(8, "little") + head + data


HOSTILE_SAFETENSORS = {
    "text": b"hello, this is not a safetensors file\n" * 10,
    "random": np.random.default_rng(0).bytes(4096),
    "empty": b"",
    "short": b"\x01\x02",
    "huge_header_len": _safetensors_bytes(b"{}", n=2**62),
    "header_past_eof": _safetensors_bytes(b"{}", n=5000),
    "header_not_object": _safetensors_bytes(b"[1, 2, 3]   "),
    "header_not_json": _safetensors_bytes(b"{not json}  "),
    "header_not_utf8": _safetensors_bytes(b'{"\xff\xfe": 1}  '),
    "deep_nesting": _safetensors_bytes(b"[" * 100000 + b"]" * 100000),
    "bad_dtype": _safetensors_bytes({"w": {"dtype": "F128", "shape": [2], "data_offsets": [0, 8]}}, data=b"\0" * 8),
    "negative_shape": _safetensors_bytes(
        {"w": {"dtype": "F32", "shape": [-2, -1], "data_offsets": [0, 8]}}, data=b"\0" * 8
    ),
    "offsets_outside": _safetensors_bytes(
        {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, data=b"\0" * 8
    ),
    "offsets_reversed": _safetensors_bytes(
        {"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}, data=b"\0" * 8
    ),
    "entry_not_object": _safetensors_bytes({"w": [1, 2]}),
    "huge_shape": _safetensors_bytes({"w": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 0]}}),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_SAFETENSORS))
def test_hostile_safetensors_files_are_checkpoint_errors(tmp_path, name):
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(HOSTILE_SAFETENSORS[name])
    with pytest.raises(ck.CheckpointError, match="not a valid safetensors file"):
        ck.open_safetensors(path)


def test_bad_trainer_inputs_one_line_exit_2_nothing_written(corpus, tmp_path, capsys, monkeypatch):
    """The issue's cases and their kin: paths, init_from files, config files, env vars."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    text_file = tmp_path / "notes.safetensors"
    text_file.write_text("not safetensors\n")
    st = tmp_path / "st"
    st.mkdir()
    for name, blob in HOSTILE_SAFETENSORS.items():
        (st / name).write_bytes(blob)
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("model:\n  d_model: 64  # größe\n".encode("latin-1"))
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # reading it would block forever
    bad_meta = tmp_path / "bad_meta"
    bad_meta.mkdir()
    for f in ("train.bin", "val.bin"):
        (bad_meta / f).write_bytes((corpus / f).read_bytes())
    meta = json.loads((corpus / "meta.json").read_text())
    (bad_meta / "meta.json").write_text(json.dumps({**meta, "dtype": "object"}))
    tiny = ROOT / "configs" / "tiny.yaml"
    run_dir = tmp_path / "run"
    base = TINY + [f"data.path={corpus}", f"run_dir={run_dir}"]
    cases = [  # (extra overrides, env, config file, words the line must hold)
        (["optimizer.lr=.inf"], {}, tiny, ["optimizer.lr", "finite"]),
        (["lr=-.inf"], {}, tiny, ["optimizer.lr"]),
        (["run_dir="], {}, tiny, ["run_dir"]),
        ([f"run_dir={a_file}"], {}, tiny, ["run_dir", "is a file"]),
        ([f"run_dir={a_file}/sub/run"], {}, tiny, ["run_dir", "under"]),
        (["data.seed=-1"], {}, tiny, ["data.seed"]),
        (["model.attention=cudnn"], {}, tiny, ["model.attention", "xla"]),
        ([f"init_from={text_file}"], {}, tiny, ["init_from", "not a valid safetensors"]),
        ([f"init_from={tmp_path / 'missing.safetensors'}"], {}, tiny, ["init_from"]),
        (["data.source=stdlib", f"data.path={a_file}/sub"], {}, tiny, ["data.path", "under"]),
        (["data.source=stdlib", f"data.path={a_file}"], {}, tiny, ["data.path", "is a file"]),
        ([], {}, latin1, [str(latin1), "UTF-8"]),
        ([], {}, tmp_path, [str(tmp_path), "directory"]),
        ([], {}, tmp_path / "missing.yaml", ["missing.yaml", "not found"]),
        ([], {}, listed, ["list.yaml", "mapping"]),
        ([], {}, fifo, ["fifo.yaml", "regular file"]),
        ([f"data.path={bad_meta}"], {}, tiny, ["meta.json", "uint16"]),
        (["train.steps"], {}, tiny, ["key=value"]),
        (["model.d_model=[64"], {}, tiny, ["model.d_model"]),
        (["trian.steps=3"], {}, tiny, ["trian.steps", "did you mean train.steps"]),
        ([], {"FSDP_JAX_CPU_DEVICES": "0"}, tiny, ["FSDP_JAX_CPU_DEVICES"]),
        ([], {"FSDP_JAX_CPU_DEVICES": "abc"}, tiny, ["FSDP_JAX_CPU_DEVICES"]),
        ([], {"FSDP_JAX_CPU_DEVICES": "-2"}, tiny, ["FSDP_JAX_CPU_DEVICES"]),
        ([], {"FSDP_JAX_INJECT_NAN_STEPS": "abc"}, tiny, ["FSDP_JAX_INJECT_NAN_STEPS"]),
        ([], {"FSDP_JAX_INJECT_NAN_STEPS": "3,0"}, tiny, ["FSDP_JAX_INJECT_NAN_STEPS"]),
        ([], {"FSDP_JAX_NUM_PROCESSES": "abc"}, tiny, ["FSDP_JAX_NUM_PROCESSES"]),
        (
            [],
            {"FSDP_JAX_NUM_PROCESSES": "2", "FSDP_JAX_COORDINATOR": "127.0.0.1:1", "FSDP_JAX_PROCESS_ID": "-1"},
            tiny,
            ["FSDP_JAX_PROCESS_ID"],
        ),
        (
            [],
            {"FSDP_JAX_NUM_PROCESSES": "2", "FSDP_JAX_COORDINATOR": "127.0.0.1:1", "FSDP_JAX_PROCESS_ID": "2"},
            tiny,
            ["process_id 2"],
        ),
        (
            [],
            {"FSDP_JAX_NUM_PROCESSES": "2", "FSDP_JAX_COORDINATOR": "nohost", "FSDP_JAX_PROCESS_ID": "0"},
            tiny,
            ["coordinator", "nohost"],
        ),
        ([], {"FSDP_JAX_NUM_PROCESSES": "2"}, tiny, ["together"]),
        ([], {"SLURM_NTASKS": "abc", "SLURM_JOB_ID": "1"}, tiny, ["SLURM_NTASKS"]),
        ([], {"OMPI_COMM_WORLD_SIZE": "-3"}, tiny, ["OMPI_COMM_WORLD_SIZE"]),
        (
            ["distributed.coordinator=127.0.0.1:99999", "distributed.num_processes=2", "distributed.process_id=0"],
            {},
            tiny,
            ["distributed.coordinator"],
        ),
        (["distributed.num_processes=2", "distributed.process_id=5"], {}, tiny, ["distributed.process_id"]),
    ] + [
        ([f"init_from={st / n}"], {}, tiny, ["init_from", "not a valid safetensors"])
        for n in sorted(HOSTILE_SAFETENSORS)
    ]
    if sys.platform == "linux":  # sysfs refuses new directories, even to root
        cases.append((["run_dir=/sys/fsdp_jax_hostile_run"], {}, tiny, ["run_dir"]))
        cases.append((["data.source=stdlib", "data.path=/sys/fsdp_jax_hostile_data"], {}, tiny, ["data.path"]))
    if hasattr(os, "geteuid") and os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        cases.append(([f"run_dir={ro}/run"], {}, tiny, ["run_dir", "not writable"]))
        cases.append((["data.source=stdlib", f"data.path={ro}/d"], {}, tiny, ["data.path", "not writable"]))
    corpus_before = listing(corpus)
    for extra, env, cfg, words in cases:
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            rc, _, err = call("train", "--config", cfg, "--no-progress", *base, *extra, capsys=capsys)
        try:
            line = one_line(rc, err, *words)
        except AssertionError as e:
            raise AssertionError(f"{extra} {env} {cfg}: {e}") from None
        assert "distributed: distributed" not in line
        assert not run_dir.exists(), (extra, env, listing(run_dir))
    assert listing(corpus) == corpus_before
    assert not Path("/sys/fsdp_jax_hostile_run").exists()


# -- every script's flags ---------------------------------------------------------------------------


@pytest.mark.slow
def test_every_script_rejects_bad_flags_with_one_line(corpus, tmp_path, capsys, monkeypatch):
    tiny = ROOT / "configs" / "tiny.yaml"
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    empty_ckpts = tmp_path / "ckpts"
    empty_ckpts.mkdir()
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"model: {d_model: 64}  # \xe4\n")
    bad_metrics = {}
    for name, text in {
        "notjson": b'{"step": 1, "loss": 2}\n{oops\n',
        "list": b"[1, 2]\n",
        "nostep": b'{"loss": 1.0}\n',
        "latin1": b'{"step": 1}\n\xe4\xe4\n',
        "nologged": b'{"step": 1, "val_loss": 2.0}\n',
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_bytes(text)
        bad_metrics[name] = tmp_path / name
    good_run = tmp_path / "good_run"
    good_run.mkdir()
    (good_run / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": null, "nonfinite": ["loss"]}\n'
    )
    small = ["model.n_layers=2", "model.d_model=64", "model.ffn_dim=128", "model.max_seq_len=32", "data.seq_len=32"]
    table = {
        "train": [
            [],
            ["--config"],
            ["--bogus"],
            ["--config", tiny, "notkeyvalue"],
            ["--config", tmp_path / "none.yaml"],
            ["--config", latin1],
            ["--config", tmp_path],
        ],
        "plan": [
            [],
            ["--config", tiny],
            ["--config", tiny, "--devices", "0"],
            ["--config", tiny, "--devices", "abc"],
            ["--config", tiny, "--devices", "99999999"],
            ["--config", tiny, "--devices", "8", "--device-memory", "1e400GB"],
            ["--config", tiny, "--devices", "8", "--device-memory", "-5GB"],
            ["--config", tiny, "--devices", "8", "--device-memory", "0"],
            ["--config", tiny, "--devices", "8", "--device-memory", "lots"],
            ["--config", tiny, "--devices", "8", "--strategies", "zero9"],
            ["--config", tiny, "--devices", "8", "--strategies", ","],
            ["--config", tiny, "--devices", "8", "--plot", tmp_path],
            ["--config", tiny, "--devices", "8", "--plot", a_file / "x.png"],
            ["--config", tiny, "--devices", "8", "optimizer.lr=.nan"],
            ["--config", latin1, "--devices", "8"],
        ],
        "inspect": [
            ["--config", tiny, "--devices", "8", "--strategy", "full_shard,no_shard"],
            ["--config", tiny, "--devices", "8", "--strategy", "all"],
            ["--config", tiny, "--devices", "8", "--strategy", "zero9"],
            ["--config", tiny, "--devices", "-1"],
            ["--config", tiny, "--devices", "8", "--replicated-threshold", "1e400GB"],
            ["--config", tiny, "--devices", "8", "--replicated-threshold", "big"],
            ["--config", tiny, "--devices", "8", "mesh.data=0"],
        ],
        "export": [
            [tmp_path / "no_run", "--out", tmp_path / "m.safetensors"],
            [empty_ckpts, "--out", tmp_path],
            [empty_ckpts, "--out", tmp_path / "missing_dir" / "m.safetensors"],
            [empty_ckpts, "--out", a_file / "m.safetensors"],
            [empty_ckpts, "--out", tmp_path / "m.safetensors", "--dtype", "float8"],
            [empty_ckpts, "--out", tmp_path / "m.safetensors", "--step", "-1"],
            [empty_ckpts, "--out", tmp_path / "m.safetensors", "--step", "x"],
            [empty_ckpts, "--out", tmp_path / "m.safetensors"],
        ],  # no checkpoint in it
        "prepare": [
            ["--out", a_file, corpus.parent / "src"],
            ["--out", a_file / "sub", corpus.parent / "src"],
            ["--out", tmp_path / "d"],
            ["--out", tmp_path / "d", "--stdlib", "--val-fraction", "2"],
            ["--out", tmp_path / "d", "--stdlib", "--val-fraction", "nan"],
            ["--out", tmp_path / "d", "--stdlib", "--seed", "-1"],
            ["--out", tmp_path / "d", "--bin", a_file],
            ["--out", tmp_path / "d", "--bin", a_file, "--val-bin", a_file, "--vocab-size", "0"],
            ["--out", tmp_path / "d", tmp_path / "no_such_source"],
            ["--out", tmp_path / "d", empty_dir],  # no text in the sources
            ["--out", tmp_path / "d", "--stdlib", "--bogus"],  # an unknown flag
            ["--out", tmp_path / "d", corpus.parent / "src", "--pattern", "/etc/*"],
            ["--out", tmp_path / "d", corpus.parent / "src", "--pattern", "../*"],
        ],
        "plot": [
            [tmp_path / "no_run"],
            *[[d] for d in bad_metrics.values()],
            [good_run, "--out", tmp_path],
            [good_run, "--out", a_file / "x.png"],
        ],
        "benchmark": [
            ["--config", tiny, "--steps", "0"],
            ["--config", tiny, "--warmup", "-1"],
            ["--config", tiny, "--peak-tflops", "-1"],
            ["--config", tiny, "--peak-tflops", "nan"],
            ["--config", tiny, "--peak-tflops", "inf"],
            ["--config", tiny, "--sweep", "devices=abc"],
            ["--config", tiny, "--sweep", "devices=0"],
            ["--config", tiny, "--strategies", "zero9"],
            ["--config", tiny, "--plot", tmp_path, *small],
            ["--config", tiny, "--steps", "x"],
            ["--config", tiny, "model.attention=cudnn", *small],
            ["--config", tiny, "--sweep", "model.n_layers=,"],
            ["--config", tiny, "--sweep", "model.n_layers"],
            ["--config", tiny, "--sweep", "devices=16"],
            ["--config", tiny, "--steps", "1", "train.nope=1"],
            ["--config", "configs/dpo_tiny.yaml", "--baselines"],  # the baselines train next-token loss
        ],
        "gpu_check": [
            ["--only", "speed"],
            ["--steps", "x"],
            ["--steps", "0"],
            ["--config", tiny, "--only", "throughput", "optimizer.lr=-1"],
            ["--only", "precision", "--json", tmp_path],
        ],
        "launch": [
            ["--processes", "0", "--", "true"],
            ["--processes", "abc", "--", "true"],
            ["--processes", "2", "--port", "70000", "--", "true"],
            ["--processes", "2", "--port", "-1", "--", "true"],
            ["--processes", "2", "--grace", "-1", "--", "true"],
            ["--processes", "2", "--grace", "nan", "--", "true"],
            ["--processes", "2"],
            ["--processes", "1", "--", str(tmp_path / "no_such_command")],
        ],
    }
    before = listing(tmp_path)
    for name, rows in table.items():
        for args in rows:
            rc, _, err = call(name, *args, capsys=capsys)
            try:
                one_line(rc, err)
            except AssertionError as e:
                raise AssertionError(f"{name} {[str(a) for a in args]}: {e}") from None
    with monkeypatch.context() as m:  # the environment variables the scripts read
        m.setenv("FSDP_JAX_CPU_DEVICES", "many")
        for name in ("train", "benchmark", "bench_offload"):
            rc, _, err = call(name, "--config", tiny, capsys=capsys)
            one_line(rc, err, "FSDP_JAX_CPU_DEVICES")
    assert listing(tmp_path) == before  # nothing written by any of them
    rc, out, err = call("plot", good_run, "--out", tmp_path / "ok.png", capsys=capsys)
    assert rc == 0 and (tmp_path / "ok.png").is_file(), err  # null (non-finite) losses plot as gaps


def test_missing_optional_packages_are_named(corpus, tmp_path, capsys, monkeypatch):
    """tensorboardX and matplotlib are optional: asking for them without them is one line."""
    import importlib.util

    real = importlib.util.find_spec
    missing = {"tensorboardX", "matplotlib"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))
    for m in missing:
        monkeypatch.setitem(sys.modules, m, None)  # `import m` raises ImportError
    tiny = ROOT / "configs" / "tiny.yaml"
    run = tmp_path / "run"
    rc, _, err = call(
        "train",
        "--config",
        tiny,
        "--no-progress",
        *TINY,
        f"data.path={corpus}",
        f"run_dir={run}",
        "train.tensorboard=true",
        capsys=capsys,
    )
    one_line(rc, err, "train.tensorboard", "tensorboardX")
    assert not run.exists()
    for script, args in (("plan", ["--devices", "8"]), ("benchmark", [])):
        rc, _, err = call(script, "--config", tiny, *args, "--plot", tmp_path / "p.png", capsys=capsys)
        one_line(rc, err, "--plot", "matplotlib")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    rc, _, err = call("plot", tmp_path / "m", capsys=capsys)
    one_line(rc, err, "matplotlib")
    assert listing(tmp_path) == ["m", "m/metrics.jsonl"]


# -- metrics: JSON only, no rows of a dead run, a clear line for a finished run ---------------------


def test_metrics_are_strict_json_with_null_for_nonfinite(tmp_path):
    log = MetricsLog(tmp_path, True, False)
    log.write({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 0.1})
    log.write({"step": 2, "loss": 1.5})

    def refuse(name):
        raise ValueError(f"bare {name} in metrics.jsonl")

    rows = [json.loads(l, parse_constant=refuse) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 1, "loss": None, "grad_norm": None, "lr": 0.1, "nonfinite": ["loss", "grad_norm"]}
    assert rows[1] == {"step": 2, "loss": 1.5}


@pytest.mark.slow
def test_fresh_start_drops_a_dead_runs_rows_and_a_finished_run_says_so(corpus, tmp_path, capsys):
    from fsdp_jax.app.trainer.loop import train

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # A run killed before its first checkpoint left rows 1..4 and no checkpoint.
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "lo'
    )
    cfg = config_lib.load_config(ROOT / "configs" / "tiny.yaml", TINY + [f"data.path={corpus}", f"run_dir={run_dir}"])
    train(cfg, progress=False)

    def train_steps():  # rows of train windows (the goodput summary row has no loss)
        rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [r["step"] for r in rows if "loss" in r]

    assert train_steps() == [1, 2, 3]
    capsys.readouterr()
    again = train(cfg, progress=False)  # again: finished
    out = capsys.readouterr().out
    assert "nothing to do" in out and "nan" not in out.lower()
    assert train_steps() == [1, 2, 3]
    # and it says so without compiling a step it will not run
    assert again["compile_s"] == 0.0 and "compiled in" not in out
    assert again["final_step"] == 3


@pytest.mark.slow
def test_token_ids_outside_the_vocabulary_name_the_data(tmp_path, capsys):
    """A corpus whose meta.json understates its vocabulary: not "3 non-finite steps"."""
    tokens = np.arange(5000, dtype=np.uint16) % 200
    tokens.tofile(tmp_path / "t.bin")
    tokens.tofile(tmp_path / "v.bin")
    prepare_bin(tmp_path / "t.bin", tmp_path / "v.bin", tmp_path / "data", vocab_size=100, check_tokens=False)
    rc, _, err = call(
        "train",
        "--config",
        ROOT / "configs" / "tiny.yaml",
        "--no-progress",
        *TINY,
        f"data.path={tmp_path / 'data'}",
        f"run_dir={tmp_path / 'run'}",
        "model.vocab_size=128",
        capsys=capsys,
    )
    one_line(rc, err, "data.path", "token id", "model.vocab_size=128")


# -- checkpoints: content checksums -----------------------------------------------------------------


def _small_state(seed):
    rng = np.random.default_rng(seed)
    return {
        "w": jax.numpy.asarray(rng.standard_normal((64, 256), np.float32)),
        "b": jax.numpy.asarray(rng.standard_normal((256,), np.float32)),
    }


def _biggest(step_dir: Path) -> Path:
    return max((f for f in (step_dir / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def test_flipped_bytes_that_keep_sizes_are_detected_and_skipped(tmp_path):
    d = tmp_path / "ckpts"
    with ck.Checkpointer(d, keep=None, async_save=False) as c:
        c.save(1, _small_state(1))
        c.save(2, _small_state(2))
    manifest = json.loads((d / "2" / ck.MANIFEST).read_text())
    assert manifest["crc32"].keys() == manifest["files"].keys() and len(manifest["crc32"]) >= 2
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _small_state(0))
    big = _biggest(d / "2")
    blob = bytearray(big.read_bytes())
    size = len(blob)
    blob[size // 2] ^= 0x10  # one bit, in the middle of the arrays' bytes
    big.write_bytes(bytes(blob))
    assert big.stat().st_size == size
    r = ck.Checkpointer(d, read_only=True).restore(target)
    assert r.step == 1 and "step 2" in r.warnings[0] and "changed since it was saved" in r.warnings[0]
    np.testing.assert_array_equal(np.asarray(r.state["w"]), np.asarray(_small_state(1)["w"]))
    # A manifest from before checksums (sizes only) is still honoured.
    m1 = json.loads((d / "1" / ck.MANIFEST).read_text())
    del m1["crc32"]
    (d / "1" / ck.MANIFEST).write_text(json.dumps(m1))
    assert ck.Checkpointer(d, read_only=True).restore(target, step=1).warnings == []
    # Every step damaged -> one CheckpointError (exit 2), never a NaN restore.
    big1 = _biggest(d / "1")
    os.truncate(big1, 4)
    with pytest.raises(ck.CheckpointError, match="no checkpoint restores.*step 2.*changed"):
        ck.Checkpointer(d, read_only=True).restore(target)


# -- faults: a save that fails (disk full) ----------------------------------------------------------


def _final_params(run_dir: Path, step: int):
    c = ck.Checkpointer(run_dir / "checkpoints", read_only=True)
    return {p: c.read_leaf(step, p) for p in c.saved_metadata(step) if p.startswith("params/")}


@pytest.mark.slow
def test_failed_save_stops_with_one_line_keeps_the_previous_checkpoint_and_resumes_exactly(
    corpus, tmp_path, capsys, monkeypatch
):
    """ENOSPC raised inside the background save of step 4 (where a full disk raises it):
    exit 1 at that save with one line, step 2 intact, and the resume ends bit-identical
    to a run that never failed."""
    args = [
        "--config",
        ROOT / "configs" / "tiny.yaml",
        "--no-progress",
        *TINY,
        f"data.path={corpus}",
        "train.steps=6",
        "train.checkpoint_every=2",
    ]
    rc, _, err = call("train", *args, f"run_dir={tmp_path / 'ref'}", capsys=capsys)
    assert rc == 0, err
    real = ck.Checkpointer._write_manifest

    def full_disk(self):
        if self._in_flight and self._in_flight[0] == 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self)

    run_dir = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(ck.Checkpointer, "_write_manifest", full_disk)
        rc, out, err = call("train", *args, f"run_dir={run_dir}", capsys=capsys)
    line = one_line(rc, err, "writing checkpoint step 4", "No space left on device", "step 2, intact", code=1)
    assert "Traceback" not in out
    assert ck.Checkpointer(run_dir / "checkpoints", read_only=True).steps() == [2], line
    rc, out, err = call("train", *args, f"run_dir={run_dir}", capsys=capsys)
    assert rc == 0 and "resuming from checkpoint step 2" in out, err
    a, b = _final_params(tmp_path / "ref", 6), _final_params(run_dir, 6)
    assert a.keys() == b.keys() and a
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.slow
@pytest.mark.skipif(
    not (sys.platform == "linux" and hasattr(os, "geteuid") and os.geteuid() == 0),
    reason="mounts a small tmpfs (root on Linux)",
)
def test_real_full_disk_one_line_then_resume(corpus, tmp_path, capsys):
    """A real ENOSPC from the file system (a 2.5 MB tmpfs) under the trainer's background
    saves: one line, exit 1, the newest complete checkpoint named and intact; with room
    again, the run resumes from it."""
    mnt = tmp_path / "small_fs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2500k", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        args = [
            "--config",
            "configs/tiny.yaml",
            "--no-progress",
            *TINY,
            f"data.path={corpus}",
            f"run_dir={mnt / 'run'}",
            "train.steps=12",
            "train.checkpoint_every=2",
            "train.keep_checkpoints=10",
        ]
        rc, out, err = call("train", *args, capsys=capsys)
        line = one_line(rc, err, "No space left on device", "intact", code=1)
        assert "Traceback" not in out
        steps = ck.Checkpointer(mnt / "run" / "checkpoints", read_only=True).steps()
        assert steps and f"step {steps[-1]}, intact" in line
        subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)
        rc, out, err = call("train", *args, capsys=capsys)
        assert rc == 0 and f"resuming from checkpoint step {steps[-1]}" in out, err[-3000:]
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def test_a_failed_background_save_is_reported_without_another_save(tmp_path, monkeypatch):
    """The loop calls check() every step: the failure shows as soon as the background
    write ends, naming its step, not at the next save (which may be far away)."""

    def full_disk(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ck.Checkpointer, "_write_manifest", full_disk)
    c = ck.Checkpointer(tmp_path / "ckpts", keep=None)
    c.save(7, _small_state(0))
    deadline = time.monotonic() + 60
    with pytest.raises(ck.CheckpointWriteError, match="step 7 .*No space left on device.*none"):
        while time.monotonic() < deadline:
            c.check()
            time.sleep(0.01)
    c.close()  # reported once; closing does not raise it again
    assert c.steps() == []


def test_a_save_in_flight_is_not_called_committed(tmp_path, monkeypatch):
    """Orbax lists a step as soon as its save starts; until the step's directory has its
    final name it is not committed, so a failure message must not call it intact."""
    c = ck.Checkpointer(tmp_path / "ckpts", keep=None)
    c.save(3, _small_state(0))
    c.wait()
    (tmp_path / "ckpts" / f"7{ck.TMP_SUFFIX}").mkdir()  # step 7 being written
    monkeypatch.setattr(c._mngr, "all_steps", lambda *a, **k: [3, 7])
    assert c.steps() == [3] and c.latest_step() == 3
    c._pending = 7
    with pytest.raises(ck.CheckpointWriteError, match="step 7 .*the newest complete checkpoint is step 3, intact"):
        with c._write_errors():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.undo()
    c.close()


def test_unreachable_coordinator_is_one_line_exit_1(corpus, tmp_path, capsys):
    """A peer whose coordinator never answers: JAX's client would abort the process with a
    C++ stack trace; the trainer says so in one line first."""
    import socket

    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        rc, _, err = call(
            "train",
            "--config",
            ROOT / "configs" / "tiny.yaml",
            "--no-progress",
            *TINY,
            f"data.path={corpus}",
            f"run_dir={tmp_path / 'run'}",
            f"distributed.coordinator=127.0.0.1:{port}",
            "distributed.num_processes=2",
            "distributed.process_id=1",
            "distributed.init_timeout_s=1",
            capsys=capsys,
        )
    one_line(rc, err, f"127.0.0.1:{port}", "did not answer", code=1)
    assert not (tmp_path / "run").exists()


def test_environment_failures_and_the_unexpected_are_one_line_exit_1(tmp_path, capsys, monkeypatch):
    """Whatever the run raises that is not bad input: one line, exit 1 (the class, by type)."""
    from fsdp_jax.app.trainer import loop
    from fsdp_jax.errors import DistributedInitError, RunDirBusy

    failures = [
        OSError(errno.ENOSPC, "No space left on device"),
        PermissionError(13, "Permission denied"),
        RunDirBusy("run_dir busy"),
        ck.CheckpointWriteError("writing checkpoint step 4 failed"),
        DistributedInitError("peer died"),
        TrainingDiverged("3 non-finite steps"),
        RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.20TiB\n  more"),
        KeyError("a bug"),
    ]
    args = ["--config", ROOT / "configs" / "tiny.yaml", "--no-progress", f"run_dir={tmp_path / 'run'}"]
    for exc in failures:

        def boom(*a, exc=exc, **k):
            raise exc

        monkeypatch.setattr(loop, "train", boom)
        rc, _, err = call("train", *args, capsys=capsys)
        one_line(rc, err, code=1)
    monkeypatch.setenv("FSDP_JAX_TRACEBACK", "1")
    with pytest.raises(KeyError):
        call("train", *args, capsys=capsys)


# -- faults: two trainers, one run_dir --------------------------------------------------------------


def test_second_trainer_is_refused_naming_the_holder(corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    with RunDirLock(run_dir):
        before = listing(run_dir)
        rc, _, err = call(
            "train",
            "--config",
            ROOT / "configs" / "tiny.yaml",
            "--no-progress",
            *TINY,
            f"data.path={corpus}",
            f"run_dir={run_dir}",
            capsys=capsys,
        )
        one_line(rc, err, "in use by another trainer", f"pid {os.getpid()}", "host", code=1)
        assert listing(run_dir) == before == [LOCK_NAME]
    with RunDirLock(run_dir):  # released: the next one gets it
        pass


def test_a_failed_start_leaves_no_run_dir(tmp_path):
    run_dir = tmp_path / "new" / "run"
    with pytest.raises(RuntimeError, match="boom"):
        with RunDirLock(run_dir):
            (run_dir / "checkpoints").mkdir()
            raise RuntimeError("boom")
    assert not run_dir.exists()


@pytest.mark.slow
def test_lock_of_a_killed_trainer_does_not_block_the_resume(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import time
            from fsdp_jax.app.trainer.run_dir import RunDirLock
            with RunDirLock({str(run_dir)!r}):
                print("LOCKED", flush=True)
                time.sleep(300)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"),
    )
    try:
        assert holder.stdout.readline().strip() == "LOCKED"
        from fsdp_jax.errors import RunDirBusy

        with pytest.raises(RunDirBusy, match=f"pid {holder.pid} "):
            with RunDirLock(run_dir):
                pass
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        holder.kill()
    assert str(holder.pid) in (run_dir / LOCK_NAME).read_text()  # the stale record is still there
    with RunDirLock(run_dir):  # ... and does not block
        assert str(os.getpid()) in (run_dir / LOCK_NAME).read_text()


# -- the coordinator listens on loopback; the lock is process 0's ---------------------------------


def test_bind_address_rules(monkeypatch):
    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    assert bind_address("127.0.0.1:1234") == "127.0.0.1:1234"
    assert bind_address("localhost:1234") == "localhost:1234"
    assert bind_address("[::1]:1234") == "[::1]:1234"
    assert bind_address("10.0.0.5:1234") is None  # multi-host: JAX's default unless told
    assert bind_address("10.0.0.5:1234", {"JAX_COORDINATOR_BIND_ADDRESS": "10.0.0.5:1234"}) == "10.0.0.5:1234"
    assert is_loopback("::ffff:127.0.0.1") and not is_loopback("0.0.0.0") and not is_loopback("node-1")


LISTEN_SCRIPT = textwrap.dedent("""
    import ipaddress, os, sys, jax
    jax.config.update("jax_num_cpu_devices", int(os.environ["FSDP_JAX_CPU_DEVICES"]))
    from fsdp_jax.multihost.distributed import maybe_initialize
    maybe_initialize()
    port = int(os.environ["FSDP_JAX_COORDINATOR"].rsplit(":", 1)[1])

    def listening(port):  # /proc/net/tcp{,6}: state 0A = LISTEN; addresses as 32-bit words
        out = []
        for name in ("tcp", "tcp6"):
            with open(f"/proc/net/{name}") as f:
                rows = f.read().splitlines()[1:]
            for row in rows:
                fields = row.split()
                addr, p = fields[1].split(":")
                if fields[3] == "0A" and int(p, 16) == port:
                    b = bytes.fromhex(addr)
                    ip = ipaddress.ip_address(b"".join(b[i:i + 4][::-1] for i in range(0, len(b), 4)))
                    out.append(str(getattr(ip, "ipv4_mapped", None) or ip))
        return out

    from fsdp_jax.app.trainer.run_dir import RunDirLock
    with RunDirLock(sys.argv[1]):  # process 0 holds it; process 1 must not be refused
        # one write per line: the launcher runs children unbuffered, so print's separate writes
        # of "LISTEN", " " and the list can have Gloo's own log line land between them
        if jax.process_index() == 0:
            sys.stdout.write(f"LISTEN {sorted(listening(port))}\\n")
        sys.stdout.write(f"ENTERED {jax.process_index()}\\n")
        sys.stdout.flush()
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("fsdp_jax:test_done")
""")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp")
def test_local_launch_coordinator_listens_on_loopback_only(tmp_path):
    script_file = tmp_path / "listen.py"
    script_file.write_text(LISTEN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "JAX_COORDINATOR_BIND_ADDRESS"}
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "launch.py"),
            "--processes",
            "2",
            "--devices-per-process",
            "2",
            "--",
            sys.executable,
            str(script_file),
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=dict(env, PYTHONPATH=str(ROOT)),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    listen = [l for l in r.stdout.splitlines() if "LISTEN" in l]
    assert len(listen) == 1, r.stdout[-3000:]
    addresses = ast.literal_eval(listen[0].split("LISTEN", 1)[1].strip())
    assert addresses and all(is_loopback(a) for a in addresses), addresses
    assert "[0] ENTERED 0" in r.stdout and "[1] ENTERED 1" in r.stdout
