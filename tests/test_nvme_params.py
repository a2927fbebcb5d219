"""`offload: optimizer+params:nvme` in the trainer (`fsdp_jax.app.trainer.params_nvme`): the
scanned layers' params, optimizer state and grads in layer files, the forward and backward fed a
layer at a time (`fsdp_jax.nvme.layerwise`).

The run parity runs in two children on one CPU device (`runs`): two tests' runs with no FMA (as
tests/test_nvme.py's `parity_env` explains), SimPO's on XLA's default emitters and level. Kill -9 mid step, then the same command:
tests/test_nvme.py's kill test, parametrized over both nvme offloads."""

import json
import os

import numpy as np
import pytest
from test_nvme import parity_env
from test_offload import ROOT

from fsdp_jax.app.trainer.params_nvme import REFUSALS
from helpers import TINY_RUN_OVERRIDES, call, eos_corpus, json_child, one_line, packed_corpus

# The child: benchmarks/nvme_params_run.py once per test (the same tiny run without offload, with
# optimizer+params:nvme straight through, stopped after step 2 and launched again, and the pair
# with 2 microbatches or more overrides; each run's rows and stdout, the nvme runs' final
# checkpoints against their reference's, the files), all in one process (one Python and JAX
# start-up and one import of the trainer, not one a test): {test: its JSON document}
_CHILD = r"""
import contextlib, io, json, sys
sys.path.insert(0, "benchmarks")
import nvme_params_run as b
out = {}
for name, argv in json.loads(sys.argv[1]).items():
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert b.main(argv) == 0, name
    out[name] = json.loads(text.getvalue().strip().splitlines()[-1])
print(json.dumps(out))
"""
CACHE = ROOT / ".jax_cache"
BF16 = "precision=params=float32,compute=bfloat16"
PAIRS = [{"prompt": f"reverse w{i}: ", "chosen": f"{i}w\n", "rejected": f"w{i}\n"} for i in range(32)]


def _argv(name: str, corpus, tmp) -> list[str]:
    """The benchmark's arguments for test `name`'s runs (their inputs written under `tmp`)."""
    if name == "params_on_disk":
        return ["--corpus", str(corpus), "--out", str(tmp / name), "--resume", "--microbatches", "2"]
    if name == "bf16":
        eos, packed = eos_corpus(corpus, tmp / "eos"), packed_corpus(tmp / "packed")
        args = ["--corpus", str(eos), "--out", str(tmp / name), "--resume", "--packed", str(packed)]
        return [*args, BF16, "data.document_mask=true"]
    pairs = tmp / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(x) + "\n" for x in PAIRS))
    args = ["--corpus", str(pairs), "--out", str(tmp / name), "--resume", "--microbatches", "2"]
    args += ["--pair-with", "objective=orpo", "--pair-with", "preference.packing=true"]
    return [*args, "--pair-with", "preference.max_length=16", "objective=simpo", "preference.cpo_alpha=0.5",
            f"preference.eval_path={pairs}"]  # fmt: skip


def _default_level_env() -> dict:
    """XLA:CPU's default emitters at XLA's default level (LLVM -O2), as a run gets them: SimPO's
    child. At the suite's level 0, even with no FMA, SimPO's step-4 grad norm was 1 ulp off
    the run without offload's (BENCHMARKS.md "Issue 55 item 6, nvme and streamed parity on the
    suite's flags")."""
    drop = ("--xla_cpu_use_fusion_emitters", "--xla_backend_optimization_level")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(drop)]
    return dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")


@pytest.fixture(scope="module")
def runs(request, corpus, tmp_path_factory) -> dict:
    """The runs of this session's tests among `RUN_TESTS`: params_on_disk's and bf16's in one
    child with no FMA at the suite's level 0 (`parity_env`; with FMAs contracted there the grad
    norm's per-layer sum of squares rounded 1 ulp off the scanned step's at step 3, and clipping
    (active) carried it into every param, docs/offload.md "Params on disk", so each test's child
    ran at XLA's default level) and XLA's excess bf16 precision off (the bf16 test's bounds are
    measured so, docs/offload.md "bf16 compute and packed rows"; the f32 runs' bit-for-bit
    assertions hold with it too); SimPO's in a child of its own, as before
    (`_default_level_env`). One CPU device each."""
    selected = {i.originalname for i in request.session.items if i.module is request.module}
    tmp = tmp_path_factory.mktemp("nvme_params")
    flags = [*parity_env()["XLA_FLAGS"].split(), "--xla_allow_excess_precision=false"]
    envs = {"level0": dict(parity_env(), XLA_FLAGS=" ".join(flags)), "default": _default_level_env()}
    out = {}
    for group, env in envs.items():
        cases = {n: _argv(n, corpus, tmp) for n, (g, test) in RUN_TESTS.items() if g == group and test in selected}
        if cases:
            env = dict(env, FSDP_JAX_CPU_DEVICES="1", FSDP_JAX_CACHE_DIR=str(CACHE))
            out.update(json_child(_CHILD, json.dumps(cases), env=env))
    return out


