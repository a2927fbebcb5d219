"""The training loop (thin): config -> mesh -> model -> sharded state -> data -> steps.

`setup(cfg)` builds everything a run needs and returns it as a `Run`; `train(cfg)`
runs the loop, logging to a tqdm bar, `metrics.jsonl` and (optionally)
TensorBoard, evaluating every `eval_every` steps and sampling text at the end.

Fault tolerance: checkpoints go to `<run_dir>/checkpoints` every `checkpoint_every`
steps and at the end (asynchronously); running the same command again resumes
exactly from the newest checkpoint that restores (data order and LR schedule
included). SIGTERM/SIGINT finish the step, checkpoint and return normally; a
second signal exits at once. `max_nonfinite_steps` skipped steps in a row raise
`TrainingDiverged` with the last good checkpoint intact.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from fsdp_jax import data as data_lib
from fsdp_jax.adapters import ModelFns, from_nnx
from fsdp_jax.checkpoint import Checkpointer, CheckpointError, Restored, load_safetensors
from fsdp_jax.config import Config, check_data, config_to_dict, save_config, validate
from fsdp_jax.memory import compiled_memory
from fsdp_jax.mesh import make_mesh
from fsdp_jax.models.llama import Llama, count_params, cross_entropy, flops_per_token, sample
from fsdp_jax.optim import build_optimizer
from fsdp_jax.perf import device_memory, mfu, peak_flops
from fsdp_jax.precision import Policy
from fsdp_jax.state import TrainState, abstract_state, init_train_state, state_shardings
from fsdp_jax.step import make_eval_step, make_train_step, sharding_context
from fsdp_jax.strategy import ShardingPlan, batch_divisor, make_plan

# Test hook: comma-separated step numbers (1-based, as logged) whose loss is made NaN
# by feeding an out-of-range token (jnp.take fills it with NaN), e.g. "5,6,7".
INJECT_NAN_ENV = "FSDP_JAX_INJECT_NAN_STEPS"


class TrainingDiverged(RuntimeError):
    """`train.max_nonfinite_steps` skipped steps in a row; the checkpoints are intact."""


@dataclasses.dataclass
class Run:
    """Everything one training run holds."""
    cfg: Config
    mesh: jax.sharding.Mesh
    model: ModelFns
    optimizer: Any
    schedule: Callable[[int], Any]
    plan: ShardingPlan
    state: TrainState
    train_step: Any  # CompiledStep
    eval_step: Any
    loss_fn: Callable
    run_dir: Path
    is_main: bool
    checkpointer: Checkpointer | None = None
    rng: jax.Array | None = None            # the run's seed-derived key (saved in checkpoints)
    restored: Restored | None = None        # the checkpoint this run resumed from
    start_step: int = 0                     # steps (batches) done before this run started


def make_loss_fn(model: ModelFns) -> Callable:
    """Next-token cross-entropy on int32 tokens (B, S + 1)."""
    def loss_fn(params, tokens):
        return cross_entropy(model.apply(params, tokens[:, :-1]), tokens[:, 1:])
    return loss_fn


def prepare_data(cfg: Config) -> None:
    """Prepare the default stdlib corpus on first use (process 0), then check the data."""
    if cfg.data.source == "stdlib" and not (Path(cfg.data.path) / "meta.json").exists():
        if jax.process_index() == 0:
            data_lib.ensure_stdlib(cfg.data.path)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("fsdp_jax:prepare_data")
    check_data(cfg)


def setup(cfg: Config, init_params: Callable | None = None, *, resume: bool = True) -> Run:
    """Validate against the devices, prepare data, build mesh, model, optimizer,
    sharded state and the jitted steps.

    The state comes from, in order: the newest checkpoint in `<run_dir>/checkpoints`
    that restores (when `resume`; laid out for this mesh and strategy, whatever wrote
    it), else `cfg.init_from` (params from a safetensors file or another run, fresh
    optimizer state), else `init_params(rng) -> params` (default: the model's init).
    Raises CheckpointError when checkpoints exist but none restores or fits."""
    validate(cfg, n_devices=jax.device_count())
    prepare_data(cfg)
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    model = from_nnx(lambda rngs: Llama(cfg.model, rngs=rngs, remat=cfg.remat))
    optimizer, schedule = build_optimizer(cfg.optimizer, cfg.train.steps)
    rng = jax.random.key(cfg.train.seed)
    init_fn = init_params or model.init
    run_dir, is_main = Path(cfg.run_dir), jax.process_index() == 0
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.train.keep_checkpoints)
    if is_main:
        for p in ckpt.partial:
            print(f"warning: ignoring partial checkpoint {p} (its save was interrupted); removed",
                  flush=True)
    abstract = jax.eval_shape(init_fn, rng)
    plan = make_plan(abstract, optimizer, mesh, cfg.mesh.strategy, model.logical_axes,
                     min_shard_size=cfg.mesh.min_shard_size,
                     max_replicated_fraction=cfg.mesh.max_replicated_fraction)
    restored, start = None, 0
    if resume and ckpt.steps():
        restored = ckpt.restore(abstract_state(plan, abstract, optimizer), set_aside_damaged=True)
        state, start = restored.state, int(restored.extras.get("step", restored.step))
        rng = _rng_from(restored.extras.get("rng"), rng)
        if is_main:
            for w in restored.warnings + _config_changes(restored.extras.get("config"), cfg):
                print(f"warning: {w}", flush=True)
            print(f"resuming from checkpoint step {restored.step} ({ckpt.step_dir(restored.step)})",
                  flush=True)
    elif cfg.init_from:
        sharded = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                               abstract, plan.params)
        state = state_from_params(load_init_params(cfg.init_from, sharded), optimizer, plan)
        if is_main:
            print(f"initialised params from {cfg.init_from}", flush=True)
    else:
        state, plan = init_train_state(
            init_fn, optimizer, mesh, rng, cfg.mesh.strategy, logical_axes=model.logical_axes,
            min_shard_size=cfg.mesh.min_shard_size,
            max_replicated_fraction=cfg.mesh.max_replicated_fraction)
    loss_fn = make_loss_fn(model)
    train_step = make_train_step(loss_fn, optimizer, plan, microbatches=cfg.train.microbatches,
                                 clip_norm=cfg.optimizer.clip_norm, precision=cfg.precision)
    eval_step = make_eval_step(loss_fn, plan, precision=cfg.precision)
    return Run(cfg, mesh, model, optimizer, schedule, plan, state, train_step, eval_step, loss_fn,
               run_dir, is_main, ckpt, rng, restored, start)


def state_from_params(params, optimizer, plan: ShardingPlan) -> TrainState:
    """A step-0 TrainState around existing params (in `plan.params` layout) with fresh
    optimizer state; params are passed as arguments, not baked into the program."""
    def init(p):
        return TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=optimizer.init(p))
    with jax.set_mesh(plan.mesh):
        return jax.jit(init, in_shardings=(plan.params,), out_shardings=state_shardings(plan),
                       donate_argnums=0)(params)


def load_init_params(path: str, abstract_params):
    """Params for `init_from`, laid out as `abstract_params` (ShapeDtypeStructs with
    shardings): a safetensors file (scripts/export.py) or a run / checkpoint directory
    (its newest checkpoint that restores; only params are read)."""
    p = Path(path)
    try:
        if p.is_file() or p.suffix == ".safetensors":
            return load_safetensors(p, abstract_params)
        d = p / "checkpoints" if (p / "checkpoints").is_dir() else p
        if not d.is_dir():
            raise CheckpointError(f"{path}: no such file or directory")
        params, _, notes = Checkpointer(d, read_only=True, keep=None).restore_params(abstract_params)
        for n in notes:
            if jax.process_index() == 0:
                print(f"warning: {n}", flush=True)
        return params
    except CheckpointError as e:
        raise CheckpointError(f"init_from: {e}") from None


def _rng_from(saved: dict | None, default: jax.Array) -> jax.Array:
    if not saved:
        return default
    return jax.random.wrap_key_data(np.asarray(saved["data"], np.uint32), impl=saved["impl"])


def _rng_to_json(key: jax.Array) -> dict:
    return {"impl": str(jax.random.key_impl(key)), "data": np.asarray(jax.random.key_data(key)).tolist()}


def _config_changes(saved: dict | None, cfg: Config) -> list[str]:
    """One line naming the config keys that differ from the checkpoint's, if any."""
    if not saved:
        return []

    def flat(d: dict) -> dict:
        return {f"{k}.{j}" if isinstance(v, dict) else k: w for k, v in d.items()
                for j, w in (v.items() if isinstance(v, dict) else [(k, v)])}
    a, b = flat(saved), flat(config_to_dict(cfg))
    diff = [f"{k} {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
    return [f"resuming with a config that differs from the checkpoint's: {', '.join(diff)}"] if diff else []


def global_batch(plan: ShardingPlan, local: np.ndarray) -> jax.Array:
    """This process's rows -> one global array sharded over (data, fsdp)."""
    return jax.make_array_from_process_local_data(plan.batch, local)


def evaluate(run: Run, params, batches) -> float:
    losses = [run.eval_step(params, global_batch(run.plan, b))["loss"] for b in batches]
    return float(np.mean([float(x) for x in losses]))


class MetricsLog:
    """Appends JSON lines to run_dir/metrics.jsonl (process 0) and mirrors scalars to
    TensorBoard when enabled."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        if enabled and tensorboard:
            from tensorboardX import SummaryWriter
            self.tb = SummaryWriter(str(run_dir / "tb"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None:
                    self.tb.add_scalar(k, v, record["step"])

    def truncate(self, step: int) -> None:
        """Drop records after `step` (written by a run that died after its last checkpoint)."""
        if not self.enabled or not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except ValueError:  # a line cut short by a crash
                pass
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)

    def close(self):
        if self.tb is not None:
            self.tb.close()


class _StopSignals:
    """SIGTERM / SIGINT ask the loop to stop after the current step (it checkpoints and
    returns normally); a second signal exits at once. Handlers are installed only in
    the main thread and restored on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}

    def __enter__(self) -> "_StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            os.write(2, f"\n{signal.Signals(signum).name} again: exiting now\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        os.write(2, f"\n{signal.Signals(signum).name}: finishing this step, then checkpointing and "
                    "exiting (send it again to exit now)\n".encode())

    @property
    def name(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name

    def requested(self) -> bool:
        """Whether any process got a signal (all processes agree, so all stop at one step)."""
        flag = self.signum is not None
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            flag = bool(np.max(multihost_utils.process_allgather(np.int32(flag))))
        return flag


def _injected_nan_steps() -> set[int]:
    text = os.environ.get(INJECT_NAN_ENV, "")
    try:
        return {int(x) for x in text.split(",") if x.strip()}
    except ValueError:
        raise ValueError(f"{INJECT_NAN_ENV}={text!r}: expected comma-separated step numbers") from None


def train(cfg: Config, *, init_params: Callable | None = None, progress: bool = True,
          stop_after: int | None = None) -> dict:
    """Train per `cfg`, resuming from `<run_dir>/checkpoints` when it holds a checkpoint;
    returns a summary dict (final train/val loss, tokens/s, sample; `preempted` when a
    signal or `stop_after` (a step number) ended it early, after checkpointing).
    Raises TrainingDiverged after `train.max_nonfinite_steps` skipped steps in a row."""
    with _StopSignals() as signals:  # from here on, until the last write is committed
        run = setup(cfg, init_params)
        try:
            return _loop(run, cfg, progress, stop_after, signals)
        finally:
            run.checkpointer.close()  # waits for checkpoint writes in flight


def _loop(run: Run, cfg: Config, progress: bool, stop_after: int | None, signals: _StopSignals) -> dict:
    c, ckpt = cfg.train, run.checkpointer
    if run.is_main:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run.run_dir / "config.yaml")
    log = MetricsLog(run.run_dir, run.is_main, c.tensorboard)
    if run.restored is not None:
        log.truncate(run.start_step)
    pi, pc = jax.process_index(), jax.process_count()
    batches = data_lib.make_dataset(cfg.data.path, "train", cfg.data.seq_len, c.global_batch,
                                    cfg.data.seed, pi, pc)
    start_step = run.start_step
    batches.set_state(run.restored.extras.get("data", {"step": start_step}) if run.restored
                      else {"step": start_step})
    val = (data_lib.eval_batches(cfg.data.path, cfg.data.seq_len, c.global_batch, c.eval_batches,
                                 cfg.data.seed, pi, pc) if c.eval_every and c.eval_batches else [])

    t0 = time.perf_counter()
    first = global_batch(run.plan, batches.batch(start_step))
    compiled = run.train_step.lower(run.state, first).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled_memory(compiled)
    n_params = count_params(cfg.model)
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    peak = peak_flops(jax.devices()[0], Policy.parse(cfg.precision).compute_dtype.name)
    tokens_per_step = c.global_batch * cfg.data.seq_len
    if run.is_main:
        print(f"fsdp_jax: {n_params / 1e6:.2f}M params | {jax.device_count()} devices "
              f"{dict(run.mesh.shape)} | {run.plan.strategy.name} | {cfg.precision} | remat {cfg.remat} | "
              f"compiled in {compile_s:.1f}s | per-device state "
              f"{mem['argument'] / 2**20:.1f} MiB, peak {mem['peak'] / 2**20:.1f} MiB", flush=True)

    bar = None
    if run.is_main and progress:
        from tqdm import tqdm
        bar = tqdm(total=c.steps, initial=start_step, dynamic_ncols=True, desc="train")
    state = run.state
    pending: deque = deque()
    window: list[tuple[float, float]] = []  # (loss, grad_norm) since the last log
    last_log_t, last_log_step = time.perf_counter(), start_step
    eval_s = 0.0  # evaluation time inside the current log window, not counted as step time
    summary: dict[str, Any] = {"compile_s": compile_s, "params": n_params}
    nan_steps = _injected_nan_steps()
    streak: list[int] = []  # the current run of skipped (non-finite) steps

    def extras(done: int) -> dict:
        return {"step": done, "data": batches.get_state(), "rng": _rng_to_json(run.rng),
                "config": config_to_dict(cfg)}

    for step_i in range(start_step, c.steps):
        done = step_i + 1
        local = next(batches)
        if done in nan_steps:
            local = local.copy()
            local[:, 0] = cfg.model.vocab_size
        state, metrics = compiled(state, global_batch(run.plan, local))
        pending.append((done, metrics))
        stop = signals.requested() or done == stop_after
        save = stop or done == c.steps or bool(c.checkpoint_every and done % c.checkpoint_every == 0)
        if len(pending) >= max(1, c.max_inflight_steps) or done == c.steps or save:
            while pending:  # bounded run-ahead: on CPU, unbounded queues hit rendezvous timeouts
                s, m = pending.popleft()
                loss, gnorm, skipped = float(m["loss"]), float(m["grad_norm"]), int(m["skipped"])
                if skipped:
                    streak.append(s)
                    if run.is_main:
                        print(f"warning: step {s}: non-finite loss/grad norm ({loss}, {gnorm}); "
                              f"update skipped ({len(streak)} in a row)", flush=True)
                else:
                    streak.clear()
                window.append((loss, gnorm))
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.3f}")
        if len(streak) >= c.max_nonfinite_steps:
            if bar is not None:
                bar.close()
            ckpt.wait()
            last = ckpt.latest_step()
            raise TrainingDiverged(
                f"{len(streak)} non-finite steps in a row (steps {streak[0]}-{streak[-1]}, "
                f"train.max_nonfinite_steps={c.max_nonfinite_steps}); stopped. Newest checkpoint: "
                + (f"step {last} in {ckpt.directory}" if last is not None else "none"))
        if window and (done % c.log_every == 0 or done == c.steps or stop) and not pending:
            now = time.perf_counter()
            dt = (now - last_log_t - eval_s) / max(1, done - last_log_step)
            tps = tokens_per_step / dt
            rec = {"step": done, "loss": float(np.mean([w[0] for w in window])),
                   "lr": float(run.schedule(done - 1)), "grad_norm": float(np.mean([w[1] for w in window])),
                   "step_time_s": dt, "tokens_per_s": tps, "mfu": mfu(fpt, tps, jax.device_count(), peak),
                   "compiled_peak_bytes": mem["peak"]}
            dm = device_memory()
            if dm:
                rec["peak_bytes_in_use"] = dm["peak_bytes_in_use"]
            log.write(rec)
            summary.update(train_loss=rec["loss"], tokens_per_s=tps)
            window.clear()
            last_log_t, last_log_step, eval_s = time.perf_counter(), done, 0.0
        if val and not stop and (done % c.eval_every == 0 or done == c.steps):
            t_eval = time.perf_counter()
            vl = evaluate(run, state.params, val)
            log.write({"step": done, "val_loss": vl})
            summary["val_loss"] = vl
            if bar is not None:
                bar.write(f"step {done}: val_loss {vl:.4f} ({vl / math.log(2):.3f} bits/token)")
            eval_s += time.perf_counter() - t_eval
        # No periodic checkpoint inside a run of skipped steps: the newest one stays
        # the last good update (the state is unchanged, only the data position moved).
        if save and (not streak or stop or done == c.steps):
            ckpt.save(done, state, extras(done))
        if stop:
            summary["preempted"] = signals.name or f"stop_after={stop_after}"
            break
    if bar is not None:
        bar.close()
    run.state = state
    summary["final_step"] = int(state.step)
    if "preempted" in summary:
        ckpt.wait()
        if run.is_main:
            print(f"stopped ({summary['preempted']}) after step {done}: checkpoint "
                  f"{ckpt.step_dir(done)} written", flush=True)
        log.close()
        summary["run"] = run
        return summary
    if c.sample_tokens:
        summary["sample"] = _sample_text(run, state.params, val)
    if run.is_main:
        print(f"final: train_loss {summary.get('train_loss', float('nan')):.4f}"
              + (f" | val_loss {summary['val_loss']:.4f} nats/token" if "val_loss" in summary else ""),
              flush=True)
        if "sample" in summary:
            print("sample:\n" + summary["sample"], flush=True)
    log.close()
    summary["run"] = run
    return summary


