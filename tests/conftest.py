"""Test-wide settings: nothing may reach a model or data hub, and caches stay per session."""

import os
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="noloco-hf-datasets-"))


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): one worker per core, at most 4. Integration tests start up
    to 9 node processes each; more workers than that on a big machine only add contention."""
    return max(1, min(4, len(os.sched_getaffinity(0))))
