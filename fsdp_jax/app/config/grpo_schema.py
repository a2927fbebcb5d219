"""The `grpo:` config section (`objective: grpo`, docs/grpo.md): TRL's `GRPOConfig` names."""

from __future__ import annotations

import dataclasses

from fsdp_jax.app.config.schema_fields import limit, names


@dataclasses.dataclass(frozen=True)
class GrpoConfig:
    """GRPO with in-process generation, when `objective` is grpo: data.path is a .jsonl of
    prompt rows ({prompt, <columns the rewards read>}); train.global_batch counts completions
    (prompts x num_generations)."""

    num_generations: int = limit(8, ">= 2")  # G completions per prompt
    max_prompt_len: int = limit(64, "> 0")  # prompt tokens a row holds (a longer prompt is bad input)
    max_new_tokens: int = limit(64, "> 0")  # TRL's max_completion_length
    temperature: float = limit(1.0, ">= 0")  # 0 = greedy
    top_p: float = limit(1.0, "(0, 1]")
    top_k: int = limit(0, "off")
    stop_tokens: str = names("")  # token ids that end a completion (bytes: 10 = newline); "" = none
    epsilon: float = limit(0.2, "[0, 1)")
    epsilon_high: float = limit(0.0, "off")  # 0 = epsilon (DAPO: 0.28)
    beta: float = limit(0.0, ">= 0")  # KL weight; 0 = no reference forward
    loss_type: str = limit("dapo", choices=("grpo", "bnpo", "dr_grpo", "dapo"))  # objectives.grpo.LOSS_TYPES
    scale_rewards: str = limit("group", choices=("group", "batch", "none"))
    num_iterations: int = limit(1, "> 0")  # optimizer steps per generation batch (TRL's mu)
    rewards: str = names("answer_match")  # module:function or built-ins (answer_match, format)
    reward_weights: str = names("")  # one float per reward; "" = all 1.0
    answer_column: str = "answer"  # answer_match's column
    format_pattern: str = r"^.+$"  # format's regex (whole stripped completion)
    reward_workers: int = limit(1, "> 0")  # reward worker processes
    reward_timeout: float = limit(60.0, "> 0")  # seconds a batch's rewards may take
    on_nan: str = limit("stop", choices=("stop", "drop"))  # a NaN reward: stop the run, or leave it unscored
    eval_path: str | None = None  # prompt rows (as data.path) that train.eval_every evaluates; null = no eval
    prompt_key: str = "prompt"
    tokenizer: str | None = None  # a tokenizer.json (or its dir); null = UTF-8 bytes
