"""The swarm's JSON (`status --json`, the swarm page) from records: what needs attention, the
limiting stage, the history the charts draw, and the view's reads of the DHT."""

import asyncio
import json

import pytest

from noloco_node.config import load_config
from noloco_node.dashboard.history import MAX_SERIES, SwarmHistory
from noloco_node.dashboard.swarm import SwarmView, read_rows, swarm_json
from noloco_node.dht.records import StageRecord
from tests.unit.dht.record_sample import record

CONFIG = load_config(overrides=["run.run_id=dash", "pipeline.num_stages=3", "outer.inner_steps_per_outer=5"])


def rows(*records: StageRecord, now: float = 1001.0) -> list[dict]:
    by_stage = {}
    for r in records:
        by_stage.setdefault(r.stage, []).append(r)

    async def read(stage):
        return by_stage.get(stage, [])

    return asyncio.run(read_rows(read, CONFIG.pipeline.num_stages, now))


def test_an_empty_stage_a_lone_one_a_relayed_replica_and_another_manifest_need_attention():
    swarm = swarm_json(
        rows(
            record("peerA0000000", 0),
            record("peerB0000000", 0, reach="relayed"),
            record("peerC0000000", 1, manifest_hash="x" * 16),
        ),
        CONFIG,
        now=1001.0,
    )
    notes = swarm["attention"]
    assert any(n.startswith("stage 2 has no replica") and "--stage auto" in n for n in notes), notes
    # stage 1's only replica runs another config: it never trains with the swarm, so the stage is empty
    assert any(n.startswith("stage 1 has no replica") for n in notes), notes
    relayed = [n for n in notes if "B0000000" in n]
    assert relayed and "relay" in relayed[0] and "doctor" in relayed[0], notes
    other = [n for n in notes if "C0000000" in n and "manifest" in n]
    assert other and "xxxxxxxxxxxx" in other[0] and "mmmmmmmmmmmm" in other[0], notes
    assert swarm["run"]["manifest_hash"] == "m" * 16  # two of three announce it
    assert swarm["limiting_stage"] is None and "stages 1, 2 have no measured" in swarm["limiting_reason"]


def test_a_replica_of_another_config_is_no_laggard_of_its_stage():
    """A newcomer's joiner with --set model.seq_len=64 was also called '687 inner steps behind its
    stage: a slow machine or link' beside the right note (another manifest)."""
    swarm = swarm_json(
        rows(
            record("peerA0000000", 0, inner_step=700),
            record("peerB0000000", 0, inner_step=700),
            record("peerX0000000", 0, inner_step=13, manifest_hash="x" * 16),
            record("peerC0000000", 1),
        ),
        CONFIG,
        now=1001.0,
    )
    about_x = [n for n in swarm["attention"] if "X0000000" in n]
    assert about_x and all("manifest" in n and "behind" not in n for n in about_x), about_x
    assert swarm["tokens_per_s"] == 200.0  # the other config's node trains nothing of the swarm's


def test_a_replica_that_stopped_renewing_its_record_needs_attention_before_it_expires():
    heartbeat = CONFIG.timeouts.heartbeat_s
    swarm = swarm_json(
        rows(
            record("0000quietnow", 0, updated_at=1000.0 - 2 * heartbeat),
            record("gone00000000", 1, updated_at=1000.0 - 2 * heartbeat, status="leaving"),
            record("fine00000000", 2),
        ),
        CONFIG,
        now=1001.0,
    )
    quiet = [n for n in swarm["attention"] if "has not renewed" in n]
    assert len(quiet) == 1 and "quietnow" in quiet[0] and f"{2 * heartbeat + 1:.0f} s" in quiet[0], swarm["attention"]


def test_a_healthy_swarm_names_its_limiting_stage_and_why_and_shows_no_key_material():
    swarm = swarm_json(
        rows(
            record("a", 0, capacity=8.0),
            record("b", 0, capacity=8.0, tokens_per_s=50.0),
            record("c", 1, capacity=3.0),
            record("d", 1, capacity=3.5),
            record("e", 2, capacity=9.0),
            record("f", 2, capacity=9.0),
        ),
        CONFIG,
        now=1001.0,
    )
    assert swarm["schema"] == "noloco-node/swarm/1" and swarm["attention"] == []
    assert swarm["limiting_stage"] == 1
    assert swarm["limiting_reason"] == (
        "stage 1: 6.5 sequences/s over 2 replicas, the least of the stages (next: stage 0, 16.0)"
    )
    assert swarm["tokens_per_s"] == 150.0  # stage 0's replicas: every token enters there once
    assert swarm["run"]["method"] == CONFIG.outer.method and swarm["run"]["inner_steps_per_outer"] == 5
    text = json.dumps(swarm)
    assert "tls_cert" not in text and "AAAA" not in text  # the certificate only as its fingerprint
    assert all(len(r["tls_fingerprint"]) == 64 and r["seen_s_ago"] == 1.0 for r in swarm["replicas"])