# {runs: (its child, its test)}
RUN_TESTS = {
    "params_on_disk": ("level0", "test_params_on_disk_trains_resumes_and_checkpoints_bit_for_bit"),
    "bf16": ("level0", "test_bf16_document_masked_and_packed_rows_on_disk"),
    "simpo": ("default", "test_simpo_and_orpo_with_params_on_disk"),
}


@pytest.mark.slow  # 6 tiny runs (one device) in a `runs` child
def test_params_on_disk_trains_resumes_and_checkpoints_bit_for_bit(runs):
    r = runs["params_on_disk"]
    assert r["devices"] == 1
    plain = r["rows"]["plain"]
    assert [x["step"] for x in plain if "loss" in x] == [1, 2, 3, 4] and any("val_loss" in x for x in plain)
    keys = ("step", "loss", "grad_norm", "val_loss")

    def same(rows):
        return [{k: x[k] for k in keys if k in x} for x in rows if "loss" in x or "val_loss" in x]

    # losses, grad norms (clipping active: 2.1-2.3 over clip_norm 1.0) and val losses equal, bit
    # for bit (the run stopped after step 2 skipped that step's eval, as any stopping run does;
    # launched again it logs steps 3-4 and their eval)
    assert same(r["rows"]["nvme"]) == same(plain)
    resumed = {(x["step"], k): x[k] for x in same(r["rows"]["resumed"]) for k in x if k != "step"}
    want = {(x["step"], k): x[k] for x in same(plain) for k in x if k != "step"}
    assert resumed == {k: v for k, v in want.items() if k != (2, "val_loss")}
    for name in ("nvme", "resumed"):  # the final checkpoints (streamed out of the files) equal, every leaf
        f = r["final"][name]
        assert f["step"] == 4 and f["leaves"] > 30 and f["differ"] == {}, f
    # 2 microbatches (the layers' grads summed through their files): step 1's loss bit for bit (the
    # same init and batch through the same layer programs as the pair above). Not bit for bit after
    # it: the grads themselves differ in their last bits (the scanned step computes each slice in
    # one scan body with the accumulation, here each slice runs the layer programs; which bits
    # depends on XLA:CPU's codegen for the CPU), so from step 2 the params differ and the losses,
    # grad norms and val losses are functions of other params: within 1e-6 relative, twice the
    # largest final-leaf difference measured (5.1e-7; 4.3e-7 without clipping) and ten times the
    # largest row difference (the step-3 loss 9.0e-8, 1 ulp, on an AVX-512 AMD EPYC; 0 on the
    # earlier machine, where the step-1 grad norm was 1 ulp off). docs/offload.md "Params on disk"
    mb = [same(r["rows"][n]) for n in ("nvme_mb", "plain_mb")]
    assert [sorted(x) for x in mb[0]] == [sorted(x) for x in mb[1]] and len(mb[0]) == 6
    assert mb[0][0]["step"] == 1 and mb[0][0]["loss"] == mb[1][0]["loss"]
    for k in ("loss", "grad_norm", "val_loss"):
        x, y = ([v[k] for v in t if k in v] for t in mb)
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=0, err_msg=f"2 microbatches: {k}")
    assert r["final"]["nvme_mb"]["step"] == 4 and max(r["final"]["nvme_mb"]["differ"].values(), default=0) < 1e-6
    out = r["stdout"]
    assert "resuming from checkpoint step 2" in out["resumed"] and "resuming" not in out["nvme"]

    def sample(text):  # the end-of-run sample (under nvme: the params read out of the files)
        return text.split("\nsample:")[1].split("\ngoodput")[0]

    assert sample(out["nvme"]) == sample(out["plain"]) == sample(out["resumed"]) != ""
    assert r["files"] == sorted(
        [f"fsdp_jax_nvme.{k}.p0.json" for k in ("grads", "params", "state")]
        + [f"{k}{i:05d}.p0.bin" for k in ("grads", "params", "state") for i in (0, 1)]
    )


