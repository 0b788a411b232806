"""ruff, configured in pyproject.toml, passes on the whole tree; and the configuration is the one in
force (a sample that breaks a selected rule is caught)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, input=stdin, capture_output=True,
                          text=True, timeout=120)


def test_ruff_passes_on_the_tree():
    result = ruff("check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_the_configured_rules_catch_a_sample_that_breaks_them():
    sample = "import os\n\ntry:\n    pass\nexcept Exception:\n    pass\n"
    result = ruff("check", "--no-cache", "--stdin-filename", "noloco_node/sample.py", "-", stdin=sample)
    assert result.returncode == 1 and "F401" in result.stdout and "BLE001" in result.stdout, result.stdout
