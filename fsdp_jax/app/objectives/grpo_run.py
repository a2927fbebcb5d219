"""A GRPO run's pieces from its config: the spec, the rewards, the checks, and the batches.

`objective: grpo` with the `grpo:` section (docs/grpo.md). Each step's batch is made by the
policy itself (`GrpoBatches`): `train.global_batch / num_generations` prompts drawn by
`row_indices(seed, generation)` (epochs reshuffled), each sampled `num_generations` times on
the training mesh (`rollout.make_sampler`, key `fold_in(key(train.seed + 1), generation)`),
decoded, scored by the reward workers (`rewards.RewardPool`), turned into group advantages;
with `num_iterations` > 1 the sampling policy's log-probs are kept for the clipped ratio and
the batch serves that many optimizer steps. Everything is a pure function of (seed, step,
params), so a resume at a generation boundary (every step when num_iterations is 1)
continues exactly; inside a generation's steps the checkpoint's extras carry that
generation's batch (`get_state`), so a resume there continues exactly too. One process only (the rewards run on its host).
"""

from __future__ import annotations

import base64
import binascii

import jax
import numpy as np

from fsdp_jax.app.data.packed_rows import row_indices
from fsdp_jax.app.models.generate import SamplingSpec, left_pad
from fsdp_jax.app.objectives.grpo import GrpoSpec, group_advantages, spec_problem
from fsdp_jax.app.objectives.grpo_data import Codec, PromptSet, load_prompts
from fsdp_jax.app.objectives.grpo_loss import batch_logps
from fsdp_jax.app.objectives.rewards import RewardFn, RewardPool, reward_problem
from fsdp_jax.app.objectives.rollout import make_sampler
from fsdp_jax.errors import CheckpointError, ConfigError, one_line
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.train.step import sharding_context


def is_grpo(cfg) -> bool:
    return cfg.objective == "grpo"


def grpo_spec(cfg) -> GrpoSpec:
    g = cfg.grpo
    spec = GrpoSpec(
        g.num_generations,
        g.max_new_tokens,
        g.temperature,
        g.top_p,
        g.top_k,
        g.epsilon,
        g.epsilon_high,
        g.beta,
        g.loss_type,
        g.scale_rewards,
        g.num_iterations,
    )
    bad = spec_problem(spec)
    if bad:
        raise ConfigError(f"grpo.{bad[0]}", bad[1])
    return spec


def _ints(key: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split())
    except ValueError:
        raise ConfigError(key, f"{text!r}: token ids (integers) separated by spaces") from None


def stop_tokens(cfg) -> tuple[int, ...]:
    ids = _ints("grpo.stop_tokens", cfg.grpo.stop_tokens)
    bad = [i for i in ids if not 0 <= i < cfg.model.vocab_size]
    if bad:
        raise ConfigError("grpo.stop_tokens", f"{bad[0]} is outside model.vocab_size={cfg.model.vocab_size}")
    return ids


def reward_fns(cfg) -> list[RewardFn]:
    """`grpo.rewards` with their weights and the built-ins' arguments (ConfigError when bad)."""
    g = cfg.grpo
    refs = g.rewards.split()
    if not refs:
        raise ConfigError("grpo.rewards", "is empty; name at least one reward (module:function or a built-in)")
    try:
        weights = [float(w) for w in g.reward_weights.split()] or [1.0] * len(refs)
    except ValueError:
        raise ConfigError("grpo.reward_weights", f"{g.reward_weights!r}: numbers separated by spaces") from None
    if len(weights) != len(refs) or not all(np.isfinite(weights)):
        raise ConfigError("grpo.reward_weights", f"{len(weights)} finite weights for {len(refs)} rewards")
    args = {"answer_match": (("column", g.answer_column),), "format": (("pattern", g.format_pattern),)}
    fns = [RewardFn(r, w, args.get(r, ())) for r, w in zip(refs, weights)]
    for f in fns:
        bad = reward_problem(f)
        if bad:
            raise ConfigError("grpo.rewards", bad)
    return fns