def _same(rows, keys=("step", "loss", "grad_norm", "val_loss")):
    return [{k: x[k] for k in keys if k in x} for x in rows if "loss" in x or "val_loss" in x]


@pytest.mark.slow  # 6 tiny runs (one device) in a `runs` child
def test_bf16_document_masked_and_packed_rows_on_disk(runs):
    """bf16 compute over f32 masters (each layer's masters read from its file, cast for compute,
    grads back in f32) with document-masked windows (each line a document: segment ids and
    positions through every layer's forward and backward, a token-sum loss), straight through and
    stopped after step 2 then launched again, and packed fine-tuning rows: against the run
    without offload, step 1's loss bit for bit (same init and batch: the cast, the segments and
    positions and the token-sum loss in the forward) and the rest within bounds a few times what
    docs/offload.md "bf16 compute and packed rows" measured (not bit for bit: the grads differ in
    their last bits, and a last-bit difference of an f32 master flips its bf16 rounding now and
    then, which grows over the steps; XLA's excess bf16 precision is off here, as there); the
    resumed run equals the straight run with the params on disk bit for bit."""
    r = runs["bf16"]
    rows = r["rows"]
    for got, ref in (("nvme", "plain"), ("nvme_packed", "plain_packed")):
        a, b = _same(rows[got]), _same(rows[ref])
        assert [x["step"] for x in b if "loss" in x] == [1, 2, 3, 4] and [len(x) for x in a] == [len(x) for x in b]
        assert a[0]["loss"] == b[0]["loss"], got  # the same init and batch: the forward bit for bit
        # measured (document-masked rows, the larger): losses 1.9e-6, grad norms 6.5e-6, val losses 2.9e-5
        for k, rtol in (("loss", 1e-5), ("grad_norm", 5e-5), ("val_loss", 1e-4)):
            x, y = ([v[k] for v in t if k in v] for t in (a, b))
            np.testing.assert_allclose(x, y, rtol=rtol, atol=0, err_msg=f"{got} {k}")
        f = r["final"][got]  # every param / optimizer-state leaf: measured within 1.5e-4 / 3.7e-3
        assert f["step"] == 4 and f["leaves"] > 30, (got, f)
        assert max(v for n, v in f["differ"].items() if n.startswith(".params")) < 1e-3, (got, f)
        assert max(f["differ"].values(), default=0) < 2e-2, (got, f)
    # resume: the stopped and relaunched run equals the straight run with the params on disk, bit for
    # bit (its rows, without the step-2 eval a stopping run skips, and every leaf of its final checkpoint)
    resumed = {(x["step"], k): x[k] for x in _same(rows["resumed"]) for k in x if k != "step"}
    want = {(x["step"], k): x[k] for x in _same(rows["nvme"]) for k in x if k != "step"}
    assert resumed == {k: v for k, v in want.items() if k != (2, "val_loss")}
    f = r["final"]["resumed"]
    assert f["step"] == 4 and f["leaves"] > 30 and f["differ"] == {}, f
    assert "resuming from checkpoint step 2" in r["stdout"]["resumed"]


# what a preference row records besides timings: the loss and TRL's metrics
_PREF = (
    "loss",
    "grad_norm",
    "val_loss",
    "nll_loss",
    "log_odds_ratio",
    "log_odds_chosen",
    "rewards/",
    "logps/",
    "logits/",
)


def _pref_rows(rows):
    keep = [x for x in rows if "loss" in x or "val_loss" in x]
    return [{k: v for k, v in x.items() if k == "step" or k.startswith(_PREF) or k.startswith("eval_")} for x in keep]


