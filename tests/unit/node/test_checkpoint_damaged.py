"""A damaged checkpoint (a disk that filled or failed mid-copy) neither crashes `join` nor is lost:
it moves aside and the node starts as one without a checkpoint. An audit's truncated
stage0-step80.safetensors ended `join` in a safetensors traceback that named no file and no fix."""

import asyncio
import logging

import torch

from noloco_node.node.checkpoint import Checkpointer, save

IDENTITY = {"run_id": "local", "manifest_hash": "aaaa1111", "peer_id": "QmA"}


def _checkpointer(directory) -> Checkpointer:
    # compute, stage and optimizers are never reached: the file fails to load first.
    return Checkpointer(directory, 10, identity=IDENTITY, compute=None, stage=None, inner=None, outer=None)


def test_a_truncated_checkpoint_moves_aside_with_a_warning_and_resume_finds_none(tmp_path, caplog):
    weights = save(tmp_path, 0, {"theta/w": torch.ones(1000)}, {"inner_step": 80, "outer_round": 8}, IDENTITY)
    weights.write_bytes(weights.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        assert asyncio.run(_checkpointer(tmp_path).resume(0)) is None
    [aside] = tmp_path.glob("damaged-*")
    assert sorted(p.name for p in aside.iterdir()) == ["stage0-step80.safetensors", "stage0.json"]
    assert not (tmp_path / "stage0.json").exists()
    assert "cannot be read" in caplog.text and str(aside) in caplog.text
    assert asyncio.run(_checkpointer(tmp_path).resume(0)) is None  # nothing left to trip over


def test_a_checkpoint_whose_weights_file_is_gone_moves_aside_too(tmp_path):
    weights = save(tmp_path, 1, {"theta/w": torch.ones(4)}, {"inner_step": 5, "outer_round": 0}, IDENTITY)
    weights.unlink()
    assert asyncio.run(_checkpointer(tmp_path).resume(1)) is None
    [aside] = tmp_path.glob("damaged-*")
    assert [p.name for p in aside.iterdir()] == ["stage1.json"]