def check_grpo_config(cfg, process_count: int = 1) -> None:
    """The GRPO checks that read no file (the planner's): the section, the row sizes, the batch
    against num_generations, and the options GRPO does not support (offload, mesh.context > 1,
    several processes): ConfigError, one line."""
    spec, g = grpo_spec(cfg), cfg.grpo
    stop_tokens(cfg)
    if g.max_prompt_len + g.max_new_tokens > cfg.model.max_seq_len:
        raise ConfigError(
            "grpo.max_new_tokens",
            f"{g.max_new_tokens} new tokens after grpo.max_prompt_len={g.max_prompt_len} overflow "
            f"model.max_seq_len={cfg.model.max_seq_len}",
        )
    if cfg.train.global_batch % spec.num_generations:
        raise ConfigError(
            "train.global_batch",
            f"{cfg.train.global_batch} completions is not a multiple of grpo.num_generations={spec.num_generations}",
        )
    for key, value, ok in (
        ("offload", cfg.offload, cfg.offload == "none"),
        ("mesh.context", cfg.mesh.context, cfg.mesh.context == 1),
        ("distributed", f"{process_count} processes", process_count == 1),
    ):
        if not ok:
            raise ConfigError(key, f"{value!r}: objective grpo does not support it yet (docs/grpo.md)")


def check_grpo(cfg, process_count: int = 1) -> None:
    """Every GRPO input check that writes nothing: `check_grpo_config`, the prompts, and each
    reward loaded once in a worker (a missing module or function: exit 2)."""
    check_grpo_config(cfg, process_count)
    load_prompts(cfg)
    if cfg.grpo.eval_path is not None:
        load_prompts(cfg, eval_set=True)
    with RewardPool(reward_fns(cfg), workers=1, timeout=cfg.grpo.reward_timeout):
        pass


def grpo_batch(cfg, rng: np.random.Generator) -> dict:
    """A random GRPO batch of the trainer's shapes (`GrpoBatches.batch`): rows of a prompt of
    1..P random tokens then a completion of 1..N, right-padded with 0; normal advantages; with
    num_iterations > 1, sampling log-probs in [-8, -3] (a ratio that clips)."""
    b, p, n, v = cfg.train.global_batch, cfg.grpo.max_prompt_len, cfg.grpo.max_new_tokens, cfg.model.vocab_size
    pl = rng.integers(1, p + 1, b).astype(np.int32)
    cl = rng.integers(1, n + 1, b)
    mask = (np.arange(n)[None] < cl[:, None]).astype(np.int32)
    comp = rng.integers(0, v, (b, n), dtype=np.int32) * mask
    tokens = np.zeros((b, p + n), np.int32)
    for i in range(b):
        tokens[i, : pl[i]] = rng.integers(0, v, pl[i])
        tokens[i, pl[i] : pl[i] + n] = comp[i]
    batch = {"tokens": tokens, "prompt_len": pl, "completion": comp, "completion_mask": mask}
    batch["advantages"] = rng.standard_normal(b).astype(np.float32)
    if cfg.grpo.num_iterations > 1:
        batch["old_logps"] = -rng.uniform(3, 8, (b, n)).astype(np.float32)
    return batch


def reward_completions(prompts: list, texts: list[str]) -> list:
    """The completions as the reward functions get them, as TRL's `GRPOTrainer` passes them:
    the decoded texts, or for conversational prompts (a list of messages, judged by the first
    prompt) one assistant message each, `[{"role": "assistant", "content": text}]`."""
    if prompts and isinstance(prompts[0], list):
        return [[{"role": "assistant", "content": t}] for t in texts]
    return list(texts)


def encode_batch(batch: dict) -> dict:
    """A host batch of numpy arrays as JSON: {name: {"dtype", "shape", "data": base64 of the
    raw little-endian bytes}} (exact; no pickle)."""
    out = {}
    for k, v in batch.items():
        a = np.ascontiguousarray(v)
        le = a.astype(a.dtype.newbyteorder("<"))
        out[k] = {"dtype": a.dtype.name, "shape": list(a.shape), "data": base64.b64encode(le.tobytes()).decode()}
    return out


