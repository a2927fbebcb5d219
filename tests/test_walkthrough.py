"""docs/finetuning_data.md's walk-through as a newcomer runs it: its first step works in a
fresh checkout (no data/ folder yet), and its prepare step does what the page says (the
chats it truncates: prepare says how many, and so does the page)."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

from helpers import call

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "finetuning_data.md"


def walkthrough() -> list[str]:
    """The walk-through block's commands, continuation lines joined, comments dropped."""
    text = PAGE.read_text()
    block = text[text.index("## Walk-through on CPU") :].split("```")[1]
    commands = re.sub(r"\\\n\s*", " ", block).splitlines()
    return [c.split("  #")[0].strip() for c in commands if c.strip() and not c.lstrip().startswith("#")]


def test_the_first_step_works_in_a_fresh_checkout(tmp_path):
    first = walkthrough()[0]
    assert "chat_set" in first and "data/chats.jsonl" in first
    (tmp_path / "tests").symlink_to(ROOT / "tests")  # a checkout: tests/ there, data/ not (git ignores it)
    env_part, _, cmd = first.partition(" python ")
    r = subprocess.run(
        [sys.executable, *shlex.split(cmd)],
        cwd=tmp_path,
        env={"PYTHONPATH": f"tests:{ROOT}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert env_part == "PYTHONPATH=tests" and r.returncode == 0, r.stderr[-2000:]
    assert len((tmp_path / "data" / "chats.jsonl").read_text().splitlines()) == 240


def test_prepare_says_what_the_page_says_it_truncates(tmp_path, capsys):
    from test_finetune_e2e import chat_set

    prepare = next(c for c in walkthrough() if c.startswith("python scripts/prepare.py"))
    args = [a.replace("data/", f"{tmp_path}/data/") for a in shlex.split(prepare)[2:]]
    chat_set(tmp_path / "data" / "chats.jsonl")
    code, out, err = call("prepare", *args, "--no-progress", capsys=capsys)
    assert code == 0, err
    truncated = int(re.search(r"truncated (\d+)", out).group(1))
    page = PAGE.read_text()
    if truncated:
        (warning,) = [ln for ln in err.splitlines() if ln.startswith("warning:")]
        assert warning.startswith(f"warning: {truncated} of 240 examples are longer than a row")
        assert f"{truncated} of 240" in page[page.index("## Walk-through on CPU") :]  # the page says so
