"""Tiny models and a single-device reference trainer shared by the tests."""

import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fsdp_jax.app.data.corpus import prepare_text
from fsdp_jax.app.models import Decoder, DecoderConfig, cross_entropy
from fsdp_jax.model.fns import from_nnx

ROOT = Path(__file__).resolve().parents[1]

# configs/tiny.yaml shrunk to compile in seconds: the model, sequence and batch
TINY_MODEL_OVERRIDES = [
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "model.max_seq_len=32",
    "data.seq_len=32",
    "train.global_batch=16",
]
# ... run on a prepared corpus (the `corpus` fixture): no eval or sample, every step logged
TINY_RUN_OVERRIDES = TINY_MODEL_OVERRIDES + [
    "train.eval_every=0",
    "train.sample_tokens=0",
    "train.log_every=1",
    "data.source=none",
    "optimizer.warmup_steps=2",
]

TINY = DecoderConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)


def tiny_llama(cfg: DecoderConfig = TINY, remat: str = "none"):
    """(ModelFns, loss_fn(params, tokens (B, S+1)))."""
    m = from_nnx(lambda r: Decoder(cfg, rngs=r, remat=remat))

    def loss_fn(params, tokens):
        return cross_entropy(m.apply(params, tokens[:, :-1]), tokens[:, 1:])

    return m, loss_fn


def token_batches(n: int, batch: int = 16, seq: int = 32, vocab: int = 256, seed: int = 1):
    """Learnable sequences: start + stride * position (mod vocab), random start and stride."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        start = rng.integers(0, vocab, (batch, 1))
        stride = rng.integers(1, 4, (batch, 1))
        out.append(jnp.asarray((start + stride * np.arange(seq + 1)) % vocab, jnp.int32))
    return out


def reference_train(loss_fn, optimizer, params, batches, clip_norm=None):
    """Plain single-device training: no mesh, no sharding. Returns (params, losses)."""
    dev = jax.devices()[0]
    params = jax.device_put(params, dev)
    opt_state = jax.jit(optimizer.init)(params)  # one program, not an eager op per leaf shape

    @jax.jit
    def step(p, s, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        if clip_norm:
            g, _ = optax.clip_by_global_norm(clip_norm).update(g, optax.EmptyState())
        u, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    losses = []
    for b in batches:
        params, opt_state, loss = step(params, opt_state, jax.device_put(b, dev))
        losses.append(float(loss))
    return params, losses


def max_abs_diff(a, b) -> float:
    """Largest absolute difference over matching leaves (compared on the host)."""
    return max(
        float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def synthetic_corpus(out: Path) -> Path:
    """Deterministic text, independent of the Python version (unlike the stdlib corpus)."""
    src = out / "src"
    src.mkdir(parents=True)
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "value", "index", "import", "class", "None", "for", "in"]
    for f in range(6):
        lines = [
            f"{rng.choice(words)} {rng.choice(words)}_{rng.integers(100)}(x): return x * {i % 7}" for i in range(400)
        ]
        (src / f"m{f}.py").write_text("\n".join(lines) + "\n")
    prepare_text([src], out / "data", val_fraction=0.2, pattern="*.py")
    return out / "data"


_SCRIPTS: dict = {}


def eos_corpus(corpus: Path, out: Path) -> Path:
    """A copy of a byte corpus whose meta.json names the newline its EOS: each line a document
    (for data.document_mask)."""
    shutil.copytree(corpus, out)
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "eos_id": ord("\n")}))
    return out


def packed_corpus(out: Path, row_len: int = 32) -> Path:
    """Packed fine-tuning rows of `row_len` tokens (`fsdp_jax.app.data.sft`): 240 short
    prompt / completion pairs, several to a row, 25% of the examples held out."""
    from fsdp_jax.app.data.sft import prepare_examples

    out.mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = [{"prompt": f"Q{i}: " + "ab" * int(rng.integers(1, 6)), "completion": f" A{i % 7}"} for i in range(240)]
    (out / "ex.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_examples([out / "ex.jsonl"], out / "sft", row_len=row_len, val_fraction=0.25)
    return out / "sft"


def _load(folder: str, name: str):
    name = name.removesuffix(".py")
    if (folder, name) not in _SCRIPTS:
        spec = importlib.util.spec_from_file_location(f"_{folder}_{name}", ROOT / folder / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _SCRIPTS[folder, name] = mod
    return _SCRIPTS[folder, name]


def script(name: str):
    """The command module behind scripts/<name>.py (`fsdp_jax.app.cli.entry.SCRIPTS`: the
    script is a shim over its `main`), to call `main(argv)` in process."""
    from fsdp_jax.app.cli.entry import SCRIPTS, command_module

    return command_module(SCRIPTS[name.removesuffix(".py")])


def example(name: str):
    """examples/<name>.py as a module (loaded once): its model, data and `main`."""
    return _load("examples", name)


def call(name: str, *args, capsys, env: dict | None = None):
    """(exit code, stdout, stderr) of scripts/<name>.py's main(args) (its command module), in this process (its 8 CPU
    devices, the repo root as working directory, `env` set for the call). One subprocess test
    per script keeps the `if __name__ == "__main__"` entry covered; the tables of bad input run
    here, without a Python start-up each."""
    capsys.readouterr()
    old_env = {k: os.environ.get(k) for k in (env or {})}
    cwd = os.getcwd()
    os.environ.update(env or {})
    os.chdir(ROOT)
    try:
        rc = script(name).main([str(a) for a in args])
    except SystemExit as e:  # a parser that exits on its own
        rc = e.code
    finally:
        os.chdir(cwd)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(rc, err, *words, code=2):
    """The bad-input contract: exit `code`, one non-empty line on stderr, `error: ...` naming
    `words`, no traceback. Returns the line."""
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == code, (rc, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    for w in words:
        assert str(w) in lines[0], (w, lines[0])
    return lines[0]


def weight_shaped_results(hlo: str, shapes) -> list[str]:
    """The compiled HLO's ops (dots, convolutions, scatters, reduce-scatters, all-reduces) whose
    result has one of `shapes`: where a frozen weight's gradient would be computed."""
    out = []
    for line in hlo.splitlines():
        m = re.search(r"=\s*\w+\[([\d,]+)\]\{?[^ ]*\s+(dot|convolution|scatter|all-reduce|reduce-scatter)\(", line)
        if m and tuple(int(d) for d in m.group(1).split(",")) in shapes:
            out.append(line.strip()[:160])
    return out


