"""Test-wide settings: nothing may reach a model or data hub, and caches stay per session."""

import os
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="noloco-hf-datasets-"))