@pytest.mark.slow  # 9 tiny preference runs (one device) in a `runs` child of their own
def test_simpo_and_orpo_with_params_on_disk(runs):
    """The reference-free preference losses (one policy pass: the layer pieces' head scores the
    pairs' logits and returns TRL's metrics) against the runs without offload, 4 steps, eval at 2
    and 4: SimPO with CPO's NLL (cpo_alpha 0.5) straight through, every row (loss, grad norm,
    rewards/*, logps/*, logits/*, nll_loss, eval_*) and every leaf of the final checkpoint bit for
    bit; stopped after step 2 and launched again, equal to the straight run bit for bit; with 2
    microbatches (the slices' metrics stacked as the scanned step's scan stacks them) and ORPO on
    packed pairs (a TokenSum over pairs through every layer's segments): within the bounds below,
    a few times docs/offload.md's measured figures (step 1's loss bit for bit)."""
    r = runs["simpo"]
    rows = {n: _pref_rows(v) for n, v in r["rows"].items()}
    plain = rows["plain"]
    assert [x["step"] for x in plain if "loss" in x] == [1, 2, 3, 4] and plain[0]["nll_loss"] > 0
    assert {"rewards/margins", "logps/chosen", "logits/rejected"} <= set(plain[0])
    assert rows["nvme"] == plain
    assert rows["resumed"] == [x for x in rows["nvme"] if not (x["step"] == 2 and "val_loss" in x)]
    for name in ("nvme", "resumed"):
        f = r["final"][name]
        assert f["step"] == 4 and f["leaves"] > 30 and f["differ"] == {}, f
    assert "resuming from checkpoint step 2" in r["stdout"]["resumed"]
    # measured (docs/offload.md "SimPO and ORPO"): 2 microbatches, losses and grad norms bit for bit, the
    # metrics within 1e-6 relative (rewards/margins, a difference of small means), the final leaves 3.8e-7;
    # ORPO on packed pairs: losses bit for bit, grad norms 1 ulp, metrics 4.4e-6, final leaves 5.6e-7
    for got, ref in (("nvme_mb", "plain_mb"), ("nvme_with", "plain_with")):
        a, b = rows[got], rows[ref]
        assert [sorted(x) for x in a] == [sorted(x) for x in b] and len(a) == 6, got
        assert a[0]["loss"] == b[0]["loss"], got
        if got == "nvme_with":
            assert "log_odds_ratio" in b[0] and "packed 32 pairs into 32 rows" in r["stdout"][ref]  # ORPO, packed
        for x, y in zip(a, b):
            for k in y:
                np.testing.assert_allclose(x[k], y[k], rtol=2e-5, atol=1e-7, err_msg=f"{got} step {y['step']} {k}")
        f = r["final"][got]
        assert f["step"] == 4 and f["leaves"] > 30 and max(f["differ"].values(), default=0) < 1e-6, (got, f)


# ------------------------------------------------------------------ what it does not run yet

# (overrides, the REFUSALS entry its line carries): each refused in one line, exit 2, before
# anything is written (no run dir, the offload dir left empty)
NOT_YET = [
    ("model.n_experts=4 model.experts_per_token=2 model.moe_ffn_dim=32", "model.n_experts"),
    ("model.mtp_depth=1", "model.mtp_depth"),
    ("lora.rank=4", "lora"),
    ("precision=params=float32,compute=bfloat16,matmul=fp8 fp8.emulate=true", "precision"),
    ("mesh.strategy=shard_grad_op", "mesh.strategy"),
    ("remat=offload_dots_no_batch", "remat"),
    ("mesh.context=2", "mesh"),
    ("objective=dpo", "objective"),
]


@pytest.mark.parametrize("override,what", NOT_YET, ids=[w for _, w in NOT_YET])
def test_what_the_layerwise_step_does_not_run_is_one_line(tmp_path, capsys, override, what):
    d = tmp_path / "disk"
    d.mkdir()
    args = ["--config", "configs/tiny.yaml", *TINY_RUN_OVERRIDES, f"run_dir={tmp_path / 'run'}"]
    rc, out, err = call(
        "train", *args, "offload=optimizer+params:nvme", f"offload_dirs={d}", *override.split(), capsys=capsys
    )
    why = dict(REFUSALS)["model" if what.startswith("model.") else what]
    line = one_line(rc, err, why)
    assert what in line or what == "model.n_experts" and "n_experts" in line
    assert not (tmp_path / "run").exists() and not any(d.iterdir())


def test_every_refusal_is_tested():
    tested = {"model" if w.startswith("model.") else w for _, w in NOT_YET}
    assert tested == set(dict(REFUSALS))


def test_params_on_disk_without_dirs_is_one_line(tmp_path, capsys):
    args = ["--config", "configs/tiny.yaml", *TINY_RUN_OVERRIDES, f"run_dir={tmp_path / 'run'}"]
    rc, out, err = call("train", *args, "offload=optimizer+params:nvme", capsys=capsys)
    one_line(rc, err, "offload_dirs")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ the files: bad input


def _sets(n_layers=2):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import fsdp_jax as fj
    from fsdp_jax.nvme import Layout

    s = NamedSharding(fj.make_mesh(fsdp=8), P(None, "fsdp"))
    lay = Layout.of([jax.ShapeDtypeStruct((n_layers, 64, 8), np.float32, sharding=s)])
    return {"params": lay, "state": Layout.of([jax.ShapeDtypeStruct((n_layers, 64, 8, 2), np.float32, sharding=s)]),
            "grads": lay}  # fmt: skip


