"""Every `python` block of README.md and docs/*.md marked `<!-- runs -->` runs as written."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKED = re.compile(r"<!-- runs -->\n```python\n(.*?)```", re.S)


def _blocks():
    for page in PAGES:
        for i, m in enumerate(MARKED.finditer(page.read_text())):
            yield pytest.param(page, m.group(1), id=f"{page.relative_to(ROOT)}[{i}]")


def test_pages_have_runnable_blocks():
    """The marker is not lost in an edit: README's example and the two adapter examples."""
    ids = [p.id for p in _blocks()]
    assert "README.md[0]" in ids and sum(i.startswith("docs/library.md") for i in ids) >= 2, ids


def test_readme_is_a_landing_page():
    """README is a landing page (issue 55): at most 150 lines, reference text lives in docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines (at most 150: move detail into docs/)"


@pytest.mark.slow
@pytest.mark.parametrize("page,code", list(_blocks()))
def test_marked_block_runs(page, code, capsys):
    exec(compile(code, str(page), "exec"), {"__name__": "__doc_block__"})
    out = capsys.readouterr().out.splitlines()
    if page.name == "README.md":
        assert 5.0 < float(out[0]) < 6.5  # ln(256) = 5.55 at init
        assert "logical: embed->fsdp" in "\n".join(out[1:])
