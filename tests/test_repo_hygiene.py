"""The repository names no machine: no absolute paths of a developer's machine (home
directories, the workplace's folders, pyenv builds) in any tracked text file."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = {".py", ".md", ".toml", ".yaml", ".yml", ".sbatch", ".sh", ".txt", ".jinja", ".cfg", ".ini", ""}
# spelled in pieces so that this file does not match itself
MACHINE = re.compile("|".join(["/wo" + "rk/", "/ro" + "ot/", "/ho" + "me/[a-z]", "/Us" + "ers/", r"\.py" + "env/"]))


def test_no_tracked_text_file_names_a_machine_path():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    bad = []
    for f in files:
        p = ROOT / f
        if p.suffix not in TEXT or not p.is_file() or p.stat().st_size > 2_000_000:
            continue
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if MACHINE.search(line):
                bad.append(f"{f}:{n}: {line.strip()[:120]}")
    assert not bad, "\n".join(bad)
