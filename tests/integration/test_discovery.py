"""Discovery over a real hivemind DHT on 127.0.0.1: signed, schema-validated stage records;
records of another run, manifest or version are ignored and logged; the bootstrap peer keeps its
identity across restarts."""

import logging
import os
import subprocess
import sys
import time

from pathlib import Path

import pytest
from hivemind.p2p import p2p_daemon
from hivemind.utils.timed_storage import get_dht_time

from noloco_node.dht.directory import DirectoryIdentity, PeerDirectory
from noloco_node.dht.records import StageRecord, stage_key
from noloco_node.errors import BootstrapError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
IDENTITY = DirectoryIdentity(run_id="run-a", manifest_hash="m1", version="0.1.0", num_stages=2)


def record(peer_id, *, stage=1, run_id="run-a", manifest="m1", version="0.1.0", status="serving"):
    return StageRecord(
        peer_id=peer_id,
        address=f"127.0.0.1:{1000 + len(peer_id)}",
        stage=stage,
        inner_step=3,
        outer_round=0,
        status=status,
        tokens_per_s=1.5,
        version=version,
        manifest_hash=manifest,
        run_id=run_id,
        updated_at=time.time(),
    )


@pytest.fixture
async def directories():
    started = []

    async def start(identity=IDENTITY, initial_peers=None):
        peers = initial_peers if initial_peers is not None else (await started[0].visible_maddrs() if started else [])
        directory = await PeerDirectory.start(identity, initial_peers=peers, startup_timeout_s=20)
        started.append(directory)
        return directory

    yield start
    for directory in started:
        await directory.shutdown()


async def test_announce_and_lookup_filters_foreign_records(directories, caplog):
    a = await directories()
    b = await directories()
    c = await directories(DirectoryIdentity("run-a", "other-manifest", "0.1.0", 2))
    d = await directories(DirectoryIdentity("run-a", "m1", "0.9.0", 2))
    assert await b.announce(record(b.peer_id), ttl_s=30)
    assert await c.announce(record(c.peer_id, manifest="other-manifest"), ttl_s=30)
    assert await d.announce(record(d.peer_id, version="0.9.0"), ttl_s=30)
    with caplog.at_level(logging.WARNING, logger="noloco_node.dht.directory"):
        found = await a.replicas(1, fresh=True)
    assert [r.peer_id for r in found] == [b.peer_id]
    assert "manifest other-manifest" in caplog.text and "version 0.9.0" in caplog.text
    # A leaving record hides the peer.
    assert await b.announce(record(b.peer_id, status="leaving"), ttl_s=30)
    assert await a.replicas(1, fresh=True) == []


async def test_records_are_signed_and_schema_checked(directories):
    a = await directories()
    b = await directories()
    key = stage_key("run-a", 1)
    expires = get_dht_time() + 30
    # Schema: a non-strict type is refused by every validating node.
    bad = record(b.peer_id).dict()
    bad["inner_step"] = "3"
    assert not await b.node.store(key, subkey=b.signer.local_public_key, value=bad, expiration_time=expires)
    # Signature: b cannot write under a's subkey (a's public key), so it cannot change a's record.
    assert await a.announce(record(a.peer_id), ttl_s=30)
    forged = record("mallory").dict()
    assert not await b.node.store(key, subkey=a.signer.local_public_key, value=forged, expiration_time=expires)
    found = await b.replicas(1, fresh=True)
    assert [r.peer_id for r in found] == [a.peer_id]
    # Identity: b may store under its own subkey, but a record there that claims a's peer id (to
    # divert a's traffic to b's address or certificate) is refused by every reader.
    impostor = record(a.peer_id).copy(update={"address": "127.0.0.1:6666"})
    assert await b.announce(impostor, ttl_s=30)
    seen = await a.replicas(1, fresh=True)
    assert [(r.peer_id, r.address) for r in seen] == [(a.peer_id, record(a.peer_id).address)]
    assert a.impostor_records >= 1
    # Keys outside the run's stage keys are stored unchecked (hivemind's averager keeps its
    # matchmaking records there for the DiLoCo baseline); nothing of ours reads them.
    assert await b.node.store(
        "averager_matchmaking_key", subkey=b.signer.local_public_key, value={"anything": 1}, expiration_time=expires
    )
    assert [r.peer_id for r in await b.replicas(1, fresh=True)] == [a.peer_id]


async def test_unreachable_bootstrap_fails_fast_with_a_fix(monkeypatch):
    # The daemon's socket files are named from this draw: known here, so the test can look for them.
    uid = f"noloco-test-{os.getpid()}"
    monkeypatch.setattr(p2p_daemon.secrets, "token_urlsafe", lambda n: uid)
    start = time.monotonic()
    with pytest.raises(BootstrapError) as info:
        await PeerDirectory.start(
            IDENTITY,
            initial_peers=["/ip4/127.0.0.1/tcp/9/p2p/12D3KooWC9iPeg5yx8MPKDydmEzZbFyDDQL3AanYS6yEd9h7uLMW"],
            startup_timeout_s=10,
        )
    assert time.monotonic() - start < 15
    assert "initial peers" in str(info.value) and "multiaddr" in info.value.hint
    # The daemon that failed is gone and waited for, and its sockets with it (hivemind left both).
    assert not any(Path(f"/tmp/hivemind-{kind}-{uid}.sock").exists() for kind in ("p2pd", "p2pclient"))
    assert subprocess.run(["pgrep", "-f", uid], capture_output=True).returncode == 1


def test_bootstrap_identity_is_persistent(tmp_path):
    peer_ids = []
    for _ in range(2):
        maddr_file = tmp_path / "maddr"
        maddr_file.unlink(missing_ok=True)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "noloco_node",
                "bootstrap",
                "--port",
                "0",
                "--identity",
                str(tmp_path / "id.key"),
                "--maddr-file",
                str(maddr_file),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 60
            while not maddr_file.exists():
                assert proc.poll() is None and time.monotonic() < deadline, "bootstrap peer did not start"
                time.sleep(0.05)
            peer_ids.append(maddr_file.read_text().split()[0].rsplit("/p2p/", 1)[1])
        finally:
            proc.terminate()
            out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "noloco-node join --initial-peers /ip4/127.0.0.1/tcp/" in out
    assert peer_ids[0] == peer_ids[1]