def _sample_text(run: Run, params, val) -> str:
    """A short continuation of a validation prompt, decoded as bytes (byte tokenizer).
    The forward runs sharded like training (the prompt is repeated over the batch
    devices), so it works for any model the run can train, on every process."""
    cfg, plan = run.cfg, run.plan
    n = batch_divisor(plan.mesh)
    window = cfg.model.max_seq_len
    policy = Policy.parse(cfg.precision)

    def fwd(p, buf, pos):
        tokens = jnp.broadcast_to(buf[None, :], (n, window))
        logits = run.model.apply(policy.cast_to_compute(p), tokens)
        return jax.lax.dynamic_index_in_dim(logits[0], pos - 1, keepdims=False).astype(jnp.float32)

    replicated = NamedSharding(plan.mesh, P())
    jitted = jax.jit(fwd, in_shardings=(plan.params, replicated, replicated), out_shardings=replicated)

    def next_logits(buf, pos):
        with sharding_context(plan):
            return jax.device_get(jitted(params, jnp.asarray(buf), jnp.int32(pos)))

    prompt = (np.asarray(val[0][0][:48]) if val else np.frombuffer(b"def ", np.uint8)).astype(np.int32)
    out = sample(next_logits, prompt, cfg.train.sample_tokens, window, run.rng)
    if data_lib.load_meta(cfg.data.path).get("tokenizer") == "bytes":
        text = bytes(prompt.tolist()).decode("utf-8", "replace")
        return text + "\u2016" + bytes([t % 256 for t in out]).decode("utf-8", "replace")
    return " ".join(map(str, out))
