"""The training loop (thin): config -> mesh -> model -> sharded state -> data -> steps.

`setup(cfg)` builds everything a run needs and returns it as a `Run`; `train(cfg)`
runs the loop, logging to a tqdm bar, `metrics.jsonl` and (optionally)
TensorBoard (`fsdp_jax.app.metrics_log`), evaluating every `eval_every` steps and
sampling text at the end.

Fault tolerance: checkpoints go to `<run_dir>/checkpoints` every `checkpoint_every`
steps and at the end (asynchronously); running the same command again resumes
exactly from the newest checkpoint that restores (data order and LR schedule
included). SIGTERM/SIGINT finish the step, checkpoint and return normally; a
second signal exits at once (`fsdp_jax.app.preemption`). `max_nonfinite_steps` skipped steps in a row raise
`TrainingDiverged` with the last good checkpoint intact. Bad input is found by
`preflight` before anything is written; process 0 then holds `<run_dir>/.lock`
(`fsdp_jax.app.run_dir`), so a second trainer on the same run_dir is refused; a save
that fails (disk full) raises `CheckpointWriteError` at the next step.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from fsdp_jax.app import data as data_lib
from fsdp_jax.app import hf
from fsdp_jax.adapters import ModelFns, from_nnx
from fsdp_jax.checkpoint import (CheckpointError, Checkpointer, Restored, load_init_params,
                                 open_safetensors)
from fsdp_jax.app.config import (Config, ConfigError, check_backend, check_data, config_to_dict,
                                 save_config, validate)
from fsdp_jax.app.run_dir import RunDirLock, check_dir_path
from fsdp_jax import offload as offload_lib
from fsdp_jax import remat as remat_lib
from fsdp_jax.memory import compiled_memory
from fsdp_jax.app.metrics_log import LogWindow, MetricsLog, sample_text, wandb_settings
from fsdp_jax.app.timing import ProfileWindow, StepTimer, format_goodput, format_window, goodput, injected_data_delay
from fsdp_jax.mesh import make_mesh
from fsdp_jax.app.models.llama import Llama, count_params, cross_entropy, flops_per_token
from fsdp_jax.app.optim import build_optimizer
from fsdp_jax.perf import peak_flops
from fsdp_jax.precision import Policy
from fsdp_jax.app.preemption import StopSignals
from fsdp_jax.app.token_check import check_corpus_vocab
from fsdp_jax.build import build
from fsdp_jax.state import TrainState
from fsdp_jax.step import TokenSum
from fsdp_jax.strategy import ShardingPlan
from fsdp_jax.errors import TrainingDiverged  # noqa: F401 (re-exported)

# Test hook: comma-separated step numbers (1-based, as logged) whose loss is made NaN
# by feeding an out-of-range token (jnp.take fills it with NaN), e.g. "5,6,7".
INJECT_NAN_ENV = "FSDP_JAX_INJECT_NAN_STEPS"


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
    setup_s: float = 0.0                    # wall seconds train() spent in setup (for goodput)


def token_loss(logits, targets, weights) -> TokenSum:
    """Cross-entropy summed over the weighted (trained) targets, and their count: the step
    divides by the global batch's count (`fsdp_jax.step.TokenSum`)."""
    import optax
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(np.float32), targets)
    w = weights.astype(np.float32)
    return TokenSum((losses * w).sum(), w.sum())


def make_loss_fn(model: ModelFns) -> Callable:
    """Next-token cross-entropy on int32 tokens (B, S + 1) (the mean), or on a packed /
    document-masked batch dict (`fsdp_jax.app.packing.batch_from_rows`): attention and
    positions per segment, the loss over the weighted targets of the global batch."""
    def loss_fn(params, batch):
        if isinstance(batch, dict):
            logits = model.apply(params, batch["inputs"], batch["segment_ids"], batch["positions"])
            return token_loss(logits, batch["targets"], batch["weights"])
        return cross_entropy(model.apply(params, batch[:, :-1]), batch[:, 1:])
    return loss_fn


