"""A state copy's top-up (codec/top_up.py, sync/top_up.py): the donor's ledger of what each joiner
holds, the int8 difference and its carried rounding, and the joiner brought to its donors' phi
and counters now, in the in-memory twin and over gRPC; a donor that sent nothing refuses and the
copy stays as it was."""

import asyncio

import pytest
import torch

from noloco_node.codec.state_layout import state_spec
from noloco_node.codec.top_up import SentPhi, phi_difference
from noloco_node.errors import PeerUnavailable
from noloco_node.sync.memory import MemoryPairingHub
from noloco_node.sync.state_fetch import fetch_from_donors
from noloco_node.sync.top_up import top_up_from_donors
from noloco_node.sync.transfer import apply_top_up, expected_tensors, import_state

from .test_state_fetch import Donor, fresh_joiner, grpc_donors


def int8_bound(difference: torch.Tensor, block: int = 64) -> float:
    """The largest rounding int8 blockwise may leave: the largest block's absmax / 254."""
    return float(difference.flatten().abs().max()) / 254 + 1e-7


def train_on(donor: Donor, rounds: int, seed: int) -> None:
    """The donor's phi moves by a few outer rounds' worth (small against phi) and its counters on."""
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in donor.tensors if n.startswith("phi/")]:
        phi = donor.tensors[name]
        donor.tensors[name] = phi + 1e-3 * rounds * torch.randn(phi.shape, generator=g)
    donor.counters = dict(donor.counters, inner_step=donor.counters["inner_step"] + 10 * rounds)
    donor.counters["outer_round"] += rounds


def test_the_ledger_keeps_what_each_joiner_holds_forgets_and_expires():
    now = [0.0]
    sent = SentPhi(keep_s=100.0, max_joiners=2, clock=lambda: now[0])
    sent.record("j1", "w", torch.ones(3))
    sent.record("j2", "w", torch.zeros(3))
    assert torch.equal(sent.held("j1", "w"), torch.ones(3)) and sent.held("j1", "other") is None
    sent.record("j3", "w", torch.zeros(3))  # a third joiner: the one recorded longest ago goes
    assert sent.joiners() == ["j2", "j3"] and sent.held("j1", "w") is None
    sent.forget("j2")
    assert sent.joiners() == ["j3"]
    now[0] = 101.0
    assert sent.held("j3", "w") is None and sent.joiners() == []


def test_a_difference_lands_within_the_int8_bound_and_the_next_carries_its_rounding():
    torch.manual_seed(0)
    held = torch.randn(4096)
    now = held + 1e-3 * torch.randn(4096)
    spec, payload, holds = phi_difference(now, held)
    assert spec.codec == "int8" and len(payload) < 4096 * 1.1  # a byte per value and a scale per 64
    first = float((holds - now).abs().max())
    assert 0 < first <= int8_bound(now - held)
    _, _, again = phi_difference(now, holds)  # nothing moved since: the rounding left is what travels
    assert float((again - now).abs().max()) <= int8_bound(now - holds) < first / 50


def test_a_top_up_is_about_a_ninth_of_the_compact_copy():
    _, outer, _ = fresh_joiner()
    expected = expected_tensors(outer)
    compact = sum(state_spec(n, s, d, True).payload_bytes for n, (s, d) in expected.items())
    top_up = sum(state_spec(n, s, d, False, True).payload_bytes for n, (s, d) in expected.items() if "phi/" in n)
    assert 0.10 < top_up / compact < 0.13, top_up / compact


def copy_and_top_up(source, donors: dict[str, Donor], joiner, move) -> tuple:
    """Copy from every donor at once, let `move` change them, top the copy up; returns the fetched
    state and the top-up's counters (None when it raised, with the error)."""
    _, outer, inner = joiner

    async def scenario():
        fetched = await fetch_from_donors(
            source, list(donors), stage=0, requester="joiner", timeout_s=20, expected=expected_tensors(outer)
        )
        import_state(outer, inner, fetched.tensors, fetched.counters)
        move()
        try:
            differences, counters = await top_up_from_donors(
                source, fetched.owner, stage=0, requester="joiner", timeout_s=20, expected=expected_tensors(outer)
            )
        except PeerUnavailable as exc:
            return fetched, None, exc
        apply_top_up(outer, inner, differences, counters)
        return fetched, counters, None

    return asyncio.run(scenario())


