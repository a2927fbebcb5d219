"""What a training run reports: `metrics.jsonl` (+ TensorBoard, + Weights & Biases),
its train records and the text sample at the end.

`MetricsLog` appends one JSON object per line to `<run_dir>/metrics.jsonl` on
process 0, mirrors the numeric values to TensorBoard (`<run_dir>/tb`) when enabled,
and logs every record, same keys, to W&B (`logging.wandb`; files under
`<run_dir>/wandb`). `LogWindow` turns the steps since the last record into one train
record:

    {"step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "mfu",
     "compiled_peak_bytes", "bytes_in_use", "peak_bytes_in_use" (these two only where
     the device reports them: GPU, TPU),
     "t_data_s", "t_device_s", "t_checkpoint_s", "t_eval_s", "t_compile_s",
     "t_profile_s", "t_log_s", "t_other_s", "t_wall_s" (with a StepTimer:
     fsdp_jax.app.trainer.timing)}

loss and grad_norm are means over the window; step time is wall time per step,
evaluation, compilation and profiler start/stop excluded. The `t_*_s` columns are
the window's wall seconds by category and add up to `t_wall_s`. Evaluation writes
its own `{"step", "val_loss"}` records, and the end of a run one goodput record
(`{"step", "goodput", "total_wall_s", "total_<category>_s"}`).
`sample_text` continues a validation prompt with the trained params (sharded like
training) for the run's final report.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fsdp_jax.app.config.parse import config_to_dict
from fsdp_jax.app.data.tokenizer import load_tokenizer
from fsdp_jax.app.data.windows import load_meta
from fsdp_jax.app.models.sample import sample
from fsdp_jax.app.objectives import finish_metrics, grpo
from fsdp_jax.app.objectives.preference_run import is_preference
from fsdp_jax.app.trainer.router_metrics import summarise
from fsdp_jax.errors import TokenizerError
from fsdp_jax.sharding.context import context_size, unzigzag, zigzag
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.sharding.strategy import ShardingPlan, batch_divisor
from fsdp_jax.targets.perf import device_memory, memory_excess, mfu
from fsdp_jax.train.step import sharding_context

if TYPE_CHECKING:
    from fsdp_jax.app.config.schema import Config
    from fsdp_jax.app.trainer.timing import StepTimer
    from fsdp_jax.model.fns import ModelFns


def json_safe(record: dict) -> dict:
    """`record` with non-finite floats as null (bare NaN/Infinity is not JSON) and their
    keys listed under "nonfinite", e.g. {"loss": null, "nonfinite": ["loss"]}."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return record
    return {**{k: None if k in bad else v for k, v in record.items()}, "nonfinite": bad}


class MetricsLog:
    """Appends JSON lines to run_dir/metrics.jsonl (process 0) and mirrors scalars to
    TensorBoard and W&B (`wandb`: `wandb_settings(cfg)`) when enabled. With a
    `timer`, the time spent starting the loggers and writing is charged to `log`."""

    def __init__(
        self, run_dir: Path, enabled: bool, tensorboard: bool, wandb: dict | None = None, timer: StepTimer | None = None
    ):
        self.enabled, self.timer = enabled, timer
        self.path = run_dir / "metrics.jsonl"
        self.tb = self.wandb = None
        with self._timed():
            if enabled and tensorboard:
                from tensorboardX import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tb"))
            if enabled and wandb is not None:
                self.wandb = _wandb_run(run_dir, **wandb)

    @contextlib.contextmanager
    def _timed(self):
        before = self.timer.current if self.timer is not None else None
        if before is not None:
            self.timer.switch("log")
        try:
            yield
        finally:
            if before is not None:
                self.timer.switch(before)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self._timed():
            self._write(record)

    def _write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None:
                    self.tb.add_scalar(k, v, record["step"])
        if self.wandb is not None:  # records of one step merge into one W&B history row
            self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def truncate(self, step: int) -> None:
        """Drop records after `step` (written by a run that died after its last checkpoint)."""
        if not self.enabled or not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:  # a line cut short by a crash
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step", 0), int) and rec.get("step", 0) <= step:
                keep.append(line)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)

    def close(self):
        with self._timed():
            if self.tb is not None:
                self.tb.close()
            if self.wandb is not None:
                self.wandb.finish()
                self.wandb = None


def wandb_settings(cfg: Config) -> dict | None:
    """`MetricsLog`'s `wandb` argument from the config's logging section (None: off)."""
    lg = cfg.logging
    if not lg.wandb:
        return None

    return {"project": lg.wandb_project, "name": lg.wandb_run_name, "config": config_to_dict(cfg)}


def _wandb_run(run_dir: Path, project: str, name: str | None, config: dict):
    """A W&B run writing under run_dir/wandb; the mode (online, offline, disabled)
    comes from W&B's own settings, e.g. WANDB_MODE=offline (no network needed)."""
    try:
        import wandb
    except ImportError:  # validate() checks this first; here for direct MetricsLog users
        from fsdp_jax.errors import ConfigError

        raise ConfigError(
            "logging.wandb",
            "true, but the wandb package is not installed; pip install wandb, or set logging.wandb=false",
        ) from None
    run_dir.mkdir(parents=True, exist_ok=True)
    return wandb.init(project=project, name=name, dir=str(run_dir), config=config)