def prepare_data(cfg: Config) -> None:
    """Prepare the default stdlib corpus on first use (process 0), then check the data."""
    if cfg.data.source == "stdlib" and not (Path(cfg.data.path) / "meta.json").exists():
        if jax.process_index() == 0:
            try:
                data_lib.ensure_stdlib(cfg.data.path)
            except OSError as e:
                raise ConfigError("data.path", f"{cfg.data.path!r}: cannot prepare the stdlib "
                                  f"corpus there ({e.strerror or e})") from None
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("fsdp_jax:prepare_data")
    check_data(cfg)
    data_lib.load_meta(cfg.data.path)  # meta.json's dtype and the bins' sizes, before any write


def check_offload(cfg: Config) -> None:
    """ConfigError naming `offload` / `remat` when they move state or activations to host
    memory and this backend has none."""
    try:
        offload_lib.check_supported(cfg.offload, jax.devices())
    except offload_lib.OffloadError as e:
        raise ConfigError("offload", str(e).removeprefix("offload: ")) from None
    if cfg.remat in remat_lib.OFFLOADING and not offload_lib.host_memory_available(jax.devices()):
        raise ConfigError("remat", f"{cfg.remat!r} offloads activations to host memory "
                          f"({offload_lib.HOST}), which this backend "
                          f"({jax.devices()[0].platform}) does not offer; use a policy without "
                          "offload_ (e.g. dots)")


def setup(cfg: Config, init_params: Callable | None = None, *, resume: bool = True) -> Run:
    """Validate against the devices, prepare data, build mesh, model, optimizer,
    sharded state and the jitted steps.

    The state comes from, in order: the newest checkpoint in `<run_dir>/checkpoints`
    that restores (when `resume`; laid out for this mesh and strategy, whatever wrote
    it), else `cfg.init_from` (params from a safetensors file, another run or, as
    `hf:DIR`, a Hugging Face Llama read shard by shard; fresh optimizer state), else
    `init_params(rng) -> params` (default: the model's init).
    Raises CheckpointError when checkpoints exist but none restores or fits."""
    validate(cfg, n_devices=jax.device_count())
    check_offload(cfg)
    run_dir = Path(cfg.run_dir)
    hf_ckpt = None
    if hf.is_hf(cfg.init_from) and not (run_dir / "checkpoints").is_dir():
        hf_ckpt = hf.open_init(cfg.init_from, cfg.model)  # bad checkpoint: fail before writing
    prepare_data(cfg)
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    model = from_nnx(lambda rngs: Llama(cfg.model, rngs=rngs, remat=cfg.remat))
    optimizer, schedule = build_optimizer(cfg.optimizer, cfg.train.steps)
    rng = jax.random.key(cfg.train.seed)
    run_dir, is_main = Path(cfg.run_dir), jax.process_index() == 0
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.train.keep_checkpoints)
    if is_main:
        for p in ckpt.partial:
            print(f"warning: ignoring partial checkpoint {p} (its save was interrupted); removed",
                  flush=True)
    if init_params is not None:
        model = dataclasses.replace(model, init=init_params,
                                    abstract_params=jax.eval_shape(init_params, rng))
    loss_fn = make_loss_fn(model)
    built = build(model, optimizer, mesh, cfg.mesh.strategy, loss_fn=loss_fn, rules=cfg.mesh.rules,
                  min_shard_size=cfg.mesh.min_shard_size,
                  max_replicated_fraction=cfg.mesh.max_replicated_fraction,
                  min_replicated_bytes=cfg.mesh.min_replicated_bytes,
                  microbatches=cfg.train.microbatches, clip_norm=cfg.optimizer.clip_norm,
                  precision=cfg.precision, offload=cfg.offload)
    plan = built.plan
    restored, start = None, 0
    if resume and ckpt.steps():
        restored = ckpt.restore(built.abstract_state, set_aside_damaged=True)
        try:  # extras are JSON anyone can edit: a bad value names the checkpoint, not a traceback
            state, start = restored.state, int(restored.extras.get("step", restored.step))
            rng = _rng_from(restored.extras.get("rng"), rng)
        except (ValueError, TypeError, KeyError) as e:
            raise CheckpointError(f"checkpoint {ckpt.step_dir(restored.step)}: invalid extras "
                                  f"(step / rng: {' '.join(str(e).split())[:160]})") from None
        if is_main:
            for w in restored.warnings + _config_changes(restored.extras.get("config"), cfg):
                print(f"warning: {w}", flush=True)
            print(f"resuming from checkpoint step {restored.step} ({ckpt.step_dir(restored.step)})",
                  flush=True)
    elif hf.is_hf(cfg.init_from):  # a Hugging Face checkpoint, read shard by shard
        hf_ckpt = hf_ckpt or hf.open_init(cfg.init_from, cfg.model)
        state = built.state_from_params(hf.load_params(hf_ckpt, built.abstract_state.params))
        if is_main:
            print(f"initialised params from {cfg.init_from}", flush=True)
    elif cfg.init_from:
        state = built.state_from_params(load_init_params(cfg.init_from, built.abstract_state.params))
        if is_main:
            print(f"initialised params from {cfg.init_from}", flush=True)
    else:
        state = built.init_state(rng)
    return Run(cfg, mesh, model, optimizer, schedule, plan, state, built.train_step, built.eval_step, loss_fn,
               run_dir, is_main, ckpt, rng, restored, start)


