"""node/attention.py: what a node and a swarm say needs attention, and what a node waits for."""

import dataclasses

from noloco_node.node.attention import (
    MAX_NOTE_CHARS,
    STALL_S,
    NodeView,
    Progress,
    attention,
    for_record,
    swarm_attention,
)

SOLO = {"outcome": "solo", "reason": "no partner"}
PAIRED = {"outcome": "paired"}


def view(**kw) -> NodeView:
    values = dict(
        stage=1, rounds_go_solo=True, all_reduce=False, replicas_of_stage=2, outer_history=[], since_progress_s=1.0
    )
    values.update(kw)
    return NodeView(**values)


def test_all_is_well_says_nothing():
    assert attention(view(outer_history=[PAIRED, SOLO, PAIRED, SOLO])) == []
    assert attention(view(outer_history=[SOLO, SOLO, SOLO])) == []  # a few solo rounds with a partner around


def test_rounds_that_keep_going_solo_say_why():
    notes = attention(view(outer_history=[PAIRED] + [SOLO] * 4))
    assert len(notes) == 1 and "last 4 outer rounds went solo" in notes[0] and "timeouts.match_s" in notes[0]
    lone = attention(view(replicas_of_stage=1, outer_history=[SOLO]))
    assert "no second replica" in lone[0] and "stage 1" in lone[0]
    assert attention(view(rounds_go_solo=False, outer_history=[SOLO] * 9)) == []
    assert "all-reduce group never formed" in attention(view(all_reduce=True, outer_history=[SOLO] * 4))[0]
    behind = attention(view(outer_history=[{"outcome": "solo", "reason": "replicas ahead"}] * 4))
    assert "rounds ahead and pair without this node" in behind[0] and "copies their state" in behind[0]
    assert len("the last 4 outer rounds went solo: " + behind[0].split(": ", 1)[1]) <= 200  # a DHT record's note
    in_vain = attention(view(outer_history=[{"outcome": "solo", "reason": "replicas ahead"}] * 4, copied_in_vain=True))
    assert "landed behind too" in in_vain[0] and "faster link" in in_vain[0] and len(in_vain[0]) <= 200


def test_rounds_refused_for_the_partners_weights_say_so_not_match_s():
    """A hostile-peer audit: after a stranger averaged scaled weights in, the honest replicas
    refused each other every round, and the note told the volunteer to raise timeouts.match_s."""
    notes = attention(view(outer_history=[{"outcome": "solo", "reason": "rejected"}] * 4))
    assert "weights were refused" in notes[0] and "match_s" not in notes[0] and "swarm key" in notes[0]


def test_a_note_is_whole_in_the_log_and_shortened_at_a_word_for_the_record():
    [long] = attention(view(outer_history=[PAIRED] + [SOLO] * 4))
    assert long.endswith("raise timeouts.match_s")  # a newcomer read 'raise timeouts.ma'
    [short] = for_record([long])
    assert len(short) <= MAX_NOTE_CHARS and short.endswith("…") and long.startswith(short[:-1])
    assert long[len(short) - 1] == " " or not long[len(short) - 1].isalnum()  # cut between words
    assert for_record(["brief"]) == ["brief"]


def test_no_progress_is_a_warning_unless_the_node_knowingly_waits_or_is_done():
    assert "no microbatches arrive from stage 0" in attention(view(since_progress_s=STALL_S + 1))[0]
    assert "not coming back" in attention(view(stage=0, since_progress_s=3 * STALL_S))[0]
    assert attention(view(since_progress_s=STALL_S + 1, waiting_for="a stage-0 replica")) == []
    assert attention(view(stage=0, since_progress_s=STALL_S + 1, done=True)) == []


def test_progress_says_what_it_waits_for_and_restarts_the_clock_after():
    now = [100.0]
    progress = Progress(clock=lambda: now[0])
    progress.wait("a stage-1 replica")
    now[0] += 12
    assert progress.waiting_text() == "waiting for a stage-1 replica; 12 s"
    assert progress.since_progress_s() == 12
    progress.wait(None)
    assert progress.waiting_text() is None and progress.since_progress_s() == 0
    now[0] += 5
    progress.observe(3)
    assert progress.since_progress_s() == 0


def test_the_swarm_view_names_empty_and_lone_stages_laggards_relays_and_node_notes():
    rows = [
        dict(peer_id="peerAAAAAAAA", stage=0, inner_step=100, status="serving", reach="direct", attention=[]),
        dict(
            peer_id="peerBBBBBBBB",
            stage=0,
            inner_step=10,
            status="serving",
            reach="relayed",
            attention=["the last 4 outer rounds went solo: x"],
        ),
        dict(peer_id="peerCCCCCCCC", stage=1, inner_step=90, status="serving", reach="direct", attention=[]),
        dict(peer_id="peerDDDDDDDD", stage=2, inner_step=0, status="leaving", reach="direct", attention=[]),
    ]
    notes = swarm_attention(rows, 3, behind_steps=50)
    text = "\n".join(notes)
    assert "stage 2 has no replica" in text  # a leaving record is not a replica
    assert "stage 1 has a single replica" in text
    assert "BBBBBBBB (stage 0) is 90 inner steps behind" in text
    assert "BBBBBBBB (stage 0) is reached only through a relay" in text
    assert "BBBBBBBB (stage 0) says: the last 4 outer rounds went solo" in text
    assert "AAAAAAAA" not in text


def test_a_node_waiting_beside_peers_of_another_config_is_told_its_config_is_not_theirs():
    waiting = NodeView(
        stage=2,
        rounds_go_solo=True,
        all_reduce=False,
        replicas_of_stage=1,
        outer_history=[],
        since_progress_s=10.0,
        waiting_for="a stage-1 replica",
        other_config_peers=3,
    )
    [note] = attention(waiting)
    assert "3 peer(s) of this run use another config" in note and note.endswith("(`noloco-node doctor` checks)")
    assert attention(dataclasses.replace(waiting, other_config_peers=0)) == []
    assert attention(dataclasses.replace(waiting, waiting_for=None, since_progress_s=1.0)) == []  # training: no note
