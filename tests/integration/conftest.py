"""Fixtures for real node processes on 127.0.0.1: a tiny corpus, tiny-model overrides, and a
LocalSwarm that is always stopped (SIGTERM, then SIGKILL) whatever the test does."""

import random
from pathlib import Path

import pytest

from noloco_node.experiments.launcher import LocalSwarm

WORDS = "the a one two red blue green cat dog bird runs sits sees eats big small old new and then".split()


def write_corpus(path: Path, num_docs: int = 400, seed: int = 0) -> Path:
    rng = random.Random(seed)
    docs = []
    for _ in range(num_docs):
        sentences = [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 9))) + "." for _ in range(rng.randint(3, 8))
        ]
        docs.append(" ".join(sentences))
    path.write_text("\n\n".join(docs))
    return path


def tiny_overrides(tmp_path: Path, **extra) -> list[str]:
    corpus = write_corpus(tmp_path / "corpus.txt")
    values = {
        "data.path": str(corpus),
        "data.cache_dir": str(tmp_path / "cache"),
        "data.vocab_size": 300,
        "data.holdout_fraction": 0.0,
        "model.hidden_size": 32,
        "model.intermediate_size": 64,
        "model.num_layers": 6,
        "model.num_heads": 4,
        "model.seq_len": 16,
        "pipeline.batch_size": 4,
        "pipeline.microbatch_size": 2,
        "inner.lr": 1e-2,
        "inner.warmup_steps": 2,
        "inner.total_steps": 50,
        "timeouts.heartbeat_s": 1.0,
        "timeouts.record_ttl_s": 4.0,
        "timeouts.startup_s": 30.0,
        "timeouts.rpc_s": 10.0,
        "timeouts.microbatch_s": 5.0,
        "outer.method": "none",
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def prepare_tokenizer(overrides: list[str]):
    """Train the tokenizer once in the test process so node processes only load it."""
    from noloco_node.config import load_config
    from noloco_node.data.corpus import resolve_corpus
    from noloco_node.data.tokenizer import load_tokenizer

    config = load_config(overrides=overrides)
    corpus = resolve_corpus(config.data.path, cache_dir=config.data.cache_path)
    return (
        config,
        corpus,
        load_tokenizer(None, corpus, vocab_size=config.data.vocab_size, cache_dir=config.data.cache_path),
    )


@pytest.fixture
def make_swarm(tmp_path):
    swarms = []

    def factory(overrides: list[str], name: str = "swarm", threads: int = 1, bootstrap_args: tuple = ()) -> LocalSwarm:
        swarm = LocalSwarm(tmp_path / name, overrides=overrides, threads=threads, startup_timeout_s=60)
        swarms.append(swarm)
        swarm.start_bootstrap(*bootstrap_args)
        return swarm

    yield factory
    for swarm in swarms:
        swarm.stop()


@pytest.fixture
def procs():
    """Commands started as volunteer_procs.Proc (a process group each): drained at teardown."""
    started: list = []
    yield started
    for p in started:
        p.group.drain(grace_s=5.0)
