"""What a training run reports: `metrics.jsonl` (+ TensorBoard), its train records
and the text sample at the end.

`MetricsLog` appends one JSON object per line to `<run_dir>/metrics.jsonl` on
process 0 and mirrors the numeric values to TensorBoard (`<run_dir>/tb`) when
enabled. `LogWindow` turns the steps since the last record into one train record:

    {"step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "mfu",
     "compiled_peak_bytes", "peak_bytes_in_use" (only where the device reports it)}

loss and grad_norm are means over the window; step time is wall time per step,
evaluation excluded. Evaluation writes its own `{"step", "val_loss"}` records.
`sample_text` continues a validation prompt with the trained params (sharded like
training) for the run's final report.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from fsdp_jax.app import data as data_lib
from fsdp_jax.app.models.llama import sample
from fsdp_jax.perf import device_memory, mfu
from fsdp_jax.precision import Policy
from fsdp_jax.step import sharding_context
from fsdp_jax.strategy import ShardingPlan, batch_divisor

if TYPE_CHECKING:
    from fsdp_jax.adapters import ModelFns
    from fsdp_jax.app.config import Config


def json_safe(record: dict) -> dict:
    """`record` with non-finite floats as null (bare NaN/Infinity is not JSON) and their
    keys listed under "nonfinite", e.g. {"loss": null, "nonfinite": ["loss"]}."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return record
    return {**{k: None if k in bad else v for k, v in record.items()}, "nonfinite": bad}


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
            f.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
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
                rec = json.loads(line)
            except ValueError:  # a line cut short by a crash
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step", 0), int) and rec.get("step", 0) <= step:
                keep.append(line)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)

    def close(self):
        if self.tb is not None:
            self.tb.close()


class LogWindow:
    """The steps since the last train record: their (loss, grad_norm) and wall time.

    `schedule(i)`: the learning rate of 0-based step i. `tokens_per_step` (global
    batch x sequence length), `flops_per_token`, `peak_flops` (per device, for MFU;
    None when unknown), `n_devices` and `compiled_peak_bytes` are fixed for a run.
    `add_eval_time` takes time spent evaluating inside the window out of step time."""

    def __init__(self, step: int, *, schedule: Callable[[int], Any], tokens_per_step: int,
                 flops_per_token: float, peak_flops: float | None, n_devices: int,
                 compiled_peak_bytes: int):
        self.schedule = schedule
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak_flops, self.n_devices = peak_flops, n_devices
        self.compiled_peak_bytes = compiled_peak_bytes
        self.values: list[tuple[float, float]] = []
        self.reset(step)

    def reset(self, step: int) -> None:
        """Start a new window after `step` (now)."""
        self.values.clear()
        self.t, self.step, self.eval_s = time.perf_counter(), step, 0.0

    def add(self, loss: float, grad_norm: float) -> None:
        self.values.append((loss, grad_norm))

    def add_eval_time(self, seconds: float) -> None:
        self.eval_s += seconds

    def __bool__(self) -> bool:
        return bool(self.values)

    def record(self, step: int) -> dict:
        """The train record for the window ending at `step` (1-based; does not reset)."""
        dt = (time.perf_counter() - self.t - self.eval_s) / max(1, step - self.step)
        tps = self.tokens_per_step / dt
        rec = {"step": step, "loss": float(np.mean([w[0] for w in self.values])),
               "lr": float(self.schedule(step - 1)), "grad_norm": float(np.mean([w[1] for w in self.values])),
               "step_time_s": dt, "tokens_per_s": tps,
               "mfu": mfu(self.flops_per_token, tps, self.n_devices, self.peak_flops),
               "compiled_peak_bytes": self.compiled_peak_bytes}
        dm = device_memory()
        if dm:
            rec["peak_bytes_in_use"] = dm["peak_bytes_in_use"]
        return rec


def sample_text(model: ModelFns, plan: ShardingPlan, cfg: Config, params, val, rng: jax.Array) -> str:
    """A short continuation (`cfg.train.sample_tokens` tokens) of a validation prompt
    (the first 48 tokens of `val`'s first batch, else "def "), decoded as bytes (byte
    tokenizer) or else as token ids. `params` are in `plan.params` layout; the forward
    runs sharded like training (the prompt is repeated over the batch devices), so it
    works for any model the run can train, on every process."""
    n = batch_divisor(plan.mesh)
    window = cfg.model.max_seq_len
    policy = Policy.parse(cfg.precision)

    def fwd(p, buf, pos):
        tokens = jnp.broadcast_to(buf[None, :], (n, window))
        logits = model.apply(policy.cast_to_compute(p), tokens)
        return jax.lax.dynamic_index_in_dim(logits[0], pos - 1, keepdims=False).astype(jnp.float32)

    replicated = NamedSharding(plan.mesh, P())
    jitted = jax.jit(fwd, in_shardings=(plan.params, replicated, replicated), out_shardings=replicated)

    def next_logits(buf, pos):
        with sharding_context(plan):
            return jax.device_get(jitted(params, jnp.asarray(buf), jnp.int32(pos)))

    prompt = (np.asarray(val[0][0][:48]) if val else np.frombuffer(b"def ", np.uint8)).astype(np.int32)
    out = sample(next_logits, prompt, cfg.train.sample_tokens, window, rng)
    if data_lib.load_meta(cfg.data.path).get("tokenizer") == "bytes":
        text = bytes(prompt.tolist()).decode("utf-8", "replace")
        return text + "\u2016" + bytes([t % 256 for t in out]).decode("utf-8", "replace")
    return " ".join(map(str, out))
