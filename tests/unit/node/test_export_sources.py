"""`export --from-checkpoint` reads what nodes leave: a `--out DIR --save-weights` folder (the
demo's `runs/demo/nodes`) as well as checkpoint folders; a folder of stats files alone, a missing
folder, a damaged file and an --out it must not write over each get a sentence with the fix. An
audit's demo left a model export could not read ('stage0-<peer>.json is from another run ...
manifest None': the node's stats file taken for a checkpoint), and failures on the output side
ended in tracebacks."""

import json

import pytest
import torch
from safetensors.torch import save_file

from noloco_node.node.export import ExportError, check_out_dir
from noloco_node.node.export_sources import gather_checkpoints, load_stage_weights
from noloco_node.node.outputs import WEIGHTS_METADATA


def _saved(folder, stage: int, peer: str, *, step: int, phi: float | None, manifest: str = "m") -> None:
    """What node/outputs.py writes for one node: stats JSON, theta, and (with an outer method) phi."""
    folder.mkdir(parents=True, exist_ok=True)
    whose = {
        WEIGHTS_METADATA: json.dumps({"run_id": "r", "manifest_hash": manifest, "stage": stage, "inner_step": step})
    }
    (folder / f"stage{stage}-{peer}.json").write_text(json.dumps({"stage": stage, "inner_step": step}))
    save_file({f"w{stage}": torch.full((2,), -1.0)}, str(folder / f"stage{stage}-{peer}.safetensors"), metadata=whose)
    if phi is not None:
        outer = {f"phi/w{stage}": torch.full((2,), phi), f"momentum/w{stage}": torch.zeros(2)}
        save_file(outer, str(folder / f"stage{stage}-{peer}.outer.safetensors"), metadata=whose)


def test_a_save_weights_folder_gives_phi_of_the_newest_replica_and_stats_files_are_not_checkpoints(tmp_path):
    nodes = tmp_path / "nodes"
    _saved(nodes, 0, "AAAAAAAA", step=40, phi=1.0)
    _saved(nodes, 0, "BBBBBBBB", step=38, phi=2.0)
    _saved(nodes, 1, "CCCCCCCC", step=40, phi=3.0)
    found = gather_checkpoints([nodes], num_stages=2, manifest_hash="m")
    assert sorted(found) == [0, 1] and len(found[0]) == 2
    meta, path = max(found[0], key=lambda e: e[0]["inner_step"])
    tensors, kind = load_stage_weights(meta, path)
    assert kind == "phi" and tensors["w0"].tolist() == [1.0, 1.0]

    with pytest.raises(ExportError, match="run 'r', manifest m; this config gives other"):
        gather_checkpoints([nodes], num_stages=2, manifest_hash="other")


def test_saved_weights_without_an_outer_state_give_theta(tmp_path):
    _saved(tmp_path, 0, "AAAAAAAA", step=10, phi=None)
    [(meta, path)] = gather_checkpoints([tmp_path], num_stages=1, manifest_hash="m")[0]
    tensors, kind = load_stage_weights(meta, path)
    assert kind == "theta" and tensors["w0"].tolist() == [-1.0, -1.0]


def test_stats_files_alone_a_missing_folder_and_a_file_each_say_what_to_point_at(tmp_path):
    (tmp_path / "stats").mkdir()
    (tmp_path / "stats" / "stage0-AAAAAAAA.json").write_text("{}")
    with pytest.raises(ExportError, match="holds node stats files but no weights .*--save-weights"):
        gather_checkpoints([tmp_path / "stats"], num_stages=1, manifest_hash="m")
    with pytest.raises(ExportError, match="absent does not exist"):
        gather_checkpoints([tmp_path / "absent"], num_stages=1, manifest_hash="m")
    (tmp_path / "a.json").write_text("{}")
    with pytest.raises(ExportError, match="a.json is a file"):
        gather_checkpoints([tmp_path / "a.json"], num_stages=1, manifest_hash="m")


def test_a_damaged_weights_file_is_named_with_the_fix(tmp_path):
    _saved(tmp_path, 0, "AAAAAAAA", step=10, phi=1.0)
    outer = tmp_path / "stage0-AAAAAAAA.outer.safetensors"
    [(meta, path)] = gather_checkpoints([tmp_path], num_stages=1, manifest_hash="m")[0]
    outer.write_bytes(outer.read_bytes()[:50])
    with pytest.raises(ExportError, match="outer.safetensors cannot be read .* another replica's checkpoint"):
        load_stage_weights(meta, path)
    unreadable = tmp_path / "ck"
    unreadable.mkdir()
    (unreadable / "stage0.json").write_text("{not json")
    with pytest.raises(ExportError, match="stage0.json is not a readable checkpoint"):
        gather_checkpoints([unreadable], num_stages=1, manifest_hash="m")


def _model_dir(folder) -> None:
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")


def test_out_must_be_new_or_empty_or_an_earlier_export_with_overwrite(tmp_path):
    check_out_dir(tmp_path / "new" / "model", overwrite=False)  # made, and writable
    assert (tmp_path / "new" / "model").is_dir()

    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "config.json").write_text("important")
    for overwrite in (False, True):
        with pytest.raises(ExportError, match="holds files that are not a model \\(config.json\\)"):
            check_out_dir(mine, overwrite=overwrite)
    assert (mine / "config.json").read_text() == "important"

    _model_dir(tmp_path / "earlier")
    with pytest.raises(ExportError, match="holds an earlier export .* pass --overwrite"):
        check_out_dir(tmp_path / "earlier", overwrite=False)
    check_out_dir(tmp_path / "earlier", overwrite=True)

    (tmp_path / "afile").write_text("x")
    with pytest.raises(ExportError, match="afile is a file"):
        check_out_dir(tmp_path / "afile", overwrite=True)


def test_an_unwritable_out_is_refused_before_anything_is_fetched(tmp_path, monkeypatch):
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)  # root ignores modes: refuse the probe itself
    with pytest.raises(ExportError, match="cannot write to --out .* \\(Permission denied\\); name a folder"):
        check_out_dir(tmp_path / "ro", overwrite=False)


def test_the_exported_config_names_the_tokenizers_special_tokens(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from noloco_node.node.export import write_model_dir

    class Tokenizer:
        bos_token_id, eos_token_id, pad_token_id, model_max_length = None, 0, 1, int(1e30)

        def save_pretrained(self, out) -> None:
            (out / "tokenizer.json").write_text("{}")

    config = LlamaConfig(
        hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=16,
        max_position_embeddings=32,
    )  # fmt: skip
    tokenizer = Tokenizer()
    out = write_model_dir(tmp_path / "m", config, dict(LlamaForCausalLM(config).state_dict()), tokenizer)
    written = json.loads((out / "config.json").read_text())
    assert (written.get("bos_token_id"), written["eos_token_id"], written["pad_token_id"]) == (None, 0, 1)
    assert tokenizer.model_max_length == 32
