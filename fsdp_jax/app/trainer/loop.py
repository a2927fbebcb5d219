"""The training loop: `setup` (`fsdp_jax.app.trainer.setup`), a short loop, and hooks.

`train(cfg)` checks the inputs (`preflight`), takes the run directory, builds the run
(`setup`: validate -> data -> model -> mesh -> build -> state), then steps: read a
batch, run the compiled step, and hand the step to the hooks (`fsdp_jax.app.trainer.hooks`:
profile, non-finite guard, log, eval, checkpoint, each every N steps; sampling at the
end). Metrics go to a tqdm bar, `metrics.jsonl` and (optionally) TensorBoard
(`fsdp_jax.app.trainer.metrics`).

Fault tolerance: checkpoints go to `<run_dir>/checkpoints` every `checkpoint_every`
steps and at the end (asynchronously); running the same command again resumes
exactly from the newest checkpoint that restores (data order and LR schedule
included). SIGTERM/SIGINT finish the step, checkpoint and return normally; a second
signal exits at once (`fsdp_jax.app.trainer.preemption`). `max_nonfinite_steps` skipped steps
in a row raise `TrainingDiverged` with the last good checkpoint intact. Bad input is
found by `preflight` before anything is written; process 0 then holds
`<run_dir>/.lock` (`fsdp_jax.app.trainer.run_dir`), so a second trainer on the same run_dir is
refused; a save that fails (disk full) raises `CheckpointWriteError` at the next step.
Tests inject faults with `train(cfg, faults=Faults(...))` (`fsdp_jax.app.trainer.faults`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
from tqdm import tqdm

from fsdp_jax.app import held_warnings
from fsdp_jax.app.config.parse import save_config
from fsdp_jax.app.config.schema import Config
from fsdp_jax.app.data.batches import check_segments, check_tokens, global_batch, make_batches
from fsdp_jax.app.models.decoder import count_params, flops_per_token
from fsdp_jax.app.objectives.grpo_run import GrpoBatches, is_grpo
from fsdp_jax.app.objectives.preference_run import is_preference, make_preference_batches, pair_rows
from fsdp_jax.app.trainer.build import lora_spec
from fsdp_jax.app.trainer.faults import Faults
from fsdp_jax.app.trainer.hooks import CheckpointHook, Hook, LoopState, default_hooks
from fsdp_jax.app.trainer.metrics import LogWindow, MetricsLog, wandb_settings
from fsdp_jax.app.trainer.preemption import StopSignals
from fsdp_jax.app.trainer.run_dir import RunDirLock
from fsdp_jax.app.trainer.setup import Run, preflight, setup
from fsdp_jax.app.trainer.timing import ProfileWindow, StepTimer, format_goodput, goodput
from fsdp_jax.errors import RewardFailed
from fsdp_jax.hlo.memory import compiled_memory
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.targets.perf import peak_flops


def train(
    cfg: Config,
    *,
    init_params: Callable | None = None,
    progress: bool = True,
    stop_after: int | None = None,
    faults: Faults | None = None,
    hooks: list[Hook] | None = None,
) -> dict:
    """Train per `cfg`, resuming from `<run_dir>/checkpoints` when it holds a checkpoint;
    returns a summary dict (final train/val loss, tokens/s, sample; `preempted` when a
    signal or `stop_after` (a step number) ended it early, after checkpointing).
    `faults`: what to break, for tests (None: `Faults.from_env()`, the commands' test
    hook). `hooks`: more hooks, run after the trainer's own (`default_hooks`).
    Raises TrainingDiverged after `train.max_nonfinite_steps` skipped steps in a row."""
    with StopSignals() as signals:  # from here on, until the last write is committed
        t_setup = time.perf_counter()
        preflight(cfg, progress)  # bad input fails here, before anything is written
        faults = Faults.from_env() if faults is None else faults  # a bad test-hook value too
        with RunDirLock(cfg.run_dir):  # one writer per run_dir
            run = setup(cfg, init_params, validated=True)
            run.setup_s = time.perf_counter() - t_setup
            held_warnings.release()  # set up: the run's warnings print from here (app/held_warnings.py)
            try:
                return _loop(run, progress, stop_after, signals, faults, hooks)
            finally:
                run.checkpointer.close()  # waits for checkpoint writes in flight


def _start(run: Run, progress: bool) -> tuple[LoopState, Any, ProfileWindow]:
    """The loop's state before the first step: logs opened, data positioned, the step
    compiled (its memory reported). Returns (state, compiled step or None, profiler)."""
    cfg, c = run.cfg, run.cfg.train
    timer = StepTimer("setup")  # where the wall time goes (fsdp_jax.app.trainer.timing)
    if run.is_main:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run.run_dir / "config.yaml")
    log = MetricsLog(run.run_dir, run.is_main, c.tensorboard, wandb=wandb_settings(cfg), timer=timer)
    log.truncate(run.start_step)  # a fresh start (0) drops the rows of a run that died before saving
    if is_grpo(cfg):  # the policy makes its own batches (objectives.grpo_run)
        batches, val = GrpoBatches(run), []
    else:
        make = make_preference_batches if is_preference(cfg) else make_batches
        batches, val = make(cfg, jax.process_index(), jax.process_count())
    batches.set_state(
        run.restored.extras.get("data", {"step": run.start_step}) if run.restored else {"step": run.start_step}
    )
    profiler = ProfileWindow(c.profile, run.run_dir / "profile", timer, run.is_main)
    timer.switch("compile")
    timer.cut()  # the first logged window starts here
    compiled, compile_s, mem = _compile(run, batches)
    timer.switch("other")
    window = LogWindow(
        run.start_step,
        schedule=run.schedule,
        tokens_per_step=c.global_batch * _row_len(cfg),
        flops_per_token=flops_per_token(cfg.model, cfg.data.seq_len, lora_spec(cfg)),
        peak_flops=peak_flops(jax.devices()[0], Policy.parse(cfg.precision).compute_dtype.name),
        n_devices=jax.device_count(),
        compiled_peak_bytes=mem.get("peak"),
        timer=timer,
        warn=print if run.is_main else None,
    )
    bar = None
    if run.is_main and progress:
        bar = tqdm(total=c.steps, initial=run.start_step, dynamic_ncols=True, desc="train")
    summary = {"compile_s": compile_s, "params": count_params(cfg.model)}
    lp = LoopState(run, cfg, timer, log, batches, val, window, run.state, c.steps, summary, bar, done=run.start_step)
    if is_grpo(cfg):  # generation reads the current params; its reward metrics join the log window
        batches.state_fn, batches.sink = (lambda: lp.state), window.host.append
    return lp, compiled, profiler


def _row_len(cfg) -> int:
    """Tokens per row of a step's batch: pairs count 2 rows (a packed preference row 1); GRPO rows
    are prompt + completion."""
    if is_grpo(cfg):
        return cfg.grpo.max_prompt_len + cfg.grpo.max_new_tokens
    return cfg.data.seq_len * pair_rows(cfg)


def _compile(run: Run, batches) -> tuple[Any, float, dict]:
    """(compiled step, seconds, memory) for the first batch; (None, 0, {}) when the run
    has no step left (a finished run launched again)."""
    cfg = run.cfg
    if run.start_step >= cfg.train.steps:
        return None, 0.0, {}
    t0 = time.perf_counter()
    first = global_batch(run.plan, batches.batch(run.start_step))
    compiled = run.train_step.lower(run.state, first).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled_memory(compiled)
    if run.is_main:
        print(
            f"fsdp_jax: {count_params(cfg.model) / 1e6:.2f}M params | {jax.device_count()} devices "
            f"{dict(run.mesh.shape)} | {run.plan.strategy.name} | {cfg.precision} | remat {cfg.remat} | "
            f"compiled in {compile_s:.1f}s | per-device state "
            f"{mem['argument'] / 2**20:.1f} MiB, peak {mem['peak'] / 2**20:.1f} MiB",
            flush=True,
        )
    return compiled, compile_s, mem


def _read_metrics(lp: LoopState) -> None:
    """Block on the pending steps' metrics (in order): skipped-step streak, log window."""
    while lp.pending:  # bounded run-ahead: on CPU, unbounded queues hit rendezvous timeouts
        s, m = lp.pending.popleft()
        loss, gnorm, skipped = float(m["loss"]), float(m["grad_norm"]), int(m["skipped"])
        if skipped:
            lp.streak.append(s)
            if lp.run.is_main:
                print(
                    f"warning: step {s}: non-finite loss/grad norm ({loss}, {gnorm}); "
                    f"update skipped ({len(lp.streak)} in a row)",
                    flush=True,
                )
        else:
            lp.streak.clear()
        lp.window.add(loss, gnorm, float(m["tokens"]) if "tokens" in m else None, m.get("aux"))
        if lp.bar is not None:
            lp.bar.update(1)