def json_child(code: str, *args: str, env: dict) -> dict:
    """The JSON document a `python -c code args...` child prints last, run from the repo root
    with `env`; a failed child fails the test with the tail of its stderr."""
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=ROOT, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# The analytic memory model against XLA:CPU's compiled peak (tests/test_moe_memory.py,
# tests/test_context_memory.py), with the tolerance of the dense model's GPU test
# (tests/test_targets.py, PEAK_TOLERANCE 10%):
# * never under the compiled peak by more than 5% (an estimate under the peak is a plan that
#   runs out of memory, so that side is held tighter);
# * over it by at most 10%, once two dense terms are taken out that the model adds as if live
#   at the layer backward's peak and XLA:CPU never holds there: the head (logits and their
#   gradient, freed before the layer loop's backward starts) and the prefetched next layer
#   (full_shard's second gathered layer: XLA:GPU prefetches it, XLA:CPU gathers in place).
# Both are the dense model's terms (memory_model.py), not the MoE / context ones held here.
PEAK_UNDER, PEAK_OVER = 0.05, 0.10


def assert_analytic_holds_the_cpu_peak(build, analytic: dict, peak: int, label) -> None:
    """`analytic` (memory_model.analytic_memory of `build`) against XLA:CPU's compiled `peak`."""
    # imported here: the planner's modules stay out of the many tests that import helpers
    from fsdp_jax.app.planner.gathered_memory import compute_copy_bytes
    from fsdp_jax.app.planner.memory_model import activation_bytes
    from fsdp_jax.sharding.precision import Policy

    cfg, mesh = build.cfg, build.mesh.shape
    dtype = Policy.parse(cfg.precision).compute_dtype
    rows = cfg.train.global_batch // cfg.train.microbatches // (mesh.get("data", 1) * mesh.get("fsdp", 1))
    head = activation_bytes(cfg.model, cfg.remat, rows, cfg.data.seq_len, dtype, context=mesh.get("context", 1))
    prefetched = compute_copy_bytes(build.state.params, build.plan, build.model.logical_axes, dtype)["layer"]
    low = analytic["total"] / peak
    # the phase that makes the total (memory_model: the layer backward's or one layer's gradient
    # reduction); the two dense terms are the layer backward's only
    fixed = analytic["params"] + analytic["grads"] + analytic["optimizer"] + analytic["batch"]
    backward = fixed + analytic["gathered"] + analytic["activations"]
    high = max(backward - head["head"] - prefetched, fixed + analytic["reduction_phase"]) / peak
    print(
        f"{label}: analytic {analytic['total'] / 1e6:.2f} / compiled peak {peak / 1e6:.2f} MB = {low:.3f}; {high:.3f}"
    )
    assert low >= 1 - PEAK_UNDER, (label, "under the compiled peak", round(low, 3))
    assert high <= 1 + PEAK_OVER, (label, "over the compiled peak", round(high, 3))


