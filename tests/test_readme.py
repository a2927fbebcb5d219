"""README's API example runs as written."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_readme_api_example_runs(capsys):
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Public API in one example\s+```python\n(.*?)```", text, re.S).group(1)
    exec(compile(block, "README.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert 5.0 < float(out[0]) < 6.5  # ln(256) = 5.55 at init
    assert "logical: embed->fsdp" in "\n".join(out[1:])