def _loop(
    run: Run, progress: bool, stop_after: int | None, signals: StopSignals, faults: Faults, hooks: list[Hook] | None
) -> dict:
    lp, compiled, profiler = _start(run, progress)
    hooks = default_hooks(run.cfg, profiler) + list(hooks or ())
    c, timer = run.cfg.train, lp.timer
    cudnn_ring = run.cfg.model.attention == "cudnn" and dict(run.plan.mesh.shape).get("context", 1) > 1
    for step_i in range(run.start_step, c.steps):
        lp.done = step_i + 1
        for h in hooks:
            h.before_step(lp)
        timer.switch("data")
        try:
            local = next(lp.batches)
        except RewardFailed:  # nothing lost: the state before this step is saved, then the run stops
            _save_now(lp, hooks)
            raise
        if faults.data_delay_s:
            time.sleep(faults.data_delay_s)
        check_tokens(local, run.cfg.model.vocab_size, lp.done, run.cfg.data.path)
        if cudnn_ring:  # packed rows within cuDNN's packed layout per ring block
            check_segments(local, run.cfg.model.max_segments, lp.done, run.cfg.data.path)
        run.checkpointer.check()  # a failed background save stops the run now, not at the next save
        local = faults.poison(lp.done, local, run.cfg.model.vocab_size)
        batch = global_batch(run.plan, local)
        timer.switch("device")  # dispatch here, and blocking on results below
        lp.state, metrics = compiled(lp.state, batch)
        lp.pending.append((lp.done, metrics))
        stopping = signals.requested() or lp.done == stop_after
        lp.stop = (signals.name or f"stop_after={stop_after}") if stopping else None
        if (
            len(lp.pending) >= max(1, c.max_inflight_steps)
            or lp.done == c.steps
            or any(h.needs_metrics(lp) for h in hooks)
        ):
            _read_metrics(lp)
        timer.switch("other")
        for h in hooks:
            h.after_step(lp)
        if lp.stop is not None:
            lp.summary["preempted"] = lp.stop
            break
    return _finish(lp, hooks)


