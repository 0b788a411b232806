"""A bootstrap's swarm page keeps its charts across a restart (an operator who restarted the
bootstrap to upgrade it found an empty page): the view saves its history beside the identity
every minute and at exit, and a new view of the same run carries it over."""

import json

import pytest

from noloco_node.cli.bootstrap import history_file
from noloco_node.config import load_config
from noloco_node.dashboard.history import SwarmHistory
from noloco_node.dashboard.swarm import SwarmView, load_history
from noloco_node.dht.records import StageRecord
from tests.unit.dht.record_sample import record

CONFIG = load_config(overrides=["run.run_id=dash", "pipeline.num_stages=1"])


def replica(inner_step: int, updated_at: float, loss: float) -> StageRecord:
    return record("QmA", 0, inner_step=inner_step, updated_at=updated_at, loss=loss)


def test_the_file_sits_beside_the_identity():
    assert str(history_file("/srv/noloco/bootstrap.key")) == "/srv/noloco/bootstrap.history.json"


async def test_a_restarted_view_carries_the_charts_over_and_keeps_adding_to_them(tmp_path):
    path, now, current = tmp_path / "bootstrap.history.json", [0.0], [replica(10, 1000.0, 5.0)]

    async def read(stage):
        return list(current)

    first = SwarmView(read, CONFIG, poll_s=5.0, clock=lambda: now[0], history_file=path, save_every_s=60.0)
    await first.swarm()
    assert not path.exists()  # not due yet
    now[0], current[0] = 61.0, replica(20, 1060.0, 4.0)
    await first.swarm()  # a minute on: saved
    saved = json.loads(path.read_text())
    assert saved["run_id"] == "dash" and [p[1:] for p in saved["loss"]["QmA"]] == [[10, 5.0], [20, 4.0]]
    now[0], current[0] = 70.0, replica(30, 1070.0, 3.5)
    await first.swarm()
    await first.save()  # at exit
    second = SwarmView(read, CONFIG, poll_s=5.0, clock=lambda: now[0], history_file=path)
    assert [p[1:] for p in (await second.history_json())["loss"]["QmA"]] == [[10, 5.0], [20, 4.0], [30, 3.5]]
    current[0] = replica(40, 1080.0, 3.0)
    now[0] = 80.0
    await second.swarm()
    assert [p[1] for p in second.history.inner_step["QmA"].as_list()] == [10, 20, 30, 40]
    # The record it saw last is not added twice.
    second.history.observe(1090.0, [{"peer_id": "QmA", "updated_at": 1080.0, "inner_step": 40, "loss": 3.0}], 1.0)
    assert len(second.history.loss["QmA"].as_list()) == 4


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        json.dumps({"run_id": "dash", "schema": "something/else"}),
        json.dumps({"run_id": "dash", "schema": "noloco-node/history/1", "tokens_per_s": [[1.0]], "loss": {}}),
        json.dumps(
            {"run_id": "dash", "schema": "noloco-node/history/1", "tokens_per_s": [], "loss": {"a": [[1, 2, "x"]]}}
        ),
        json.dumps({"run_id": "dash", "schema": "noloco-node/history/1", "tokens_per_s": [[1.0, float("nan")]]}),
    ],
)
def test_an_unreadable_file_starts_a_new_history_and_says_so(tmp_path, caplog, text):
    path = tmp_path / "h.json"
    path.write_text(text)
    history = load_history(path, "dash")
    assert history.as_json() == SwarmHistory().as_json()
    assert "unreadable" in caplog.text
    assert (tmp_path / "h.json.unreadable").read_text() == text


def test_another_runs_history_is_not_carried_over(tmp_path):
    path = tmp_path / "h.json"
    kept = SwarmHistory()
    kept.observe(1.0, [{"peer_id": "a", "updated_at": 1.0, "inner_step": 3, "loss": 2.0}], 5.0)
    path.write_text(json.dumps({"run_id": "other", **kept.as_json()}))
    assert load_history(path, "dash").as_json()["loss"] == {}
    # Moved aside, not left to be overwritten by the new run's first save (a NAT audit lost one so).
    assert not path.exists() and load_history(tmp_path / "h.other.json", "other").as_json() == kept.as_json()
    assert load_history(tmp_path / "missing.json", "dash").as_json() == SwarmHistory().as_json()
