"""Reachability never guesses (node/joining.py): a node is direct only when a peer proved it can
dial its address, the initial peers (a bootstrap) are asked when no direct replica exists, a
loopback address is never offered to peers on other machines, and a relayed node asks again later
(with backoff) and switches to direct on the first success. The probe also asks again, with a
longer deadline, when no prober answered at all: on a loaded machine a probe that timed out
everywhere must not read as "nobody to ask"."""

import asyncio
import logging
from types import SimpleNamespace

import pytest

from noloco_node.errors import UnreachableAddress
from noloco_node.node import joining
from noloco_node.rpc import diagnostics

BOOT = "12D3KooWBootstrapPeer"
REMOTE = [f"/ip4/198.18.0.1/tcp/31330/p2p/{BOOT}"]
LOCAL = [f"/ip4/127.0.0.1/tcp/31330/p2p/{BOOT}"]


class Replicas:
    def __init__(self, direct: int = 2) -> None:
        self.direct = direct

    async def replicas(self, stage, fresh=False):
        return [SimpleNamespace(peer_id=f"peer{stage}{i}", reach="direct") for i in range(self.direct)] + [
            SimpleNamespace(peer_id=f"nat{stage}", reach="relayed")
        ]


def _answer(prober: str, reachable: bool) -> diagnostics.ProbeResult:
    return diagnostics.ProbeResult(
        prober=prober, reachable=reachable, detail="", skew_s=0.0, version="v", manifest_hash="m"
    )


def _probe(monkeypatch, answers, *, directory=None, initial_peers=()):
    calls = []

    async def fake(address, probers, *, run_id, timeout_s, dialer, tls_cert=b"", wanted=2):
        calls.append((timeout_s, list(probers)))
        return answers[len(calls) - 1]

    monkeypatch.setattr(diagnostics, "probe_from_peers", fake)
    result = asyncio.run(
        joining.probe_reachable(
            directory or Replicas(),
            None,
            address="127.0.0.1:9",
            tls_cert=b"",
            peer_id="me",
            num_stages=2,
            run_id="r",
            timeout_s=5.0,
            initial_peers=initial_peers,
        )
    )
    return result, calls


def test_unanswered_probe_is_asked_again_with_a_longer_deadline(monkeypatch):
    result, calls = _probe(monkeypatch, [([], ["peer00: DEADLINE_EXCEEDED"]), ([_answer("peer00", False)], [])])
    assert result is False and [c[0] for c in calls] == [5.0, 10.0]


def test_probe_gives_up_after_two_attempts(monkeypatch):
    result, calls = _probe(monkeypatch, [([], ["x: DEADLINE_EXCEEDED"]), ([], ["x: DEADLINE_EXCEEDED"])])
    assert result is None and [c[0] for c in calls] == [5.0, 10.0]


def test_peers_of_another_run_leave_the_address_unchecked_and_say_the_bootstrap_needs_the_config(monkeypatch, caplog):
    # An audit's docker bootstrap ran without --config (run 'local'): every node fell back to
    # libp2p with "could not ask any peer to check our address: ... FAILED_PRECONDITION ...".
    refused = "EcZKQAiz: FAILED_PRECONDITION this node serves run 'local'"
    with caplog.at_level(logging.WARNING, logger="noloco_node.node.joining"):
        result, _ = _probe(monkeypatch, [([], [refused]), ([], [refused])])
    assert result is None
    assert "the peers asked serve run 'local', this node run 'r' (the bootstrap needs the swarm's config" in caplog.text


def test_an_answer_first_time_is_not_asked_again(monkeypatch):
    result, calls = _probe(monkeypatch, [([_answer("peer00", True)], [])])
    assert result is True and [c[0] for c in calls] == [5.0]


def test_with_no_direct_replica_the_initial_peers_are_asked(monkeypatch):
    # The first home node of a swarm: only the bootstrap can check its address.
    result, calls = _probe(
        monkeypatch,
        [([_answer(BOOT, False)], [])],
        directory=Replicas(direct=0),
        initial_peers=REMOTE + ["/ip4/198.18.0.2/tcp/1/p2p/me"],
    )
    assert result is False and calls[0][1] == [BOOT]  # never itself, never a relayed replica


def test_direct_replicas_are_asked_before_the_initial_peers(monkeypatch):
    _, calls = _probe(
        monkeypatch, [([_answer("peer00", True)], [])], directory=Replicas(direct=1), initial_peers=REMOTE
    )
    assert sorted(calls[0][1][:2]) == ["peer00", "peer10"] and calls[0][1][2] == BOOT


def test_peer_ids_of_multiaddrs():
    assert joining.peer_ids_of(
        REMOTE + REMOTE + ["/ip4/1.2.3.4/tcp/1", f"/ip4/1.2.3.4/tcp/1/p2p/{BOOT}/p2p-circuit/p2p/X"]
    ) == [BOOT, "X"]


@pytest.mark.parametrize(
    "address,peers,expected",
    [
        ("127.0.0.1:5000", REMOTE, True),
        ("127.0.0.1:5000", LOCAL, False),
        ("127.0.0.1:5000", [], False),
        ("localhost:5000", ["/dns4/boot.example.org/tcp/31330/p2p/X"], True),
        ("[::1]:5000", REMOTE, True),
        ("198.19.1.2:5000", REMOTE, False),
        ("127.0.0.1:5000", LOCAL + REMOTE, True),
    ],
)
def test_loopback_address_to_remote_peers(address, peers, expected):
    assert joining.loopback_to_remote_peers(address, peers) is expected


