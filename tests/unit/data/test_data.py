"""Corpus resolution, offline BPE training and caching, packing and sharding."""

import gzip
import json
import random

import pytest
import torch

from noloco_node.data.corpus import default_corpus, resolve_corpus
from noloco_node.data.loader import PackedSequences, ShardSpec, is_validation
from noloco_node.data.tokenizer import load_tokenizer

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def make_docs(n, seed=0):
    rng = random.Random(seed)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) for i in range(n)]


@pytest.fixture
def c4_copy(tmp_path):
    """A synthetic local C4 copy with the real shard names: 4 train shards of 40 docs."""
    root = tmp_path / "c4" / "en"
    root.mkdir(parents=True)
    docs = make_docs(160)
    for shard in range(4):
        with gzip.open(root / f"c4-train.{shard:05d}-of-01024.json.gz", "wt") as f:
            for doc in docs[shard * 40 : (shard + 1) * 40]:
                f.write(json.dumps({"text": doc, "timestamp": "2019-04-25T12:57:54Z", "url": "x"}) + "\n")
    return root


def test_c4_glob_and_tokenizer_cache(c4_copy, tmp_path):
    corpus = resolve_corpus(str(c4_copy / "c4-train.*-of-01024.json.gz"), cache_dir=tmp_path)
    assert corpus.format == "json" and len(corpus.files) == 4
    tok = load_tokenizer(None, corpus, vocab_size=300, cache_dir=tmp_path)
    assert len(tok) <= 300 and tok.eos_token_id is not None
    cached = list((tmp_path / "tokenizers").glob("*.json"))
    assert len(cached) == 1
    mtime = cached[0].stat().st_mtime_ns
    again = load_tokenizer(None, corpus, vocab_size=300, cache_dir=tmp_path)
    assert cached[0].stat().st_mtime_ns == mtime  # loaded, not retrained
    assert again("theta iota")["input_ids"] == tok("theta iota")["input_ids"]
    # A tokenizer.json path works as data.tokenizer.
    by_path = load_tokenizer(str(cached[0]), corpus, vocab_size=300, cache_dir=tmp_path)
    assert by_path("kappa")["input_ids"] == tok("kappa")["input_ids"]


def test_packing_is_a_shifted_stream(c4_copy, tmp_path):
    corpus = resolve_corpus(str(c4_copy), cache_dir=tmp_path)
    tok = load_tokenizer(None, corpus, vocab_size=300, cache_dir=tmp_path)
    seqs = PackedSequences(corpus, tok, seq_len=16, shuffle_buffer=0, holdout_fraction=0.0)
    windows = []
    for i, (inputs, labels) in enumerate(seqs):
        assert inputs.shape == labels.shape == (16,) and inputs.dtype == torch.int64
        assert torch.equal(inputs[1:], labels[:-1])
        windows.append((inputs, labels))
        if i == 20:
            break
    # The stream is contiguous across windows of seq_len + 1 tokens.
    first_doc = tok(make_docs(1)[0], add_special_tokens=False)["input_ids"]
    stream = torch.cat([torch.cat([w[0], w[1][-1:]]) for w in windows]).tolist()
    assert stream[: len(first_doc)] == first_doc
    assert stream[len(first_doc)] == tok.eos_token_id


