"""No comment, docstring or doc in the repository sends its reader to a file the repository does not
hold: the design notes, the reference notes and the shared folder that the node was first written
beside. Say what is meant in place, or point to docs/ (architecture.md, research.md, ...)."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOTS = [
    "noloco_node",
    "tests",
    "docs",
    "proto",
    "scripts",
    "benchmarks",
    "examples",
    "deploy",
    "README.md",
    "CONTRIBUTING.md",
]

# Built from pieces so that this file does not name them itself.
_MD = r"\." + "md"
OUTSIDE = re.compile(
    "|".join(
        [
            "DESIGN" + _MD,
            "noloco-" + "reference",
            "transport" + _MD,
            "house-" + "style",
            "offline-" + "data",
            "anchors" + "(-2026-11)?" + _MD,
            "compression-" + "2026-11",
            r"\.\./" + "shared",
        ]
    )
)


def _files() -> list[Path]:
    """The files git tracks (those still in the working tree), or the named roots where git is not there."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        paths = [ROOT / name for name in listed.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for name in ROOTS for p in ([ROOT / name] if (ROOT / name).is_file() else (ROOT / name).rglob("*"))]
    return [p for p in paths if p.is_file()]


def _pointers(path: Path) -> list[str]:
    data = path.read_bytes()
    if b"\0" in data:
        return []  # a binary file (a plot, a font): nothing a reader follows
    return [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]


def test_the_pattern_finds_each_pointer_and_not_what_the_repository_holds():
    pieces = [
        ("DESIGN", ".md"),
        ("noloco-", "reference.md"),
        ("transport", ".md"),
        ("house-", "style.md"),
        ("offline-", "data.md"),
        ("anchors", ".md"),
        ("anchors-", "2026-11.md"),
        ("compression-", "2026-11"),
        ("../", "shared/notes"),
    ]
    for head, tail in pieces:
        assert OUTSIDE.search(f"see {head}{tail}, section 2"), head + tail
    for fine in [
        "docs/architecture.md",
        "docs/research.md",
        "proto/README.md",
        "/shared/bootstrap.maddr",
        "noloco_node/transport/relay.py",
        "benchmarks/transport.py",
    ]:
        assert not OUTSIDE.search(fine), fine


def test_no_tracked_file_points_outside_the_repository():
    files = _files()
    assert len(files) > 100  # the walk saw the repository, not nothing
    hits = [hit for path in files for hit in _pointers(path)]
    assert not hits, "say what is meant in place, or point to docs/:\n" + "\n".join(hits)
