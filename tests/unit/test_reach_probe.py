"""The reach probe asks again, with a longer deadline, when no prober answered at all: on a loaded
machine a probe that timed out everywhere must not read as "nobody to ask" (which lets an
unreachable address through as direct)."""

import asyncio
from types import SimpleNamespace

from noloco_node.node import joining
from noloco_node.rpc import diagnostics


class Replicas:
    async def replicas(self, stage, fresh=False):
        return [SimpleNamespace(peer_id=f"peer{stage}{i}", reach="direct") for i in range(2)]


def _probe(monkeypatch, answers):
    calls = []

    async def fake(address, probers, *, run_id, timeout_s, dialer, tls_cert=b"", wanted=2):
        calls.append(timeout_s)
        return answers[len(calls) - 1]
    monkeypatch.setattr(diagnostics, "probe_from_peers", fake)
    result = asyncio.run(joining.probe_reachable(Replicas(), None, address="127.0.0.1:9", tls_cert=b"", peer_id="me",
                                                 num_stages=2, run_id="r", timeout_s=5.0))
    return result, calls


def test_unanswered_probe_is_asked_again_with_a_longer_deadline(monkeypatch):
    refused = diagnostics.ProbeResult(prober="peer00", reachable=False, detail="refused", skew_s=0.0, version="v",
                                      manifest_hash="m")
    result, calls = _probe(monkeypatch, [([], ["peer00: DEADLINE_EXCEEDED"]), ([refused], [])])
    assert result is False and calls == [5.0, 10.0]


def test_probe_gives_up_after_two_attempts(monkeypatch):
    result, calls = _probe(monkeypatch, [([], ["x: DEADLINE_EXCEEDED"]), ([], ["x: DEADLINE_EXCEEDED"])])
    assert result is None and calls == [5.0, 10.0]


def test_an_answer_first_time_is_not_asked_again(monkeypatch):
    ok = diagnostics.ProbeResult(prober="peer00", reachable=True, detail="ok", skew_s=0.0, version="v", manifest_hash="m")
    result, calls = _probe(monkeypatch, [([ok], [])])
    assert result is True and calls == [5.0]
