"""A swarm of home volunteers only, both behind NAT routers, outlives its bootstrap being down for
30 s: once the bootstrap is back (same identity, same address) it lists both again and stage 0
trains on.

A NAT audit found this swarm stopped for good: the bootstrap is also the homes' relay, and behind
NAT the libp2p daemon reconnects to it by itself, so the heartbeat, which pinged only the initial
peers it was not connected to, never pinged it again. The restarted bootstrap's routing table never
learnt the stage-1 volunteer, whose record was then stored nowhere anyone looked: every node said
stage 1 had no replica, and nothing trained until the volunteer was restarted by hand.
"""

import signal
import time
from pathlib import Path

import pytest

from .netns_topology import NatTopology, unavailable_reason
from .test_nat import _Procs, _setup, _wait_file

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
NO_NAT = unavailable_reason()
OUTAGE_S = 30.0


def _steps_by_peer(procs: _Procs, config: Path, maddr: str) -> dict[str, tuple[int, int]]:
    """peer id -> (stage, inner step), as `status` through the bootstrap lists them."""
    try:
        return {p: (r["stage"], r["inner_step"]) for p, r in procs.status(config, maddr).items()}
    except ValueError:  # no JSON: the bootstrap is not answering yet
        return {}


def _wait_for(what: str, check, timeout_s: float, poll_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(poll_s)
    return found


@pytest.mark.skipif(NO_NAT is not None, reason=f"no NAT topology here: {NO_NAT}")
def test_a_nat_only_swarm_trains_on_after_its_bootstrap_was_down_30_s(tmp_path):
    config, logs = _setup(
        tmp_path, **{"outer.method": "noloco", "outer.inner_steps_per_outer": 4, "inner.total_steps": 100_000}
    )
    with NatTopology() as topo:
        procs = _Procs(topo, logs)
        boot = procs.start_bootstrap(config, tmp_path)
        maddr = _wait_file(tmp_path / "maddr", boot, logs / "bootstrap.log", 60)["text"].split()[0]
        common = ["--config", str(config), "--initial-peers", maddr]
        home1 = procs.start(
            topo.homes[0], "home1", "join", *common, "--stage", "1", "--ready-file", str(tmp_path / "home1.json")
        )
        one = _wait_file(tmp_path / "home1.json", home1, logs / "home1.log", 180)
        home2 = procs.start(
            topo.homes[1], "home2", "join", *common, "--stage", "0", "--ready-file", str(tmp_path / "home2.json")
        )
        two = _wait_file(tmp_path / "home2.json", home2, logs / "home2.log", 180)
        homes = {one["peer_id"]: 1, two["peer_id"]: 0}
        before = _wait_for(
            "stage 0 to train 4 steps",
            lambda: (s := _steps_by_peer(procs, config, maddr)).get(two["peer_id"], (0, 0))[1] >= 4 and s,
            120,
        )
        print("\nbefore the outage:", before)

        boot.send_signal(signal.SIGINT)
        boot.wait(timeout=30)
        time.sleep(OUTAGE_S)
        stopped_at = time.monotonic()
        boot = procs.start_bootstrap(config, tmp_path, "bootstrap-again")
        assert _wait_file(tmp_path / "maddr", boot, logs / "bootstrap-again.log", 60)["text"].split()[0] == maddr

        # Both homes listed by the restarted bootstrap, and stage 0 past where it stood before the outage.
        after = _wait_for(
            "both homes listed again and stage 0 training on",
            lambda: (
                (s := _steps_by_peer(procs, config, maddr))
                and all(s.get(p, (None,))[0] == stage for p, stage in homes.items())
                and s[two["peer_id"]][1] >= before[two["peer_id"]][1] + 8
                and s
            ),
            150,
        )
        print(f"after the outage, {time.monotonic() - stopped_at:.0f} s after the bootstrap came back:", after)
        for proc in (home1, home2, boot):
            proc.send_signal(signal.SIGINT)
        for proc in (home1, home2, boot):
            proc.wait(timeout=60)
