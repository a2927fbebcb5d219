"""GRPO rewards in worker processes (objectives/rewards.py): user functions with TRL's
signature and weights, the built-ins, and every way a reward can fail named in one line:
missing module or function, wrong length (RewardError, exit 2), raising, NaN, a hang killed
after the timeout (RewardFailed, exit 1)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from fsdp_jax.app.objectives.reward_builtins import answer_match, format_match
from fsdp_jax.app.objectives.rewards import RewardFn, RewardPool, reward_problem
from fsdp_jax.errors import RewardError, RewardFailed

USER = """
import time

def length(prompts, completions, **kw):
    print("noise on stdout")  # must not break the protocol
    return [float(len(c)) for c in completions]

def uses_column(prompts, completions, target, **kw):
    return [1.0 if c == t else None for c, t in zip(completions, target)]

def raises(prompts, completions, **kw):
    raise ValueError("bad reward")

def nan(prompts, completions, **kw):
    return [float("nan")] * len(completions)

def short(prompts, completions, **kw):
    return [1.0]

def hangs(prompts, completions, **kw):
    time.sleep(60)

def chat_content(prompts, completions, **kw):  # TRL's conversational shape, or fail
    assert all(p[-1]["role"] == "user" for p in prompts), prompts
    assert all(c == [{"role": "assistant", "content": c[0]["content"]}] for c in completions), completions
    return [float(len(c[0]["content"])) for c in completions]
"""


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_user_functions_columns_and_builtins_in_two_workers(user_dir):
    fns = [
        RewardFn("my_rewards:length", 1.0),
        RewardFn("my_rewards:uses_column", 0.5),
        RewardFn("answer_match"),
        RewardFn("format", args=(("pattern", r"\d+"),)),
    ]
    comps = ["12", "abc", "7", " 12 ", "x"]
    cols = {"target": ["12", "x", "7", "no", "x"], "answer": ["12", "3", "7", "12", None]}
    with RewardPool(fns, workers=2, timeout=30) as pool:
        got = pool.score(["p"] * 5, comps, cols)
        assert len(pool.procs) == 2
    assert got.shape == (5, 4) and got.dtype == np.float32
    np.testing.assert_array_equal(got[:, 0], [2, 3, 1, 4, 1])
    assert got[0, 1] == 1 and math.isnan(got[1, 1]) and got[4, 1] == 1
    np.testing.assert_array_equal(got[:4, 2], [1, 0, 1, 1])
    assert math.isnan(got[4, 2])
    np.testing.assert_array_equal(got[:, 3], [1, 0, 1, 1, 0])


@pytest.mark.parametrize(
    "fn, err, words",
    [
        ("no_such_module:f", RewardError, ["no_such_module:f", "cannot be loaded", "ModuleNotFoundError"]),
        ("my_rewards:missing", RewardError, ["my_rewards:missing", "has no function"]),
        ("my_rewards:short", RewardError, ["my_rewards:short", "1 values for 3 completions"]),
        ("my_rewards:raises", RewardFailed, ["my_rewards:raises", "ValueError: bad reward", "my_rewards.py:"]),
        ("my_rewards:nan", RewardFailed, ["my_rewards:nan", "nan"]),
    ],
)
def test_failures_are_named_in_one_line(user_dir, fn, err, words):
    with pytest.raises(err) as e:
        with RewardPool([RewardFn(fn)], timeout=30) as pool:
            pool.score(["p"] * 3, ["a", "b", "c"])
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_nan_dropped_when_asked(user_dir):
    with RewardPool([RewardFn("my_rewards:nan")], timeout=30, on_nan="drop") as pool:
        assert np.isnan(pool.score(["p"] * 2, ["a", "b"])).all()


def test_a_hanging_reward_is_killed_after_the_timeout(user_dir):
    pool = RewardPool([RewardFn("my_rewards:hangs")], timeout=2)
    procs = list(pool.procs)
    t = time.monotonic()
    with pytest.raises(RewardFailed, match="no answer within 2 s"):
        pool.score(["p"], ["a"])
    assert time.monotonic() - t < 10
    assert all(p.poll() is not None for p in procs)


def test_builtins_and_names():
    assert answer_match(["p"] * 3, ["4", " 5.", "x"], answer=["4", "5", "x "], strip=".") == [1.0, 1.0, 1.0]
    assert answer_match(["p"], ["4"], answer=["5"]) == [0.0]
    assert answer_match(["p"], [[{"role": "assistant", "content": "4"}]], answer=[4]) == [1.0]
    assert format_match(["p"] * 2, ["<a>1</a>", "1"], pattern=r"<a>\d</a>") == [1.0, 0.0]
    assert format_match(["p"], ["xx 12 yy"], pattern=r"\d+", full=False) == [1.0]
    assert reward_problem(RewardFn("answer_match")) is None
    assert reward_problem(RewardFn("mod.sub:fn")) is None
    assert "built-in" in reward_problem(RewardFn("nonsense"))
    assert "module:function" in reward_problem(RewardFn("mod:"))


def test_conversational_prompts_get_message_completions(user_dir):
    """As TRL's GRPOTrainer: chat-format prompts give each reward its completion as one
    assistant message; string prompts the text."""
    from fsdp_jax.app.objectives.grpo_run import reward_completions

    chat = [[{"role": "system", "content": "s"}, {"role": "user", "content": "2+3="}]] * 3
    comps = reward_completions(chat, ["5", "six", ""])
    assert comps == [[{"role": "assistant", "content": t}] for t in ("5", "six", "")]
    assert reward_completions(["2+3="] * 2, ["5", "x"]) == ["5", "x"]
    fns = [
        RewardFn("my_rewards:chat_content"),
        RewardFn("answer_match"),
        RewardFn("format", args=(("pattern", "\\d"),)),
    ]
    with RewardPool(fns, timeout=30) as pool:
        got = pool.score(chat, comps, {"answer": ["5", "5", "5"]})
    np.testing.assert_array_equal(got, [[1, 1, 1], [3, 0, 0], [0, 0, 0]])
