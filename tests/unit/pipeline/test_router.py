"""Next-hop choice: the balanced (reference) permutation, fixed pipelines and the random fallback."""

from collections import Counter

from noloco_node.pipeline.ports import Peer
from noloco_node.pipeline.router import Bans, Router

SENDERS = ["s-a", "s-b", "s-c", "s-d"]
RECEIVERS = [Peer(f"r-{i}", f"127.0.0.1:{9000 + i}") for i in range(4)]


def _targets(seed: str, receivers=RECEIVERS, senders=SENDERS, router=None) -> list[str | None]:
    router = router or Router(Bans())
    picks = [router.pick_permuted(list(reversed(receivers)), list(reversed(senders)), me, seed) for me in senders]
    return [p.peer_id if p else None for p in picks]


def test_every_receiver_gets_exactly_one_microbatch_per_number():
    for k in range(200):
        assert sorted(_targets(f"0:{k}:0")) == [p.peer_id for p in RECEIVERS]


def test_routes_are_random_per_microbatch_and_agree_between_routers():
    seen = Counter()
    for k in range(400):
        targets = _targets(f"0:{k}:0")
        assert targets == _targets(f"0:{k}:0", router=Router(Bans()))  # every sender computes the same permutation
        seen.update(zip(SENDERS, targets))
    assert len(seen) == 16  # each sender reaches each receiver
    assert all(60 <= n <= 140 for n in seen.values()), seen  # ~100 each
    assert _targets("0:1:0") != _targets("0:1:1") or _targets("0:2:0") != _targets("0:2:1")  # the stage is in the seed


def test_no_balanced_choice_when_memberships_differ_or_the_receiver_is_banned():
    router = Router(Bans())
    assert router.pick_permuted(RECEIVERS[:3], SENDERS, "s-a", "0:0:0") is None
    assert router.pick_permuted(RECEIVERS, SENDERS, "stranger", "0:0:0") is None
    target = _targets("0:5:0")[0]
    router.bans.ban(target)
    assert router.pick_permuted(RECEIVERS, SENDERS, "s-a", "0:5:0") is None
    assert router.pick(RECEIVERS).peer_id != target  # the random fallback skips the banned peer


def test_random_cycle_spreads_one_senders_load_evenly():
    router = Router(Bans())
    counts = Counter(router.pick(RECEIVERS).peer_id for _ in range(40))
    assert set(counts.values()) == {10}


def test_bans_back_off_exponentially_up_to_the_cap():
    now = [0.0]
    bans = Bans(base_s=1.0, max_ban_s=5.0, clock=lambda: now[0])
    assert [bans.ban("p") for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert bans.is_banned("p")
    now[0] = 5.1
    assert not bans.is_banned("p") and bans.active() == 0


def test_fixed_routing_forms_one_pipeline_per_sender_index():
    router = Router(Bans())
    targets = [router.pick_fixed(list(reversed(RECEIVERS)), list(reversed(SENDERS)), me).peer_id for me in SENDERS]
    assert targets == ["r-0", "r-1", "r-2", "r-3"]  # by index among the sorted ids, whatever the listing order
    assert all(
        router.pick_fixed(RECEIVERS, SENDERS, me).peer_id == t for me, t in zip(SENDERS, targets) for _ in range(20)
    )
    assert router.pick_fixed(RECEIVERS[:3], SENDERS, "s-d").peer_id == "r-0"  # fewer receivers: wraps around
    assert router.pick_fixed(RECEIVERS, SENDERS, "stranger") is None
    router.bans.ban("r-1")
    assert router.pick_fixed(RECEIVERS, SENDERS, "s-b") is None  # the caller falls back to a random other replica
