"""ruff, configured in pyproject.toml, passes on the whole tree, and the tree is laid out as
`ruff format` lays it out; the configuration is the one in force (samples that break a selected
rule, or the layout, are caught)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=120
    )


def test_ruff_passes_on_the_tree():
    result = ruff("check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_the_configured_rules_catch_a_sample_that_breaks_them():
    sample = "import os\n\ntry:\n    pass\nexcept Exception:\n    pass\n" + f"x = {'1 + ' * 40}1\n"
    result = ruff("check", "--no-cache", "--stdin-filename", "noloco_node/sample.py", "-", stdin=sample)
    assert result.returncode == 1, result.stdout
    for rule in ("F401", "BLE001", "E501"):
        assert rule in result.stdout, (rule, result.stdout)


def test_the_tree_is_formatted():
    result = ruff("format", "--check", "--no-cache", ".")
    assert result.returncode == 0, "run `.venv/bin/ruff format .`:\n" + result.stdout[-4000:] + result.stderr[-2000:]


def test_the_format_check_catches_a_line_laid_out_by_hand():
    sample = "def f(a,b):\n    return a+b\n"
    result = ruff("format", "--check", "--no-cache", "--stdin-filename", "noloco_node/sample.py", "-", stdin=sample)
    assert result.returncode == 1, result.stdout + result.stderr