def test_history_adds_a_replica_point_only_when_its_record_changed_and_stays_bounded():
    history = SwarmHistory(limit=3)
    for t in range(5):
        replicas = [
            {"peer_id": "a", "updated_at": float(t // 2), "inner_step": t // 2, "loss": 5.0 - t},
            {"peer_id": "b", "updated_at": float(t), "inner_step": t, "loss": None},
        ]
        history.observe(100.0 + t, replicas, tokens_per_s=10.0 * t)
    out = history.as_json()
    assert out["tokens_per_s"] == [[102.0, 20.0], [103.0, 30.0], [104.0, 40.0]]
    assert out["loss"]["a"] == [[0.0, 0, 5.0], [1.0, 1, 3.0], [2.0, 2, 1.0]]  # records of t = 0, 2, 4
    assert "b" not in out["loss"] and [p[1] for p in out["inner_step"]["b"]] == [2, 3, 4]
    many = SwarmHistory()
    for i in range(MAX_SERIES + 5):
        many.observe(float(i), [{"peer_id": f"p{i}", "updated_at": float(i), "inner_step": 0, "loss": 1.0}], 0.0)
    assert len(many.loss) == MAX_SERIES and "p0" not in many.loss and f"p{MAX_SERIES + 4}" in many.loss


async def test_the_view_reads_the_dht_at_most_every_poll_and_keeps_its_last_read_when_one_fails():
    now = [0.0]
    reads, fail = [], [False]
    versions = {0: [record("a", 0)], 1: [record("b", 1)], 2: [record("c", 2)]}

    async def read(stage):
        reads.append(stage)
        if fail[0]:
            raise TimeoutError("DHT lookup timed out")
        return versions[stage]

    view = SwarmView(read, CONFIG, poll_s=5.0, clock=lambda: now[0])
    first = await view.swarm()
    assert len(first["replicas"]) == 3 and len(reads) == 3
    await asyncio.gather(view.swarm(), view.swarm(), view.history_json())
    assert len(reads) == 3  # within the poll period: the same read
    now[0] = 6.0
    versions[0] = [record("a", 0, updated_at=1006.0, inner_step=11, loss=4.5)]
    second = await view.swarm()
    assert len(reads) == 6 and second["replicas"][0]["inner_step"] == 11
    assert (await view.history_json())["loss"]["a"][-1][1:] == [11, 4.5]
    now[0], fail[0] = 12.0, True
    assert await view.swarm() is second  # the last good read stands
    view_without = SwarmView(read, CONFIG, poll_s=5.0, clock=lambda: now[0])
    with pytest.raises(TimeoutError):
        await view_without.swarm()  # nothing to show yet: the request fails (500), the page retries


def test_the_models_shape_is_the_presets_with_set_fields_over_it_and_unknown_for_a_file(tmp_path):
    """A newcomer saw hidden/intermediate/layers/heads null for the default tiny preset."""
    model = swarm_json([], CONFIG, now=0.0)["run"]["model"]
    assert model == {"hidden_size": 128, "intermediate_size": 352, "num_layers": 4, "num_heads": 4, "seq_len": 128}
    wider = load_config(overrides=["model.preset=small", "model.num_layers=6"])
    assert swarm_json([], wider, now=0.0)["run"]["model"]["num_layers"] == 6
    assert swarm_json([], wider, now=0.0)["run"]["model"]["hidden_size"] == 768
    (tmp_path / "config.json").write_text("{}")
    from_file = load_config(overrides=[f"model.config={tmp_path / 'config.json'}"])
    assert swarm_json([], from_file, now=0.0)["run"]["model"]["hidden_size"] is None


def test_a_stage0_replica_whose_records_go_on_without_a_step_is_named_as_stalled():
    # A soak's page read 2,538 tok/s and every replica serving 30 s into a stop of the pipeline.
    from noloco_node.dashboard.swarm import STALL_FLOOR_S, stall_notes

    history = SwarmHistory()
    stalled, steady, served = [], [], []
    for t in range(60):  # records every second; steps every second for 20 s, then none for 40 s
        rows_now = [
            {"peer_id": "QmStage0AAAAAAAA", "stage": 0, "status": "serving", "updated_at": float(t),
             "inner_step": min(t, 20), "loss": None},
            {"peer_id": "QmStage0BBBBBBBB", "stage": 0, "status": "serving", "updated_at": float(t),
             "inner_step": t, "loss": None},
            {"peer_id": "QmStage1CCCCCCCC", "stage": 1, "status": "serving", "updated_at": float(t),
             "inner_step": min(t, 20), "loss": None},
        ]  # fmt: skip
        history.observe(1000.0 + t, rows_now, tokens_per_s=100.0)
        notes = stall_notes(rows_now, history)
        (stalled if any("AAAAAAAA" in n for n in notes) else steady).append(t)
        served += [n for n in notes if "BBBBBBBB" in n or "CCCCCCCC" in n]
    assert stalled and min(stalled) == 20 + STALL_FLOOR_S + 1 and max(steady) == 20 + STALL_FLOOR_S, (stalled, steady)
    assert served == []  # a replica stepping on, and a later stage (it waits on stage 0), are not named
    [note] = stall_notes(rows_now, history)
    assert note.startswith("replica AAAAAAAA (stage 0) has taken no inner step for 39 s (one every 1.0 s before)")
    assert stall_notes([dict(rows_now[0], status="leaving")], history) == []
