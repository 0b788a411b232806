"""A swarm with a key: its peers train and exchange as usual; a peer without the key (or with
another key) is refused by every RPC and cannot put records into the swarm's DHT. The intruder
speaks TLS to the node (pinning its published certificate) and signs its calls with an identity
of its own: only the swarm key is missing or wrong."""

import asyncio
import json
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from noloco_node import __version__
from noloco_node.dht.directory import DirectoryIdentity, PeerDirectory
from noloco_node.dht.records import StageRecord
from noloco_node.errors import BootstrapError
from noloco_node.transport.identity import NodeIdentity
from noloco_node.wire.v1 import diag_pb2, outer_pb2, stage_pb2

from .clients import secure_channel, signed
from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# Every method of every noloco service, called the way a client without the key would.
CALLS = {
    "/noloco.wire.v1.Stage/Forward": ("stream_unary", stage_pb2.ForwardMessage(header=stage_pb2.ForwardHeader())),
    "/noloco.wire.v1.Stage/Backward": ("stream_unary", stage_pb2.BackwardMessage(header=stage_pb2.BackwardHeader())),
    "/noloco.wire.v1.Outer/Exchange": ("stream_stream", outer_pb2.ExchangeMessage(request=outer_pb2.PairRequest())),
    "/noloco.wire.v1.Outer/FetchState": ("unary_stream", outer_pb2.FetchStateRequest()),
    "/noloco.wire.v1.Diagnostics/Probe": ("unary_unary", diag_pb2.ProbeRequest(address="127.0.0.1:1")),
}


def call_code(channel: grpc.Channel, method: str, kind: str, message, metadata=None) -> grpc.StatusCode:
    """The status the server answered. The sync client, because grpc.aio's reports INTERNAL
    ("Internal error from Core") when the server ends a streaming call before the client
    finished writing (grpc/grpc#36066), which is what a refusing interceptor does."""
    stub = getattr(channel, kind)(
        method, request_serializer=lambda m: m.SerializeToString(), response_deserializer=None
    )
    try:
        if kind == "stream_unary":
            stub(iter([message]), timeout=10, metadata=metadata)
        elif kind == "unary_unary":
            stub(message, timeout=10, metadata=metadata)
        else:
            for _ in stub(iter([message]) if kind == "stream_stream" else message, timeout=10, metadata=metadata):
                pass
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def test_swarm_key_admits_members_and_refuses_everyone_else(tmp_path, make_swarm):
    key = tmp_path / "swarm.key"
    made = subprocess.run(
        [sys.executable, "-m", "noloco_node", "keygen", "--out", str(key)], capture_output=True, text=True, timeout=60
    )
    assert made.returncode == 0 and key.stat().st_mode & 0o077 == 0, made.stderr
    again = subprocess.run(
        [sys.executable, "-m", "noloco_node", "keygen", "--out", str(key)], capture_output=True, text=True, timeout=60
    )
    assert again.returncode != 0 and "exists" in again.stderr

    steps = 6
    # Balanced routing: both stage-1 replicas get the same share and reach each outer round
    # together, so that they pair is down to the swarm key alone (capacity routing under load
    # could let one run a round ahead of the other in a run this short).
    overrides = tiny_overrides(
        tmp_path,
        **{
            "outer.method": "noloco",
            "outer.inner_steps_per_outer": 2,
            "inner.total_steps": steps,
            "security.swarm_key_file": str(key),
            "run.run_id": "keyed",
            "pipeline.routing": "balanced",
        },
    )
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    servers = [swarm.start_node(1, r) for r in range(2)]
    swarm.wait_ready(servers)
    driver = swarm.start_node(0, 0, "--steps", str(steps))
    swarm.wait_exit([driver], timeout_s=200)
    assert driver.proc.returncode == 0

    sets = [a for o in overrides for a in ("--set", o)]
    listing = subprocess.run(
        [sys.executable, "-m", "noloco_node", "status", "--initial-peers", swarm.maddr, "--json", *sets],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listing.returncode == 0, listing.stderr[-2000:]
    assert {r["peer_id"] for r in json.loads(listing.stdout)["replicas"] if r["stage"] == 1} == {
        n.info["peer_id"] for n in servers
    }

    info = servers[0].info
    address = info["address"]
    intruder = NodeIdentity.generate()

    codes, wrong = {}, {}
    with secure_channel(info) as channel:
        for method, (kind, message) in CALLS.items():
            codes[method] = call_code(channel, method, kind, message)
            wrong[method] = call_code(
                channel, method, kind, message, metadata=signed(intruder, method, info, key=b"w" * 32)
            )
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    unauth = grpc.StatusCode.UNAUTHENTICATED
    assert codes == {m: unauth for m in CALLS}, codes
    assert wrong == {m: unauth for m in CALLS}, wrong
    assert health == health_pb2.HealthCheckResponse.SERVING  # the standard health service stays open

    async def keyless_dht() -> str:
        identity = DirectoryIdentity("keyed", servers[0].info["manifest_hash"], __version__, 2)
        try:
            outsider = await PeerDirectory.start(identity, initial_peers=[swarm.maddr], startup_timeout_s=10)
        except BootstrapError:
            return "refused at bootstrap"
        try:
            record = StageRecord(
                peer_id=outsider.peer_id,
                address="127.0.0.1:1",
                stage=1,
                inner_step=0,
                outer_round=0,
                status="serving",
                tokens_per_s=0.0,
                version=__version__,
                manifest_hash=identity.manifest_hash,
                run_id="keyed",
                updated_at=0.0,
            )
            stored = await outsider.announce(record, ttl_s=60)
            return f"stored={stored}"
        finally:
            await outsider.node.shutdown()

    outcome = asyncio.run(keyless_dht())
    after = subprocess.run(
        [sys.executable, "-m", "noloco_node", "status", "--initial-peers", swarm.maddr, "--json", *sets],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert after.returncode == 0, after.stderr[-2000:]
    members = {r["peer_id"] for r in json.loads(after.stdout)["replicas"] if r["stage"] == 1}
    assert members == {n.info["peer_id"] for n in servers}, f"keyless peer ({outcome}) got a record in: {members}"
    assert outcome == "refused at bootstrap" or outcome == "stored=False", outcome

    keyless = subprocess.run(
        [
            sys.executable,
            "-m",
            "noloco_node",
            "status",
            "--initial-peers",
            swarm.maddr,
            "--json",
            *[a for o in overrides if not o.startswith("security.") for a in ("--set", o)],
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert keyless.returncode == 3 and "could not join the DHT" in keyless.stderr, (
        keyless.returncode,
        keyless.stderr[-800:],
    )

    swarm.stop()
    stats = swarm.node_stats()
    stage1 = [s for s in stats.values() if s["stage"] == 1]
    assert sum(s["outer"]["paired"] for s in stage1) > 0, "keyed replicas must still pair"
    target = next(s for s in stage1 if s["address"] == address)
    assert target["admission"]["swarm_key"] and target["admission"]["refused"]["UNAUTHENTICATED"] == 2 * len(CALLS)
    [driver_stats] = [s for s in stats.values() if s["stage"] == 0]
    mb = driver_stats["microbatches"]
    assert driver_stats["inner_steps"] == steps and mb["issued"] == mb["completed"] and mb["dropped"] == 0