def _rng_from(saved: dict | None, default: jax.Array) -> jax.Array:
    if not saved:
        return default
    return jax.random.wrap_key_data(np.asarray(saved["data"], np.uint32), impl=saved["impl"])


def _rng_to_json(key: jax.Array) -> dict:
    return {"impl": str(jax.random.key_impl(key)), "data": np.asarray(jax.random.key_data(key)).tolist()}


def _config_changes(saved: dict | None, cfg: Config) -> list[str]:
    """One line naming the config keys that differ from the checkpoint's, if any. A key the
    checkpoint's config lacks (it was written by an older release) counts only when this run
    sets it away from its default, which is what the older release did."""
    if not saved:
        return []

    def flat(d: dict) -> dict:
        return {f"{k}.{j}" if isinstance(v, dict) else k: w for k, v in d.items()
                for j, w in (v.items() if isinstance(v, dict) else [(k, v)])}
    a, b, default = flat(saved), flat(config_to_dict(cfg)), flat(config_to_dict(Config()))
    a.update({k: default[k] for k in b.keys() - a.keys() if k in default})
    diff = [f"{k} {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
    return [f"resuming with a config that differs from the checkpoint's: {', '.join(diff)}"] if diff else []


def global_batch(plan: ShardingPlan, local):
    """This process's rows (an array, or a packed batch dict) -> global arrays sharded
    over (data, fsdp)."""
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(plan.batch, x), local)


def evaluate(run: Run, params, batches) -> float:
    """Mean val loss: per token over all batches for packed / document-masked batches
    (sum of token losses / trained tokens: the example-level loss of held-out
    examples), else the mean of the batches' means."""
    outs = [run.eval_step(params, global_batch(run.plan, b)) for b in batches]
    if outs and "tokens" in outs[0]:
        return float(sum(float(o["loss_sum"]) for o in outs) / max(1.0, sum(float(o["tokens"]) for o in outs)))
    return float(np.mean([float(o["loss"]) for o in outs]))


def make_batches(cfg: Config, process_index: int, process_count: int):
    """(train iterator, val batches) for the corpus at data.path: packed fine-tuning rows
    (`fsdp_jax.app.sft_data`), or windows of a token corpus (`fsdp_jax.app.data`), as
    batch dicts with document masks when data.document_mask."""
    c, meta = cfg.train, data_lib.load_meta(cfg.data.path)
    n_val = c.eval_batches if c.eval_every else 0
    if meta.get("format") == "packed":
        from fsdp_jax.app import sft_data
        batches = sft_data.make_packed_dataset(cfg.data.path, "train", c.global_batch, cfg.data.seed,
                                               process_index, process_count)
        val = (sft_data.packed_eval_batches(cfg.data.path, c.global_batch, n_val, process_index,
                                            process_count) if n_val else [])
        return batches, val
    batches = data_lib.make_dataset(cfg.data.path, "train", cfg.data.seq_len, c.global_batch,
                                    cfg.data.seed, process_index, process_count)
    val = (data_lib.eval_batches(cfg.data.path, cfg.data.seq_len, c.global_batch, n_val,
                                 cfg.data.seed, process_index, process_count) if n_val else [])
    if cfg.data.document_mask:
        from fsdp_jax.app.packing import batch_from_windows
        eos = int(meta["eos_id"])
        batches.dataset = batches.dataset.map(lambda w: batch_from_windows(w, eos))
        val = [batch_from_windows(w, eos) for w in val]
    return batches, val