def assert_at_donors_phi_now(joiner, fetched, donors: dict[str, Donor], copied: dict[str, torch.Tensor]) -> None:
    model, outer, _ = joiner
    for parameter, donor in fetched.owner.items():
        now = donors[donor].tensors[f"phi/{parameter}"]
        assert torch.equal(outer.phi[parameter], dict(model.named_parameters())[parameter].detach())  # theta = phi
        error = float((outer.phi[parameter] - now).abs().max())
        assert error <= int8_bound(now - copied[parameter]), (parameter, error)
        assert float((copied[parameter] - now).abs().max()) > 50 * error  # the copy itself was far off


def memory_donors(donors: dict[str, Donor]) -> MemoryPairingHub:
    hub = MemoryPairingHub()
    for name, donor in donors.items():
        hub.register(name, None, donor)
    return hub


def test_in_memory_two_donors_move_on_and_the_top_up_brings_the_copy_to_their_phi_and_counters():
    donors = {"a": Donor(1), "b": Donor(2)}
    hub = memory_donors(donors)
    joiner = fresh_joiner()
    copied = {}

    def move():
        copied.update({p: t.clone() for p, t in joiner[1].phi.items()})
        train_on(donors["a"], rounds=4, seed=1)
        train_on(donors["b"], rounds=5, seed=2)

    fetched, counters, error = copy_and_top_up(hub.transport("joiner"), donors, joiner, move)
    assert error is None and set(fetched.parameters_from) == {"a", "b"}
    assert_at_donors_phi_now(joiner, fetched, donors, copied)
    assert counters == {"inner_step": donors["b"].counters["inner_step"], "outer_round": 7}  # b is furthest
    assert joiner[2].step_count == counters["inner_step"] and joiner[1].round == 7


def test_a_donor_that_sent_us_nothing_refuses_and_the_copy_stays_as_it_was():
    donors = {"a": Donor(1), "b": Donor(2)}
    hub = memory_donors(donors)
    joiner = fresh_joiner()
    kept = {}

    def move():  # b forgets what it sent (its ledger expired): the whole top-up fails
        kept.update({p: t.clone() for p, t in joiner[1].phi.items()})
        hub.sent["b"].forget("joiner")
        train_on(donors["a"], rounds=4, seed=1)

    _, counters, error = copy_and_top_up(hub.transport("joiner"), donors, joiner, move)
    assert counters is None and "FAILED_PRECONDITION" in str(error)
    assert all(torch.equal(joiner[1].phi[p], kept[p]) for p in kept)


def test_over_grpc_the_top_up_follows_a_moved_donor_and_a_stranger_is_refused():
    donors = {"a": Donor(1), "b": Donor(2)}
    joiner = fresh_joiner()
    copied = {}

    async def scenario():
        async with grpc_donors(donors) as (client, _):
            _, outer, inner = joiner
            fetched = await fetch_from_donors(
                client, ["a", "b"], stage=0, requester="joiner", timeout_s=20, expected=expected_tensors(outer)
            )
            import_state(outer, inner, fetched.tensors, fetched.counters)
            copied.update({p: t.clone() for p, t in outer.phi.items()})
            train_on(donors["a"], rounds=3, seed=3)
            train_on(donors["b"], rounds=3, seed=4)
            differences, counters = await top_up_from_donors(
                client, fetched.owner, stage=0, requester="joiner", timeout_s=20, expected=expected_tensors(outer)
            )
            apply_top_up(outer, inner, differences, counters)
            with pytest.raises(PeerUnavailable, match="FAILED_PRECONDITION"):
                await client.top_up_state(
                    "a",
                    stage=0,
                    requester="stranger",
                    timeout_s=10,
                    expected=expected_tensors(outer),
                    names=["0.weight"],
                )
            return fetched, counters

    fetched, counters = asyncio.run(scenario())
    assert_at_donors_phi_now(joiner, fetched, donors, copied)
    assert counters["outer_round"] == max(d.counters["outer_round"] for d in donors.values())
