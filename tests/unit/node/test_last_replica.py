"""What a node says as it leaves when it is the last replica of its stage: the stage's trained
weights then exist only on it (seen on the first-hour walk: the only stage-1 node's Ctrl-C, and the
next stage-1 node started from its initial weights with nothing said)."""

import logging

from noloco_node.node.leaving import last_replica_words


def words(others: int, *, checkpoint_dir=None, weights_dir=None, run_done=False):
    return last_replica_words(1, others, 147, checkpoint_dir=checkpoint_dir, weights_dir=weights_dir, run_done=run_done)


def test_another_live_replica_keeps_the_stage_and_nothing_is_said():
    assert words(1) is None and words(3, checkpoint_dir="ckpt") is None


def test_the_last_replica_without_anything_on_disk_warns_and_says_the_fix():
    level, text = words(0)
    assert level == logging.WARNING
    assert text.startswith(
        "no other replica of stage 1 is serving now: its weights (inner step 147) leave with this node"
    )
    assert "leave checkpoint.auto on" in text and "set checkpoint.dir" in text
    assert "starts it from its initial weights" in text


def test_a_checkpoint_or_saved_weights_keep_them_and_the_end_of_a_run_is_no_loss():
    level, text = words(0, checkpoint_dir="ckpt-1")
    assert level == logging.INFO and "stay in the checkpoint in ckpt-1" in text
    assert text.endswith("`join` again with the same checkpoint.dir takes the stage back from it")
    level, text = words(0, weights_dir="runs/out")
    assert level == logging.INFO and text.endswith("are written to runs/out")
    level, _ = words(0, run_done=True)
    assert level == logging.INFO


def test_the_default_folder_is_named_as_what_join_on_this_machine_finds_again(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    folder = tmp_path / "noloco-node" / "run-a" / "node-0"
    level, text = words(0, checkpoint_dir=str(folder))
    assert level == logging.INFO and f"stay in the checkpoint in {folder};" in text
    assert text.endswith("`join` again on this machine (same run) takes the stage back from it")


def test_a_replica_that_never_trained_has_nothing_to_keep_and_says_so_plainly():
    for kwargs in ({}, {"checkpoint_dir": "ckpt-1"}):
        level, text = last_replica_words(
            2, 0, 0, weights_dir=None, run_done=False, **{"checkpoint_dir": None, **kwargs}
        )
        assert (
            level == logging.INFO
            and text == "no other replica of stage 2 is serving now, and it was never trained here: nothing to keep"
        )


async def test_a_node_that_never_trained_writes_no_checkpoint_as_it_leaves():
    """Seen by a newcomer: 'it was never trained here: nothing to keep', then a step-0 checkpoint."""
    from types import SimpleNamespace

    from noloco_node.node.leaving import _final_outputs

    saved = []

    async def checkpoint(driver):
        saved.append(driver)

    for steps in (0, 5):
        node = SimpleNamespace(
            snapshots=None,
            checkpoints=object(),
            boundary=SimpleNamespace(checkpoint=checkpoint),
            driver=None,
            worker=SimpleNamespace(inner_steps=steps),
            outputs=SimpleNamespace(out_dir=None),
        )
        await _final_outputs(node)
    assert saved == [None]  # only the node at inner step 5
