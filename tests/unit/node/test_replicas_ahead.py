"""A replica copies its stage again only when the stage's records agree it is rounds behind, and
only from replicas whose claims fit what the others say. Found by a hostile-peer audit: a record
claiming 3,495 steps ahead of three honest replicas made the odd one out copy from it and take its
step; the rest of the stage then copied that replica."""

from types import SimpleNamespace

from noloco_node.node.catching_up import replicas_ahead
from noloco_node.node.discovery import _past


def records(**steps: int) -> list:
    return [SimpleNamespace(peer_id=name, inner_step=step) for name, step in steps.items()]


def test_one_record_far_ahead_of_honest_replicas_is_not_followed():
    assert replicas_ahead(records(s1a=2030, s1c=2031, fake=5521), mine=2026, every=10) == []
    assert replicas_ahead(records(s1a=2030, fake=5521), mine=2026, every=10) == []


def test_a_replica_really_behind_copies_from_those_that_agree():
    ahead = replicas_ahead(records(s1a=2100, s1c=2110, fake=5521), mine=2026, every=10)
    assert [r.peer_id for r in ahead] == ["s1a", "s1c"]
    assert [r.peer_id for r in replicas_ahead(records(only=2100), mine=2026, every=10)] == ["only"]
    assert replicas_ahead(records(s1a=2030), mine=2026, every=10) == []  # not a round behind


def test_a_restarted_node_takes_the_agreed_step_not_a_claim_over_its_checkpoint():
    assert _past(records(s1a=2030, fake=5521), inner_step=2026, margin=20) is None
    assert _past(records(s1a=2100, s1c=2110, fake=5521), inner_step=2026, margin=20) == 2110