def decode_batch(saved: dict) -> dict:
    """`encode_batch`'s inverse; CheckpointError when the JSON is not such a batch."""
    try:
        out = {}
        for k, v in saved.items():
            dt = np.dtype(v["dtype"]).newbyteorder("<")
            raw = np.frombuffer(base64.b64decode(v["data"], validate=True), dt)
            out[k] = raw.reshape([int(d) for d in v["shape"]]).astype(dt.newbyteorder("="))
        return out
    except (KeyError, TypeError, ValueError, binascii.Error) as e:
        raise CheckpointError(f"extras data.generation: not a saved GRPO batch ({one_line(e, 120)})") from None


def _name(ref: str) -> str:
    return ref.rpartition(":")[2]


class GrpoBatches:
    """The train iterator of a GRPO run: `next()` -> this step's batch (module docstring);
    `state_fn()` gives the current TrainState (set by the loop), `sink(dict)` takes each
    generation's host metrics (rewards, completion lengths)."""

    def __init__(self, run, step: int = 0):
        cfg = run.cfg
        self.cfg, self.spec, self.run = cfg, grpo_spec(cfg), run
        self.prompts, self.codec = load_prompts(cfg), Codec(cfg.grpo.tokenizer)
        self.fns = reward_fns(cfg)
        self.rows, self.step = cfg.train.global_batch, step
        self.p, self.n = cfg.grpo.max_prompt_len, self.spec.max_new_tokens
        s = self.spec
        sampling = SamplingSpec(s.max_new_tokens, s.temperature, s.top_p, s.top_k, stop_tokens(cfg), 0)
        cast = Policy.parse(cfg.precision).cast_to_compute
        self.sample = make_sampler(run.model, run.plan, sampling, cast=cast)
        self.old_logps = None
        if s.num_iterations > 1:
            fn = jax.jit(
                lambda p, b: batch_logps(run.model, s, cast(p), b), in_shardings=(run.plan.params, run.plan.batch)
            )
            self.old_logps = fn
        self.key = jax.random.key(cfg.train.seed + 1)
        self.cache: tuple[int, dict] | None = None
        self.state_fn = None
        self.sink = None
        self.pool = RewardPool(self.fns, cfg.grpo.reward_workers, cfg.grpo.reward_timeout, cfg.grpo.on_nan)

    def __iter__(self):
        return self

    def get_state(self) -> dict:
        """{"step"}, and inside a generation's `num_iterations` steps its batch ("generation":
        the generation index and the batch's arrays, `encode_batch`): the policy that sampled
        it is gone after the first of them, so a resume there takes the batch from here."""
        out: dict = {"step": self.step}
        gen = self.step // self.spec.num_iterations
        if self.step % self.spec.num_iterations and self.cache is not None and self.cache[0] == gen:
            out["generation"] = {"index": gen, "batch": encode_batch(self.cache[1])}
        return out

    def set_state(self, state: dict) -> None:
        self.step = int(state["step"])
        saved = state.get("generation")
        self.cache = None if saved is None else (int(saved["index"]), decode_batch(saved["batch"]))

    def close(self) -> None:
        self.pool.close()

    def batch(self, step: int) -> dict:
        """A batch of the right shapes and dtypes (zeros): what the step compiles for."""
        b, p, n = self.rows, self.p, self.n
        out = {
            "tokens": np.zeros((b, p + n), np.int32),
            "prompt_len": np.ones((b,), np.int32),
            "completion": np.zeros((b, n), np.int32),
            "completion_mask": np.zeros((b, n), np.int32),
            "advantages": np.zeros((b,), np.float32),
        }
        if self.old_logps is not None:
            out["old_logps"] = np.zeros((b, n), np.float32)
        return out

    def __next__(self) -> dict:
        gen = self.step // self.spec.num_iterations
        if self.cache is None or self.cache[0] != gen:
            self.cache = (gen, self._generate(gen))
        self.step += 1
        return self.cache[1]

    def rollout(self, prompt_set: PromptSet, idx, params, key) -> dict:
        """Sample a completion for each row `idx` of `prompt_set` from `params` with `key`, decode
        and score it: {"rows" (token lists), "comp" (B, N), "clen" (B,), "texts", "per_func" (B, F)}."""
        rows = [prompt_set.tokens[i] for i in idx]
        prompts, lengths = left_pad(rows, width=self.p)
        out = jax.device_get(self.sample(params, prompts, lengths, key))
        comp, clen = np.asarray(out["tokens"], np.int32), np.asarray(out["lengths"], np.int32)
        stops = set(stop_tokens(self.cfg))
        texts = [self.codec.decode([t for t in comp[b, : clen[b]] if t not in stops]) for b in range(len(rows))]
        columns = {k: [v[i] for i in idx] for k, v in prompt_set.columns.items()}
        prompts_in = [prompt_set.texts[i] for i in idx]
        per_func = self.pool.score(prompts_in, reward_completions(prompts_in, texts), columns)
        return {"rows": rows, "comp": comp, "clen": clen, "texts": texts, "per_func": per_func}

    def _generate(self, gen: int) -> dict:
        g = self.spec.num_generations
        idx = np.repeat(row_indices(len(self.prompts), self.rows // g, self.cfg.data.seed, gen), g)
        params = self.state_fn().params
        r = self.rollout(self.prompts, idx, params, jax.random.fold_in(self.key, gen))
        rows, comp, clen, per_func = r["rows"], r["comp"], r["clen"], r["per_func"]
        stops = set(stop_tokens(self.cfg))
        adv, total = group_advantages(per_func, [f.weight for f in self.fns], g, self.spec.scale_rewards)
        batch = self._rows(rows, comp, clen, adv)
        if self.old_logps is not None:
            with sharding_context(self.run.plan):
                batch["old_logps"] = np.asarray(jax.device_get(self.old_logps(params, batch)), np.float32)
        if self.sink is not None:
            self.sink(self.metrics(per_func, total, comp, clen, stops))
        return batch

    def _rows(self, rows, comp, clen, adv) -> dict:
        b, p, n = len(rows), self.p, self.n
        tokens = np.zeros((b, p + n), np.int32)
        mask = (np.arange(n)[None] < clen[:, None]).astype(np.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = r
            tokens[i, len(r) : len(r) + clen[i]] = comp[i, : clen[i]]
        pl = np.asarray([len(r) for r in rows], np.int32)
        return {
            "tokens": tokens,
            "prompt_len": pl,
            "completion": comp * mask,
            "completion_mask": mask,
            "advantages": adv,
        }

    def metrics(self, per_func, total, comp, clen, stops) -> dict:
        """The generation metrics (TRL's names) of scored rows: rewards, lengths, clipped ratio."""
        g = self.spec.num_generations
        ended = np.asarray([clen[b] > 0 and int(comp[b, clen[b] - 1]) in stops for b in range(len(clen))])
        grouped = total.reshape(-1, g)
        out = {
            "reward": float(np.nanmean(total)),
            "reward_std": float(np.nanstd(total, ddof=1)) if len(total) > 1 else 0.0,
            "frac_reward_zero_std": float(np.mean(np.isclose(np.nanstd(grouped, axis=1, ddof=1), 0.0))),
            "completions/mean_length": float(clen.mean()),
            "completions/min_length": float(clen.min()),
            "completions/max_length": float(clen.max()),
            "completions/clipped_ratio": float(1.0 - ended.mean()),
        }
        for j, f in enumerate(self.fns):
            col = per_func[:, j]
            out[f"rewards/{_name(f.fn)}/mean"] = float(np.nanmean(col)) if np.isfinite(col).any() else float("nan")
            out[f"rewards/{_name(f.fn)}/std"] = float(np.nanstd(col, ddof=1)) if np.isfinite(col).sum() > 1 else 0.0
        return out
