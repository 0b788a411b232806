"""A checkpoint folder never loses another run's checkpoint: a node of another manifest moves it
aside instead of writing over it, and `--stage auto` reads only its own run's checkpoints. A newcomer
found a 961-step stage-1 checkpoint replaced by a step-0 one after a `join --set model.seq_len=64`."""

import json

import torch
from safetensors.torch import load_file

from noloco_node.node.checkpoint import save, stages_in

TRAINED = {"run_id": "local", "manifest_hash": "aaaa1111", "peer_id": "QmA"}
OTHER = {"run_id": "local", "manifest_hash": "bbbb2222", "peer_id": "QmB"}


def test_another_manifests_checkpoint_is_moved_aside_not_written_over(tmp_path, caplog):
    save(tmp_path, 1, {"theta/w": torch.full((2,), 961.0)}, {"inner_step": 961, "outer_round": 19}, TRAINED)
    assert stages_in(tmp_path, "local", "aaaa1111") == [1] and stages_in(tmp_path, "local", "bbbb2222") == []

    save(tmp_path, 1, {"theta/w": torch.zeros(2)}, {"inner_step": 0, "outer_round": 0}, OTHER)
    assert stages_in(tmp_path, "local", "bbbb2222") == [1] and stages_in(tmp_path, "local", "aaaa1111") == []
    aside = tmp_path / "other-aaaa1111"
    meta = json.loads((aside / "stage1.json").read_text())
    assert meta["inner_step"] == 961 and load_file(str(aside / meta["file"]))["theta/w"].tolist() == [961.0, 961.0]
    assert stages_in(aside, "local", "aaaa1111") == [1]  # where export --from-checkpoint finds it
    assert "moved to" in caplog.text and "not written over" in caplog.text

    save(tmp_path, 1, {"theta/w": torch.ones(2)}, {"inner_step": 50, "outer_round": 1}, OTHER)  # our own: replaced
    assert sorted(p.name for p in tmp_path.glob("stage1-step*.safetensors")) == ["stage1-step50.safetensors"]