def _decide(mode, answer, address="198.19.1.2:5000", peers=REMOTE):
    asked = []

    async def probe():
        asked.append(True)
        return answer

    return asyncio.run(joining.decide_reach(mode, probe, address=address, peers=peers)), bool(asked)


@pytest.mark.parametrize(
    "mode,answer,expected",
    [
        ("auto", True, "direct"),
        ("auto", False, "relayed"),
        ("auto", None, "relayed"),  # nobody could check: never direct on a guess
        ("direct", True, "direct"),
        ("direct", None, "direct"),  # the operator requires direct; it is announced unproven (warned)
    ],
)
def test_decide_reach(mode, answer, expected):
    assert _decide(mode, answer) == (expected, True)


def test_decide_reach_libp2p_and_declared_do_not_probe():
    assert _decide("libp2p", True) == ("relayed", False)
    assert _decide("declared", False) == ("direct", False)


def test_required_direct_that_no_peer_reaches_fails():
    with pytest.raises(UnreachableAddress, match="no peer could reach"):
        _decide("direct", False)


def test_loopback_address_with_remote_peers_is_relayed_without_a_probe():
    # The bug: a home node bound 127.0.0.1 announced it as direct to a bootstrap on another machine.
    assert _decide("auto", True, address="127.0.0.1:5000") == ("relayed", False)
    for mode in ("direct", "declared"):
        with pytest.raises(UnreachableAddress, match="loopback"):
            _decide(mode, True, address="127.0.0.1:5000")
    # All peers on this machine: loopback is dialable by every one of them, and the probe decides.
    assert _decide("auto", True, address="127.0.0.1:5000", peers=LOCAL) == ("direct", True)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _reprobe(answers):
    clock, switched, asked = Clock(), [], []

    async def probe():
        answer = answers[len(asked)]
        asked.append(clock.now)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def go_direct():
        switched.append(clock.now)

    return joining.Reprobe(probe, go_direct, period_s=10.0, clock=clock), clock, asked, switched


def test_reprobe_backs_off_then_switches_once():
    reprobe, clock, asked, switched = _reprobe([False, None, RuntimeError("prober vanished"), True])
    assert not reprobe.due()
    waits = []
    for _ in range(4):
        start = clock.now
        while not reprobe.due():
            clock.now += 1.0
        waits.append(clock.now - start)
        asyncio.run(reprobe.run())
    assert waits == [10.0, 20.0, 40.0, 80.0] and len(asked) == 4
    assert reprobe.switched and switched == [asked[-1]]
    clock.now += 1e6
    assert not reprobe.due()


def test_reprobe_wait_is_capped():
    reprobe, clock, _, switched = _reprobe([False] * 8)
    for _ in range(8):
        while not reprobe.due():
            clock.now += 1.0
        asyncio.run(reprobe.run())
    last = clock.now
    while not reprobe.due():
        clock.now += 1.0
    assert clock.now - last == 160.0 and not switched


def test_reprobe_is_not_due_while_one_runs():
    clock = Clock()
    gate = asyncio.Event()

    async def scenario():
        async def probe():
            await gate.wait()
            return False

        async def go_direct():
            raise AssertionError("never reached")

        reprobe = joining.Reprobe(probe, go_direct, period_s=1.0, clock=clock)
        clock.now += 1.0
        assert reprobe.due()
        task = asyncio.create_task(reprobe.run())
        await asyncio.sleep(0)
        assert not reprobe.due()
        gate.set()
        assert await task is False
        return reprobe

    reprobe = asyncio.run(scenario())
    clock.now += 2.0
    assert reprobe.due()


def test_an_initial_peer_without_a_record_is_dialled_over_libp2p():
    class Directory:
        initial_peers = REMOTE

        async def record_of(self, peer_id):
            return None

    lookup = joining.contact_lookup(Directory())
    contact = asyncio.run(lookup(BOOT))
    assert contact.reach != "direct" and contact.p2p_addrs == tuple(REMOTE) and contact.address == ""
    assert asyncio.run(lookup("someone-else")) is None


def test_switching_to_direct_keeps_the_record_listed_through_the_restart_then_announces_direct():
    """The daemon's restart skips heartbeats; with a short record_ttl_s (4 s in the tests) a slow
    restart let the record expire and the swarm lost the node (a CI failure): the record is
    refreshed right before the restart, with the usual ttl (the DHT keeps the record that expires
    last, so a longer one would hide the updates after it), and the direct one follows."""
    events = []
    links = SimpleNamespace(reach="relayed", p2p_addrs=[])

    class Directory:
        p2p = object()

        async def restart(self, options):
            events.append(("restart", options))

        async def visible_maddrs(self):
            return ["/ip4/127.0.0.1/tcp/1/p2p/x", "/ip4/198.18.0.11/tcp/31341/p2p/x"]

    async def attach(p2p, port, target):
        events.append(("attach", port))

    async def serve_relay():
        events.append(("serve_relay",))

    async def announce():
        events.append(("announce", links.reach))

    links.attach, links.serve_relay = attach, serve_relay
    cfg = SimpleNamespace()
    server = SimpleNamespace(bridge_port=5, tls_target="t")
    asyncio.run(joining.go_direct(Directory(), links, cfg, server, announce))
    assert events[0] == ("announce", "relayed"), events
    assert events[1] == ("restart", {}), events
    assert events[-1] == ("announce", "direct"), events
    assert links.reach == "direct" and links.p2p_addrs == ["/ip4/198.18.0.11/tcp/31341/p2p/x"]