def test_shards_by_whole_files_are_disjoint(c4_copy, tmp_path):
    corpus = resolve_corpus(str(c4_copy), cache_dir=tmp_path)
    tok = load_tokenizer(None, corpus, vocab_size=300, cache_dir=tmp_path)
    docs = make_docs(160)
    shards = []
    for index in range(2):
        seqs = PackedSequences(
            corpus,
            tok,
            seq_len=8,
            shard=ShardSpec(shard_index=index, num_shards=2),
            split="validation",
            holdout_fraction=1.0,
        )
        shards.append(set(seqs._documents(0)))
    # 4 files over 2 shards: each shard reads two whole files (40 docs each), none shared.
    assert len(shards[0]) == len(shards[1]) == 80
    assert not (shards[0] & shards[1]) and shards[0] | shards[1] == set(docs)
    files_of_shard0 = {docs.index(d) // 40 for d in shards[0]}
    assert len(files_of_shard0) == 2


def test_validation_split_is_disjoint_from_train(tmp_path):
    docs = make_docs(400, seed=3)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    corpus = resolve_corpus(str(path), cache_dir=tmp_path, text_field="body")
    held = [d for d in docs if is_validation(d, 0.1)]
    assert 10 < len(held) < 80
    tok = load_tokenizer(None, corpus, vocab_size=280, cache_dir=tmp_path)
    val = list(PackedSequences(corpus, tok, seq_len=32, split="validation", holdout_fraction=0.1))
    assert 0 < len(val) < sum(len(tok(d)["input_ids"]) + 1 for d in held) // 33 + 1


def test_batches_and_epochs_cycle(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("\n\n".join(make_docs(5)))
    corpus = resolve_corpus(str(path), cache_dir=tmp_path)
    tok = load_tokenizer(None, corpus, vocab_size=280, cache_dir=tmp_path)
    seqs = PackedSequences(corpus, tok, seq_len=8, holdout_fraction=0.0, shuffle_buffer=0)
    total = sum(1 for _ in seqs._windows(0))
    it = seqs.batches(4)
    for _ in range(total):  # more batches than one epoch holds
        inputs, labels = next(it)
        assert inputs.shape == (4, 8)
    assert seqs.epoch >= 1


def test_bad_paths_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="data.path: no files"):
        resolve_corpus(str(tmp_path / "missing*.json"), cache_dir=tmp_path)
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.parquet").write_bytes(b"x")
    with pytest.raises(ValueError, match="mixes formats"):
        resolve_corpus(str(tmp_path / "*"), cache_dir=tmp_path)
    with pytest.raises(ValueError, match="data.tokenizer"):
        load_tokenizer(
            "no-such-model/anywhere",
            resolve_corpus(str(tmp_path / "a.txt"), cache_dir=tmp_path),
            vocab_size=256,
            cache_dir=tmp_path,
        )


def test_embedded_default_corpus_is_offline_and_chaptered(tmp_path):
    corpus = default_corpus(tmp_path)
    assert corpus.name == "kjv"
    lines = open(corpus.files[0]).read().splitlines()
    assert len(lines) == 1189  # chapters in the KJV
    assert json.loads(lines[0])["text"].startswith("Genesis 1\nIn the beginning")


def test_a_small_corpus_is_known_by_its_content_not_its_path_or_time(tmp_path, monkeypatch):
    """A newcomer's second checkout trained the embedded corpus's tokenizer again: the corpus file
    is rebuilt with a new mtime by every fresh install, and the cache was keyed by path and mtime."""
    import os

    from noloco_node.data import corpus as corpus_module
    from noloco_node.data.corpus import Corpus

    text = "In the beginning was the word.\n" * 50
    a, b = tmp_path / "a" / "c.txt", tmp_path / "b" / "c.txt"
    for path in (a, b):
        path.parent.mkdir()
        path.write_text(text)
    os.utime(b, (1, 1))
    key = Corpus("c", (str(a),), "text").fingerprint()
    assert key == Corpus("c", (str(b),), "text").fingerprint()  # another path, another time: the same
    b.write_text(text + "amen\n")
    assert key != Corpus("c", (str(b),), "text").fingerprint()  # other bytes: another key
    assert key != Corpus("c", (str(a),), "json").fingerprint()
    monkeypatch.setattr(corpus_module, "CONTENT_HASH_BYTES", 10)  # a large corpus: by its files, unread
    assert Corpus("c", (str(a),), "text").fingerprint() != Corpus("c", (str(b),), "text").fingerprint()
    assert str(a) in Corpus("c", (str(a),), "text").fingerprint()