class LogWindow:
    """The steps since the last train record: their (loss, grad_norm) and wall time.

    `schedule(i)`: the learning rate of 0-based step i. `tokens_per_step` (global
    batch x sequence length), `flops_per_token`, `peak_flops` (per device, for MFU;
    None when unknown), `n_devices` and `compiled_peak_bytes` (None when no step was
    compiled: a finished run launched again) are fixed for a run.
    `add_eval_time` takes time spent evaluating inside the window out of step time.

    With a `timer` (fsdp_jax.app.trainer.timing.StepTimer) the record carries its `t_*_s`
    breakdown and the window's wall time is the timer's (the first window then
    includes what the timer saw before it, e.g. compilation); `record` cuts the
    timer's window, so the windows tile the loop (writing a record falls in the next
    one). `warn(message)` is called once if the device's measured peak exceeds
    `compiled_peak_bytes` by more than 10%."""

    def __init__(
        self,
        step: int,
        *,
        schedule: Callable[[int], Any],
        tokens_per_step: int,
        flops_per_token: float,
        peak_flops: float | None,
        n_devices: int,
        compiled_peak_bytes: int | None,
        timer: StepTimer | None = None,
        warn: Callable[[str], None] | None = None,
    ):
        self.schedule = schedule
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak_flops, self.n_devices = peak_flops, n_devices
        self.compiled_peak_bytes = compiled_peak_bytes
        self.timer, self.warn = timer, warn
        self.values: list[tuple[float, float]] = []
        self.host: list[dict] = []  # host-side figures of the window's steps (GRPO's rewards), averaged
        self.reset(step)

    def reset(self, step: int) -> None:
        """Start a new window after `step` (now)."""
        self.values.clear()
        self.router: list[dict] = []
        self.host.clear()  # (cleared in place: a GRPO run's batches hold its append)
        self.t, self.step, self.eval_s = time.perf_counter(), step, 0.0

    def add(self, loss: float, grad_norm: float, trained_tokens: float | None = None, router=None) -> None:
        """One step's figures; `trained_tokens`: the unmasked targets of its global batch
        (packed / masked batches), logged as trained_tokens and trained_tokens_per_s;
        `router`: a mixture-of-experts step's router aux (`router_metrics.summarise`)."""
        self.values.append((loss, grad_norm, trained_tokens))
        if router is not None:
            self.router.append(router)

    def add_eval_time(self, seconds: float) -> None:
        self.eval_s += seconds

    def __bool__(self) -> bool:
        return bool(self.values)

    def record(self, step: int) -> dict:
        """The train record for the window ending at `step` (1-based; does not reset the
        losses, but starts the timer's next window)."""
        n = max(1, step - self.step)
        before = self.timer.current if self.timer is not None else None
        if before is not None:
            self.timer.switch("log")  # computing the record is logging work too
        lr = float(self.schedule(step - 1))  # the first call compiles the schedule
        dm = device_memory()
        if before is not None:
            tw = self.timer.window()
            self.timer.cut()
            self.timer.switch(before)
            dt = (tw["t_wall_s"] - tw["t_eval_s"] - tw["t_compile_s"] - tw["t_profile_s"]) / n
        else:
            tw, dt = {}, (time.perf_counter() - self.t - self.eval_s) / n
        tps = self.tokens_per_step / dt
        rec = {
            "step": step,
            "loss": float(np.mean([w[0] for w in self.values])),
            "lr": lr,
            "grad_norm": float(np.mean([w[1] for w in self.values])),
            "step_time_s": dt,
            "tokens_per_s": tps,
            "mfu": mfu(self.flops_per_token, tps, self.n_devices, self.peak_flops),
            "compiled_peak_bytes": self.compiled_peak_bytes,
        }
        if dm:
            rec["bytes_in_use"], rec["peak_bytes_in_use"] = dm["bytes_in_use"], dm["peak_bytes_in_use"]
            excess = memory_excess(dm["peak_bytes_in_use"], self.compiled_peak_bytes)
            if excess and self.warn is not None:
                self.warn(f"warning: {excess}")
                self.warn = None  # once per run
        trained = [w[2] for w in self.values if w[2] is not None]
        if trained and self.router and "pairs" in self.router[0]:  # packed preference rows: the count is pairs
            rec["pairs"] = int(sum(trained))
        elif trained:
            rec["trained_tokens"] = int(sum(trained))
            rec["trained_tokens_per_s"] = sum(trained) / len(trained) / dt
        # the step's aux: a preference loss's metrics (TRL's names), or a mixture of experts' router terms
        pref = bool(self.router) and "rewards/margins" in self.router[0]
        if self.router and "kl_sum" in self.router[0]:  # GRPO's loss metrics (TRL's names)
            rec.update(grpo.finish_metrics(self.router, beta=1.0))
        else:
            rec.update(finish_metrics(self.router) if pref else summarise(self.router))
            if pref and "router" in self.router[0]:  # a mixture of experts under a preference loss
                rec.update(summarise([a["router"] for a in self.router]))
        for k in dict.fromkeys(k for h in self.host for k in h):
            rec[k] = float(np.nanmean([h[k] for h in self.host if k in h]))
        rec.update(tw)
        return rec


