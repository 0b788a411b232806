"""NoLoCo outer rounds between real peer processes over gRPC and the DHT (experiments/outer_peer.py).
The cases are in tests/outer_cases.py and all of them also run in process, in the fast tier; here
run the ones whose subject includes gRPC's streams: V1 exactly in both snapshot forms, lossy codecs
and top-k on the wire, a hostile partner, and a partner that dies mid-stream (processes only)."""

import time

import pytest
import torch

from noloco_node.optim.outer import solo_step
from tests import outer_cases
from tests.outer_cases import A, B, NOLOCO
from tests.outer_peers import ProcessPeers, t

# The shared cases (tests/outer_cases.py), run here over real processes with the `peers` fixture below.
test_gamma_not_beta_reaches_the_oracle = outer_cases.test_gamma_not_beta_reaches_the_oracle
test_hostile_snapshot_rejected_banned_and_solo = outer_cases.test_hostile_snapshot_rejected_banned_and_solo
test_lossy_codecs_give_both_sides_the_math_on_wire_values = (
    outer_cases.test_lossy_codecs_give_both_sides_the_math_on_wire_values
)
test_two_peers_reach_exactly_v1 = outer_cases.test_two_peers_reach_exactly_v1

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture
def peers(tmp_path):
    p = ProcessPeers(tmp_path)
    yield p
    p.stop()


def test_partner_dies_mid_exchange(peers):
    peers.start("honest", A, "--codec", "none", "--match-s", "5")
    peers.start("dying", B, "--codec", "none", "--die-after-writes", "2")
    start = time.monotonic()
    results = peers.run_round()
    assert "dying" not in results  # it exited mid-stream
    honest = results["honest"]
    expected, _ = solo_step(t(A["phi"]), t(A["theta"]), t(A["momentum"]), **NOLOCO)
    assert honest["outcome"] == "solo"
    torch.testing.assert_close(honest["phi"], expected, atol=1e-12, rtol=0)
    assert honest["history"][0]["seconds"] < 5 + 5 + 1  # its deadline (match_s) plus a session's own
    assert time.monotonic() - start < 30