def _save_now(lp: LoopState, hooks: list[Hook]) -> None:
    """Checkpoint the state of the last finished step (unless saved already) and wait."""
    lp.done -= 1  # the step that failed to start
    _read_metrics(lp)
    if lp.done > lp.run.start_step and lp.done not in lp.run.checkpointer.steps():
        lp.stop = "reward failure"
        for h in hooks:
            if isinstance(h, CheckpointHook):
                h.after_step(lp)
    lp.run.checkpointer.wait()
    lp.batches.close()


def _finish(lp: LoopState, hooks: list[Hook]) -> dict:
    run, c, summary = lp.run, lp.cfg.train, lp.summary
    if hasattr(lp.batches, "close"):
        lp.batches.close()
    if lp.bar is not None:
        lp.bar.close()
    for h in hooks:
        h.at_end(lp)
    run.state = lp.state
    summary["final_step"] = int(lp.state.step)
    if run.is_main and lp.stop is not None:
        print(
            f"stopped ({lp.stop}) after step {lp.done}: checkpoint {run.checkpointer.step_dir(lp.done)} written",
            flush=True,
        )
    elif run.is_main and run.start_step >= c.steps:
        print(
            f"nothing to do: the run already finished train.steps={c.steps} "
            f"(checkpoint step {run.restored.step if run.restored else run.start_step}); "
            "raise train.steps to train further",
            flush=True,
        )
    elif run.is_main:
        print(
            f"final: train_loss {summary.get('train_loss', float('nan')):.4f}"
            + (f" | val_loss {summary['val_loss']:.4f} nats/token" if "val_loss" in summary else "")
            + (
                f" | eval_loss {summary['eval_loss']:.4f}, eval_rewards/accuracies {summary['eval_accuracy']:.3f}"
                if "eval_loss" in summary
                else ""
            ),
            flush=True,
        )
        if "sample" in summary:
            print("sample:\n" + summary["sample"], flush=True)
    good = goodput(lp.timer.totals(), run.setup_s)
    lp.log.write({"step": lp.done, **{k: v for k, v in good.items() if k != "largest_losses"}})
    summary["goodput"] = good
    if run.is_main:
        print(format_goodput(good), flush=True)
    lp.log.close()
    summary["run"] = run
    return summary