def test_params_state_and_grads_files_are_checked_together_before_any_claim(tmp_path, monkeypatch):
    """`LayerFiles.open_sets` (what `LayerwiseStep` opens): room for all three sets together (the
    bytes named), another run's or another shape's files in any one set, a path that is not a
    directory: one OffloadError, and no claim or file written for any set."""
    from fsdp_jax.errors import OffloadError
    from fsdp_jax.nvme import LayerFiles
    from fsdp_jax.nvme import layer_files as lf_lib

    sets = _sets()
    need = sum(lay.n_layers * lay.nbytes for lay in sets.values())

    class Room:  # room for the params alone, not for all three sets
        f_bavail, f_frsize = sets["params"].n_layers * sets["params"].nbytes // 4096, 4096

    with monkeypatch.context() as m:
        m.setattr(lf_lib.os, "statvfs", lambda _: Room)
        (tmp_path / "one").mkdir()
        LayerFiles.open([tmp_path / "one"], sets["params"], owner="a", kind="params")  # one set fits
        with pytest.raises(OffloadError, match=f"needs {need} bytes .* params, state, grads"):
            LayerFiles.open_sets([tmp_path], sets, owner="a")
    assert list(tmp_path.glob("fsdp_jax_nvme*")) == []  # nothing claimed
    d = tmp_path / "d"
    d.mkdir()
    LayerFiles.open([d], sets["state"], owner="a", kind="state")  # one set's claim, another run's
    before = sorted(p.name for p in d.iterdir())
    with pytest.raises(OffloadError, match="another run"):
        LayerFiles.open_sets([d], sets, owner="b")
    with pytest.raises(OffloadError, match="another state shape"):
        LayerFiles.open_sets([d], _sets(n_layers=3), owner="a")
    assert sorted(p.name for p in d.iterdir()) == before  # no params or grads claim written
    (tmp_path / "f").write_text("x")
    with pytest.raises(OffloadError, match="not a directory"):
        LayerFiles.open_sets([d, tmp_path / "f"], sets, owner="a")
    assert sorted(p.name for p in d.iterdir()) == before


def test_params_on_disk_with_a_file_for_a_dir_is_one_line(corpus, tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    args = ["--config", "configs/tiny.yaml", *TINY_RUN_OVERRIDES, f"data.path={corpus}", f"run_dir={tmp_path / 'run'}"]
    rc, out, err = call(
        "train", *args, "offload=optimizer+params:nvme", f"offload_dirs={tmp_path / 'f'}", capsys=capsys
    )
    one_line(rc, err, "offload_dirs", "not a directory")
    assert (tmp_path / "f").read_text() == "x"


def test_the_files_leaves_are_restored_and_saved_under_a_checkpoints_names(tmp_path):
    """What the run's checkpoints depend on, without a compile: the leaves the files hold are the
    params' blocks and AdamW's mu / nu of them, named as a checkpoint of a run without offload
    names them, and a resume leaves exactly those unread for the files' rebuild."""
    from fsdp_jax.app.trainer.build import build_from_config, make_loss_fn, trainer_model
    from fsdp_jax.app.trainer.optim import build_optimizer
    from fsdp_jax.app.trainer.params_nvme import ParamsNvmeStep
    from fsdp_jax.app.trainer.setup import load_run_config
    from fsdp_jax.checkpoint.manifest import tree_paths
    from fsdp_jax.checkpoint.shard_files import Unread
    from fsdp_jax.sharding.mesh import make_mesh

    cfg = load_run_config("configs/tiny.yaml", [*TINY_RUN_OVERRIDES, "offload=optimizer+params:nvme"])
    model = trainer_model(cfg.model, cfg.remat)
    opt, _ = build_optimizer(cfg.optimizer, cfg.train.steps)
    built = build_from_config(cfg, model, opt, make_mesh(fsdp=8), loss_fn=make_loss_fn(model, cfg.model))
    nv = ParamsNvmeStep(cfg, built, model, [tmp_path], owner="t")
    names = list(tree_paths(built.abstract_state))
    blocks = [n.removeprefix("params/") for n in names if n.startswith("params/blocks/")]
    assert len(blocks) == 9 and nv._param_names == [f"params/{b}" for b in blocks]
    assert nv._state_names == [f"opt_state/0/{m}/{b}" for m in ("mu", "nu") for b in blocks]
    target = tree_paths(nv.restore_target(built.abstract_state))
    assert [n for n, x in target.items() if isinstance(x, Unread)] == nv._param_names + nv._state_names
    assert list(target) == names  # the same tree: a checkpoint of either restores into the other
    nv.close()