# The child of `plans_in_one_child`: `plan` main(argv) for each argv list of argv[1] (a JSON list),
# its compile child (`python -m fsdp_jax.app.planner.estimate`: compile_child.child_main) run in
# this process for the targets argv[2] names (a JSON list); prints [exit code, stdout, stderr tail] per run.
# A run that is a string is Python run between two plans (its `result` printed in its place).
_PLANS_CHILD = """
import contextlib, io, json, pathlib, subprocess, sys
from fsdp_jax.app.cli.entry import SCRIPTS, command_module
from fsdp_jax.app.planner import compile_child
expected = json.loads(sys.argv[2])


def in_process(request, n_devices, target):
    # the environment is this child's (child_env of the expected targets): another target's fails
    assert target is not None and target.as_dict() in expected, (target, expected)
    request["target"] = target.as_dict()
    out, err = io.StringIO(), io.StringIO()
    sys.stdin = io.StringIO(json.dumps(request))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = compile_child.child_main()
    finally:
        sys.stdin = sys.__stdin__
    return subprocess.CompletedProcess([], rc, out.getvalue(), err.getvalue()), target.describe()


compile_child._run_child = in_process
plan = command_module(SCRIPTS["plan"])
results, between = [], {"pathlib": pathlib}
for argv in json.loads(sys.argv[1]):
    if isinstance(argv, str):
        between["result"] = None
        exec(argv, between)
        results.append(between["result"])
        continue
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = plan.main(argv)
        except SystemExit as e:
            rc = e.code
    results.append([rc, out.getvalue(), err.getvalue()[-3000:]])
print(json.dumps(results))
"""


def plans_in_one_child(target, runs: list[list | str]) -> list:
    """(exit code, stdout, stderr tail) of `plan` main(argv) for each argv in `runs` (each naming
    `target`, a `fsdp_jax.targets.gpu.Target`, with --target / --devices; or one of `target`, a list
    of targets whose child environments are the same: GPU targets of any size), all in one child
    process from `targets.child_env(target=target)`: the command as `call` runs it, except that its compile
    child is `child_main` in the same process, so Python, JAX and the plugin start once for all the
    runs. Each run lowers the programs `call` would (the same compile keys, the same tests/compiled
    seeds); on a GPU target the runs share one XLA:GPU kernel cache file, as one plan's strategies do
    in plan's own child (`compile_child._run_child`). A string in `runs` is Python code run there
    between the plans before and after it, in one namespace for all such code (`pathlib` in it); its
    result is the JSON value the code left in `result`."""
    import tempfile

    from fsdp_jax.targets.gpu import child_env

    targets = list(target) if isinstance(target, list | tuple) else [target]
    with tempfile.TemporaryDirectory(prefix="fsdp_jax-plans-") as scratch:
        cache = Path(scratch) / "xla_gpu_kernels.bin"
        envs = [child_env(dict(os.environ, JAX_PLATFORMS="cpu"), kernel_cache=cache, target=t) for t in targets]
        assert all(e == envs[0] for e in envs), "the targets' child environments differ: one child each"
        argvs = json.dumps([run if isinstance(run, str) else [str(a) for a in run] for run in runs])
        expected = json.dumps([t.as_dict() for t in targets])
        done = json_child(_PLANS_CHILD, argvs, expected, env=envs[0])
        return [r if isinstance(run, str) else tuple(r) for run, r in zip(runs, done)]
