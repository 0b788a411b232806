"""Which weights `export` takes: from a live swarm the furthest trained replica of each stage first
(named when the replicas are far apart); from checkpoint folders, `join`'s own folders that a node
left without a checkpoint are passed over, any other folder without one is an error."""

import asyncio
import json
import logging
from types import SimpleNamespace

import pytest

from noloco_node.node.checkpoint_home import LOCK_NAME
from noloco_node.node.export import STEPS_APART, ExportError, _live_replicas
from noloco_node.node.export_sources import gather_checkpoints


class _Directory:
    def __init__(self, steps: dict[str, int]) -> None:
        self.records = [SimpleNamespace(peer_id=peer, inner_step=step) for peer, step in steps.items()]

    async def replicas(self, stage: int, *, fresh: bool = False) -> list:
        return list(self.records)


def test_the_furthest_trained_replica_comes_first_and_a_wide_gap_is_named(caplog):
    directory = _Directory({"peer-fresh": 198, "peer-trained": 898, "peer-middle": 500})
    with caplog.at_level(logging.WARNING, logger="noloco_node.node.export"):
        order = asyncio.run(_live_replicas(directory, 1, "run", "m"))
    assert order == ["peer-trained", "peer-middle", "peer-fresh"]
    assert "700 inner steps apart" in caplog.text and "er-fresh at 198" in caplog.text

    caplog.clear()
    close = _Directory({"a": 40, "b": 40 + STEPS_APART})
    with caplog.at_level(logging.WARNING, logger="noloco_node.node.export"):
        assert asyncio.run(_live_replicas(close, 0, "run", "m")) == ["b", "a"]
    assert "apart" not in caplog.text


def _checkpoint(folder, stage: int, manifest: str = "m") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"stage": stage, "manifest_hash": manifest, "file": f"stage{stage}.safetensors", "inner_step": 5}
    (folder / f"stage{stage}.json").write_text(json.dumps(meta))


def test_an_empty_folder_of_joins_own_is_passed_over_and_any_other_is_refused(tmp_path):
    _checkpoint(tmp_path / "node-0", 0)
    _checkpoint(tmp_path / "node-1", 1)
    (tmp_path / "node-2").mkdir()
    (tmp_path / "node-2" / LOCK_NAME).touch()  # a node that failed to start left its folder
    found = gather_checkpoints(sorted(tmp_path.glob("node-*")), num_stages=2, manifest_hash="m")
    assert sorted(found) == [0, 1]

    (tmp_path / "mine").mkdir()  # a folder named by hand that holds nothing: a mistake to say
    with pytest.raises(ExportError, match="mine holds no node checkpoint"):
        gather_checkpoints(
            [tmp_path / "node-0", tmp_path / "node-1", tmp_path / "mine"], num_stages=2, manifest_hash="m"
        )
    with pytest.raises(ExportError, match="node-2 holds no node checkpoint"):
        gather_checkpoints([tmp_path / "node-2"], num_stages=2, manifest_hash="m")
