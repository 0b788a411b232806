"""The docs a newcomer reads stay findable: the README keeps the command CI runs word for word and
stays short, and every relative link between the README, docs/ and proto/README.md reaches a file
and, where it names one, a heading."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    ROOT / "proto" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_readme_carries_the_command_ci_runs_and_stays_short():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (ROOT / "README.md").read_text()
    assert ci in readme, f"the README lost the command .ci/run calls: {ci}"
    assert "bash scripts/setup.sh && .venv/bin/noloco-node demo" in readme
    assert 'bash scripts/setup.sh && .venv/bin/python -m pytest -q -m "not integration"' in readme
    assert len(readme.splitlines()) <= 150


def test_relative_links_reach_a_file_and_a_heading():
    links = 0
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # an external address
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.relative_to(ROOT)} links to missing {target}"
            if anchor:
                assert anchor in _anchors(linked), f"{page.relative_to(ROOT)}: {target} names no heading"
            links += 1
    assert links > 20  # the check ran over the docs' links, not over nothing
