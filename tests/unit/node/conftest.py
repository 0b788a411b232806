"""A tiny run config for in-process swarms: the same tiny model and corpus as the process tests."""

from pathlib import Path

from noloco_node.config import NodeConfig, load_config

from ...integration.conftest import tiny_overrides


def tiny_values(tmp_path: Path, **extra) -> dict[str, str]:
    return dict(item.split("=", 1) for item in tiny_overrides(tmp_path, **extra))


def tiny_config(tmp_path: Path, **extra) -> NodeConfig:
    return load_config(overrides=tiny_overrides(tmp_path, **extra))