def _injected_nan_steps() -> set[int]:
    text = os.environ.get(INJECT_NAN_ENV, "")
    try:
        steps = {int(x) for x in text.split(",") if x.strip()}
    except ValueError:
        steps = {0}
    if any(s < 1 for s in steps):
        raise ConfigError(INJECT_NAN_ENV, f"{text!r} is invalid; expected comma-separated step "
                          "numbers >= 1, e.g. 5,6,7")
    return steps


def preflight(cfg: Config, progress: bool = False) -> None:
    """Every check of the run's inputs that needs no writing: the config against the
    devices and backend, the environment hooks, and the places the run will write
    (run_dir; data.path when the corpus is to be prepared), init_from's header, the
    corpus's token ids against model.vocab_size (`token_check`; a prepared corpus only:
    the stdlib one is bytes). Raises ConfigError, DataError or CheckpointError (bad input)."""
    validate(cfg, n_devices=jax.device_count())
    check_backend(cfg, jax.default_backend())
    _injected_nan_steps()
    if cfg.train.tensorboard and importlib.util.find_spec("tensorboardX") is None:
        raise ConfigError("train.tensorboard", "true needs the tensorboardX package "
                          "(pip install tensorboardX), or set it to false")
    check_dir_path(cfg.run_dir, "run_dir")
    if cfg.data.source == "stdlib" and not (Path(cfg.data.path) / "meta.json").exists():
        check_dir_path(cfg.data.path, "data.path")
    else:
        check_data(cfg)
        check_corpus_vocab(cfg.data.path, cfg.model.vocab_size, progress)
    if cfg.init_from and not re.match(r"[A-Za-z][\w+.-]*:", cfg.init_from):  # scheme:... is not a path
        init = Path(cfg.init_from)
        if not init.exists():
            raise ConfigError("init_from", f"{cfg.init_from!r}: no such file or directory")
        if init.is_file():
            try:
                open_safetensors(init)  # the header only
            except CheckpointError as e:
                raise CheckpointError(f"init_from: {e}") from None


def check_tokens(local: np.ndarray, vocab_size: int, step: int, data_path: str) -> None:
    """A batch's token ids are in [0, vocab_size): an id outside would only show up as
    a NaN loss (the embedding lookup fills it), so name the data instead."""
    if isinstance(local, dict):
        local = local["inputs"]
    lo, hi = int(local.min()), int(local.max())
    if lo < 0 or hi >= vocab_size:
        bad = hi if hi >= vocab_size else lo
        raise data_lib.DataError(f"data.path {data_path!r}: step {step}'s batch holds token id {bad}, "
                                 f"outside model.vocab_size={vocab_size}; the corpus does not match "
                                 "the model (its meta.json vocab_size is wrong?)")


def train(cfg: Config, *, init_params: Callable | None = None, progress: bool = True,
          stop_after: int | None = None) -> dict:
    """Train per `cfg`, resuming from `<run_dir>/checkpoints` when it holds a checkpoint;
    returns a summary dict (final train/val loss, tokens/s, sample; `preempted` when a
    signal or `stop_after` (a step number) ended it early, after checkpointing).
    Raises TrainingDiverged after `train.max_nonfinite_steps` skipped steps in a row."""
    with StopSignals() as signals:  # from here on, until the last write is committed
        t_setup = time.perf_counter()
        preflight(cfg, progress)  # bad input fails here, before anything is written
        injected_data_delay()  # a bad test-hook value fails here too
        with RunDirLock(cfg.run_dir):  # one writer per run_dir
            run = setup(cfg, init_params)
            run.setup_s = time.perf_counter() - t_setup
            try:
                return _loop(run, cfg, progress, stop_after, signals)
            finally:
                run.checkpointer.close()  # waits for checkpoint writes in flight