def sample_text(model: ModelFns, plan: ShardingPlan, cfg: Config, params, val, rng: jax.Array) -> str:
    """A short continuation (`cfg.train.sample_tokens` tokens) of a validation prompt
    (the first 48 tokens of `val`'s first batch, else "def "), decoded with the corpus'
    tokenizer (meta.json: bytes, or the path of a tokenizer.json / SentencePiece model)
    or else shown as token ids. The window is the trained length (data.seq_len, at most
    model.max_seq_len). `params` are in `plan.params` layout; the forward runs sharded
    like training (the prompt is repeated over the batch devices), so it works for any
    model the run can train, on every process. With `mesh.context` > 1 the window runs in
    the training layout too (zig-zag rows with their positions, sharded over `context`,
    `fsdp_jax.sharding.context`) rather than gathered onto a context-1 layout: a long
    context's activations then fit where training's did, and one compiled forward serves."""
    n = batch_divisor(plan.mesh)
    window = min(cfg.model.max_seq_len, cfg.data.seq_len)
    policy = Policy.parse(cfg.precision)
    apply = model.apply
    if model.abstract_model_state is not None:  # FP8 histories: zeros = scaled by the current amax
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), model.abstract_model_state)

        def apply(*args):
            return model.apply(*args, state=zeros, train=False)[0]

    def fwd(p, buf, pos):
        tokens = jnp.broadcast_to(buf[None, :], (n, window))
        c = context_size()  # traced under sharding_context(plan): the run's mesh
        if c == 1:
            logits = apply(policy.cast_to_compute(p), tokens)
        else:  # slots in zig-zag order, each token with its own RoPE position
            positions = jnp.broadcast_to(jnp.arange(window, dtype=jnp.int32), (n, window))
            tokens, positions = zigzag((tokens, positions), c)
            logits = unzigzag(apply(policy.cast_to_compute(p), tokens, None, positions), c)
        return jax.lax.dynamic_index_in_dim(logits[0], pos - 1, keepdims=False).astype(jnp.float32)

    replicated = NamedSharding(plan.mesh, P())
    jitted = jax.jit(fwd, in_shardings=(plan.params, replicated, replicated), out_shardings=replicated)

    def next_logits(buf, pos):
        with sharding_context(plan):
            return jax.device_get(jitted(params, jnp.asarray(buf), jnp.int32(pos)))

    # a preference run's rows: its own tokenizer (UTF-8 bytes without one); a corpus: its meta.json's
    kind = (cfg.preference.tokenizer or "bytes") if is_preference(cfg) else load_meta(cfg.data.path).get("tokenizer")
    tok = _tokenizer(kind)
    default = tok.encode("def ") if tok else list(b"def ")
    prompt = (_val_prompt(val[0]) if val else np.asarray(default)).astype(np.int32)
    out = sample(next_logits, prompt, cfg.train.sample_tokens, window, rng)
    if kind == "bytes":
        text = bytes(prompt.tolist()).decode("utf-8", "replace")
        return text + "\u2016" + bytes([t % 256 for t in out]).decode("utf-8", "replace")
    if tok is not None:
        return tok.decode(prompt.tolist()) + "\u2016" + tok.decode(out)
    return " ".join(map(str, out))


def _val_prompt(batch) -> np.ndarray:
    """The first 48 tokens of a val batch's first row; of a packed row, its first
    example up to its first trained target (the whole prompt whose answer was held out); of
    preference pairs, the first pair's prompt (of packed pairs, the first row's)."""
    if not isinstance(batch, dict):
        return np.asarray(batch[0][:48])
    if "completion" in batch and "segment_ids" in batch:  # packed pairs: segment 1 is the first chosen sequence
        row, seg = np.asarray(batch["tokens"][0]), np.asarray(batch["segment_ids"][0])
        return row[(seg == 1) & (np.asarray(batch["completion"][0]) == 0)]
    if "completion" in batch:  # preference pairs: the first pair's prompt (its real, non-completion tokens)
        row = np.asarray(batch["tokens"][0, 0])
        keep = (np.asarray(batch["attention"][0, 0]) > 0) & (np.asarray(batch["completion"][0, 0]) == 0)
        return row[keep]
    seg, w = np.asarray(batch["segment_ids"][0]), np.asarray(batch["weights"][0])
    first = int(np.argmax(w > 0)) if (w > 0).any() else 47
    return np.asarray(batch["inputs"][0][: first + 1][seg[: first + 1] == seg[0]])


def _tokenizer(kind: str | None):
    """The corpus tokenizer named in meta.json, or None (bytes, external ids, or a
    tokenizer file that is gone: the sample is then shown as ids)."""
    if kind in (None, "bytes", "external"):
        return None

    try:
        return load_tokenizer(kind, require_eos=False)
    except TokenizerError as e:
        print(f"warning: sample shown as token ids: {e}", flush=True)
        return None
