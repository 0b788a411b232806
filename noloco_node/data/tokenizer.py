"""Tokenizers: a byte-level BPE trained offline on the corpus and cached, or a local one.

`data.tokenizer` may be a path to a tokenizer.json, a local directory saved with
`save_pretrained`, or a model name already in the local Hugging Face cache; nothing downloads.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from noloco_node.data.corpus import Corpus
from noloco_node.errors import DataError
from noloco_node.runtime.files import atomic_write

log = logging.getLogger(__name__)

EOS, PAD = "<|endoftext|>", "<pad>"
_TRAINER_VERSION = "bytelevel-bpe-v1"


def load_tokenizer(spec: str | None, corpus: Corpus, *, vocab_size: int, cache_dir: Path):
    """A `PreTrainedTokenizerFast` with an eos token; trains and caches one when spec is None."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if spec is None:
        path = _trained_path(corpus, vocab_size, cache_dir)
        if not path.is_file():
            _train_bpe(corpus, vocab_size, path)
        return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=EOS, pad_token=PAD)
    if os.path.isfile(spec):
        return PreTrainedTokenizerFast(tokenizer_file=spec, eos_token=EOS, pad_token=PAD)
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError) as exc:  # Hugging Face's own text talks of repo ids and the internet: not ours
        raise DataError(
            f"data.tokenizer: {spec!r} is neither a tokenizer.json, a local tokenizer directory, nor a model "
            "in the local Hugging Face cache (nothing is downloaded); point it at a tokenizer.json or a folder "
            "saved with save_pretrained, or leave it unset for the run's own tokenizer"
        ) from exc
    if tokenizer.eos_token_id is None:
        raise DataError(f"data.tokenizer: {spec!r} has no eos token, which separates packed documents")
    return tokenizer


def _trained_path(corpus: Corpus, vocab_size: int, cache_dir: Path) -> Path:
    key = hashlib.sha256(f"{_TRAINER_VERSION}|{vocab_size}|{corpus.fingerprint()}".encode()).hexdigest()[:16]
    return cache_dir / "tokenizers" / f"bpe-{vocab_size}-{key}.json"


def iter_texts(corpus: Corpus, limit_bytes: int | None = None) -> Iterator[str]:
    """Texts of the whole corpus in file order (for tokenizer training)."""
    from datasets import load_dataset

    kwargs = {"sample_by": "paragraph"} if corpus.format == "text" else {}
    ds = load_dataset(corpus.format, data_files=list(corpus.files), split="train", streaming=True, **kwargs)
    seen = 0
    for row in ds:
        text = row.get(corpus.text_field)
        if text:
            yield text
            seen += len(text)
            if limit_bytes is not None and seen >= limit_bytes:
                return


def _train_bpe(corpus: Corpus, vocab_size: int, path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    log.info("training a %d-token byte-level BPE on %s (once; cached at %s)", vocab_size, corpus.name, path)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # 64 MB of text is plenty for a small vocabulary and bounds the time on a large corpus.
    tokenizer.train_from_iterator(iter_texts(corpus, limit_bytes=64 << 20), trainer=trainer)
    atomic_write(path, lambda tmp: tokenizer.save(str(tmp)))