def _loop(run: Run, cfg: Config, progress: bool, stop_after: int | None, signals: StopSignals) -> dict:
    timer = StepTimer("setup")  # where the wall time goes (fsdp_jax.app.timing)
    data_delay = injected_data_delay()  # test hook (checked in train() already)
    c, ckpt = cfg.train, run.checkpointer
    if run.is_main:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run.run_dir / "config.yaml")
    log = MetricsLog(run.run_dir, run.is_main, c.tensorboard, wandb=wandb_settings(cfg), timer=timer)
    log.truncate(run.start_step)  # a fresh start (0) drops the rows of a run that died before saving
    pi, pc = jax.process_index(), jax.process_count()
    batches, val = make_batches(cfg, pi, pc)
    start_step = run.start_step
    batches.set_state(run.restored.extras.get("data", {"step": start_step}) if run.restored
                      else {"step": start_step})
    profiler = ProfileWindow(c.profile, run.run_dir / "profile", timer, run.is_main)

    timer.switch("compile")
    timer.cut()  # the first logged window starts here
    n_params = count_params(cfg.model)
    compiled, compile_s, mem = None, 0.0, {}
    if start_step < c.steps:  # a finished run launched again has no step to compile
        t0 = time.perf_counter()
        first = global_batch(run.plan, batches.batch(start_step))
        compiled = run.train_step.lower(run.state, first).compile()
        compile_s = time.perf_counter() - t0
        mem = compiled_memory(compiled)
        if run.is_main:
            print(f"fsdp_jax: {n_params / 1e6:.2f}M params | {jax.device_count()} devices "
                  f"{dict(run.mesh.shape)} | {run.plan.strategy.name} | {cfg.precision} | remat {cfg.remat} | "
                  f"compiled in {compile_s:.1f}s | per-device state "
                  f"{mem['argument'] / 2**20:.1f} MiB, peak {mem['peak'] / 2**20:.1f} MiB", flush=True)
    timer.switch("other")

    bar = None
    if run.is_main and progress:
        from tqdm import tqdm
        bar = tqdm(total=c.steps, initial=start_step, dynamic_ncols=True, desc="train")
    state = run.state
    pending: deque = deque()
    window = LogWindow(start_step, schedule=run.schedule, tokens_per_step=c.global_batch * cfg.data.seq_len,
                       flops_per_token=flops_per_token(cfg.model, cfg.data.seq_len),
                       peak_flops=peak_flops(jax.devices()[0], Policy.parse(cfg.precision).compute_dtype.name),
                       n_devices=jax.device_count(), compiled_peak_bytes=mem.get("peak"),
                       timer=timer, warn=print if run.is_main else None)
    summary: dict[str, Any] = {"compile_s": compile_s, "params": n_params}
    nan_steps = _injected_nan_steps()
    streak: list[int] = []  # the current run of skipped (non-finite) steps

    def extras(done: int) -> dict:
        return {"step": done, "data": batches.get_state(), "rng": _rng_to_json(run.rng),
                "config": config_to_dict(cfg)}

    done = start_step  # the last step done, also when none is left to do
    for step_i in range(start_step, c.steps):
        done = step_i + 1
        profiler.step_begin(done)
        timer.switch("data")
        local = next(batches)
        if data_delay:
            time.sleep(data_delay)
        check_tokens(local, cfg.model.vocab_size, done, cfg.data.path)
        ckpt.check()  # a failed background save stops the run now, not at the next save
        if done in nan_steps:
            if isinstance(local, dict):
                local = {**local, "inputs": local["inputs"].copy()}
                local["inputs"][:, 0] = cfg.model.vocab_size
            else:
                local = local.copy()
                local[:, 0] = cfg.model.vocab_size
        batch = global_batch(run.plan, local)
        timer.switch("device")  # dispatch here, and blocking on results below
        state, metrics = compiled(state, batch)
        pending.append((done, metrics))
        stop = signals.requested() or done == stop_after
        save = stop or done == c.steps or bool(c.checkpoint_every and done % c.checkpoint_every == 0)
        if len(pending) >= max(1, c.max_inflight_steps) or done == c.steps or save:
            while pending:  # bounded run-ahead: on CPU, unbounded queues hit rendezvous timeouts
                s, m = pending.popleft()
                loss, gnorm, skipped = float(m["loss"]), float(m["grad_norm"]), int(m["skipped"])
                trained = float(m["tokens"]) if "tokens" in m else None
                if skipped:
                    streak.append(s)
                    if run.is_main:
                        print(f"warning: step {s}: non-finite loss/grad norm ({loss}, {gnorm}); "
                              f"update skipped ({len(streak)} in a row)", flush=True)
                else:
                    streak.clear()
                window.add(loss, gnorm, trained)
                if bar is not None:
                    bar.update(1)
        timer.switch("other")
        profiler.step_end(done, pending)
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
            rec = window.record(done)
            log.write(rec)
            summary.update(train_loss=rec["loss"], tokens_per_s=rec["tokens_per_s"])
            window.reset(done)
            if bar is not None:  # the logged window's figures, as in metrics.jsonl
                bar.set_postfix(loss=f"{rec['loss']:.3f}", lr=f"{rec['lr']:.2e}",
                                gnorm=f"{rec['grad_norm']:.2f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                                mfu=f"{rec['mfu']:.1%}" if rec.get("mfu") else "n/a", time=format_window(rec))
        if val and not stop and (done % c.eval_every == 0 or done == c.steps):
            timer.switch("eval")
            t_eval = time.perf_counter()
            vl = evaluate(run, state.params, val)
            log.write({"step": done, "val_loss": vl})
            summary["val_loss"] = vl
            if bar is not None:
                bar.write(f"step {done}: val_loss {vl:.4f} ({vl / math.log(2):.3f} bits/token)")
            window.add_eval_time(time.perf_counter() - t_eval)
            timer.switch("other")
        # No periodic checkpoint inside a run of skipped steps: the newest one stays
        # the last good update (the state is unchanged, only the data position moved).
        timer.switch("checkpoint")
        if save and (not streak or stop or done == c.steps):
            ckpt.save(done, state, extras(done))
        timer.switch("other")
        if stop:
            summary["preempted"] = signals.name or f"stop_after={stop_after}"
            break
    if bar is not None:
        bar.close()
    profiler.close(done, pending)
    timer.switch("checkpoint")
    ckpt.wait()  # the writes' commit is part of the run's checkpoint cost
    timer.switch("sample")
    run.state = state
    summary["final_step"] = int(state.step)
    if "preempted" in summary:
        ckpt.wait()
        if run.is_main:
            print(f"stopped ({summary['preempted']}) after step {done}: checkpoint "
                  f"{ckpt.step_dir(done)} written", flush=True)
    else:
        if c.sample_tokens:
            summary["sample"] = sample_text(  # sampling reads params on the device
                run.model, dataclasses.replace(run.plan, params=offload_lib.on_device(run.plan.params)),
                cfg, jax.device_put(state.params, offload_lib.on_device(run.plan.params)), val, run.rng)
        if run.is_main and start_step >= c.steps:
            print(f"nothing to do: the run already finished train.steps={c.steps} "
                  f"(checkpoint step {run.restored.step if run.restored else start_step}); "
                  "raise train.steps to train further", flush=True)
        elif run.is_main:
            print(f"final: train_loss {summary.get('train_loss', float('nan')):.4f}"
                  + (f" | val_loss {summary['val_loss']:.4f} nats/token" if "val_loss" in summary else ""),
                  flush=True)
            if "sample" in summary:
                print("sample:\n" + summary["sample"], flush=True)
    good = goodput(timer.totals(), run.setup_s)
    log.write({"step": done, **{k: v for k, v in good.items() if k != "largest_losses"}})
    summary["goodput"] = good
    if run.is_main:
        print(format_goodput(good), flush=True)
    log.close()
    summary["run"] = run
    return summary
