"""The training loop (thin): config -> mesh -> model -> sharded state -> data -> steps.

`setup(cfg)` builds everything a run needs and returns it as a `Run`; `train(cfg)`
runs the loop, logging to a tqdm bar, `metrics.jsonl` and (optionally)
TensorBoard, evaluating every `eval_every` steps and sampling text at the end.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
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
from fsdp_jax.config import Config, check_data, save_config, validate
from fsdp_jax.memory import compiled_memory
from fsdp_jax.mesh import make_mesh
from fsdp_jax.models.llama import Llama, count_params, cross_entropy, flops_per_token, sample
from fsdp_jax.optim import build_optimizer
from fsdp_jax.perf import device_memory, mfu, peak_flops
from fsdp_jax.precision import Policy
from fsdp_jax.state import TrainState, init_train_state
from fsdp_jax.step import make_eval_step, make_train_step, sharding_context
from fsdp_jax.strategy import ShardingPlan, batch_divisor


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


def setup(cfg: Config, init_params: Callable | None = None) -> Run:
    """Validate against the devices, prepare data, build mesh, model, optimizer,
    sharded state and the jitted steps. `init_params(rng) -> params` replaces the
    model's own init (e.g. to start from exported weights)."""
    validate(cfg, n_devices=jax.device_count())
    prepare_data(cfg)
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    model = from_nnx(lambda rngs: Llama(cfg.model, rngs=rngs, remat=cfg.remat))
    optimizer, schedule = build_optimizer(cfg.optimizer, cfg.train.steps)
    state, plan = init_train_state(
        init_params or model.init, optimizer, mesh, jax.random.key(cfg.train.seed), cfg.mesh.strategy,
        logical_axes=model.logical_axes, min_shard_size=cfg.mesh.min_shard_size,
        max_replicated_fraction=cfg.mesh.max_replicated_fraction)
    loss_fn = make_loss_fn(model)
    train_step = make_train_step(loss_fn, optimizer, plan, microbatches=cfg.train.microbatches,
                                 clip_norm=cfg.optimizer.clip_norm, precision=cfg.precision)
    eval_step = make_eval_step(loss_fn, plan, precision=cfg.precision)
    return Run(cfg, mesh, model, optimizer, schedule, plan, state, train_step, eval_step, loss_fn,
               Path(cfg.run_dir), jax.process_index() == 0)


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

    def close(self):
        if self.tb is not None:
            self.tb.close()


def train(cfg: Config, *, init_params: Callable | None = None, progress: bool = True) -> dict:
    """Train per `cfg`; returns a summary dict (final train/val loss, tokens/s, sample)."""
    run = setup(cfg, init_params)
    c = cfg.train
    if run.is_main:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run.run_dir / "config.yaml")
    log = MetricsLog(run.run_dir, run.is_main, c.tensorboard)
    pi, pc = jax.process_index(), jax.process_count()
    batches = data_lib.make_dataset(cfg.data.path, "train", cfg.data.seq_len, c.global_batch,
                                    cfg.data.seed, pi, pc)
    batches.set_state({"step": int(run.state.step)})
    val = (data_lib.eval_batches(cfg.data.path, cfg.data.seq_len, c.global_batch, c.eval_batches,
                                 cfg.data.seed, pi, pc) if c.eval_every and c.eval_batches else [])

    t0 = time.perf_counter()
    first = global_batch(run.plan, batches.batch(int(run.state.step)))
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
        bar = tqdm(total=c.steps, initial=int(run.state.step), dynamic_ncols=True, desc="train")
    state = run.state
    pending: deque = deque()
    window: list[tuple[float, float]] = []  # (loss, grad_norm) since the last log
    last_log_t, last_log_step = time.perf_counter(), int(state.step)
    summary: dict[str, Any] = {"compile_s": compile_s, "params": n_params}
    start_step = int(state.step)
    for step_i in range(start_step, c.steps):
        batch = global_batch(run.plan, next(batches))
        state, metrics = compiled(state, batch)
        pending.append((step_i + 1, metrics))
        if len(pending) >= max(1, c.max_inflight_steps) or step_i + 1 == c.steps:
            while pending:  # bounded run-ahead: on CPU, unbounded queues hit rendezvous timeouts
                s, m = pending.popleft()
                loss, gnorm, skipped = float(m["loss"]), float(m["grad_norm"]), int(m["skipped"])
                if skipped and run.is_main:
                    print(f"warning: step {s}: non-finite loss/grad norm ({loss}, {gnorm}); update skipped",
                          flush=True)
                window.append((loss, gnorm))
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.3f}")
        done = int(step_i + 1)
        if window and (done % c.log_every == 0 or done == c.steps) and not pending:
            now = time.perf_counter()
            dt = (now - last_log_t) / max(1, done - last_log_step)
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
            last_log_t, last_log_step = time.perf_counter(), done
        if val and (done % c.eval_every == 0 or done == c.steps):
            vl = evaluate(run, state.params, val)
            log.write({"step": done, "val_loss": vl})
            summary["val_loss"] = vl
            if bar is not None:
                bar.write(f"step {done}: val_loss {vl:.4f} ({vl / math.log(2):.3f} bits/token)")
            last_log_t = time.perf_counter()
    if bar is not None:
        bar.close()
    run.state = state
    summary["final_step"] = int(state.step)
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
    out = sample(next_logits, prompt, cfg.train.sample_tokens, window, jax.random.key(cfg.train.seed))
    if data_lib.load_meta(cfg.data.path).get("tokenizer") == "bytes":
        text = bytes(prompt.tolist()).decode("utf-8", "replace")
        return text + "\u2016" + bytes([t % 256 for t in out]).decode("utf-8", "replace")
    return " ".join(map(str, out))
