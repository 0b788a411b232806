"""What a PeerDirectory answers from the DHT's lookups: a lookup under load can miss an entry, and a
replica whose record has not expired must not vanish because of it."""

import asyncio
import time
from types import SimpleNamespace

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.timed_storage import get_dht_time

from noloco_node.dht.directory import DirectoryIdentity, PeerDirectory
from noloco_node.dht.records import StageRecord
from noloco_node.transport.identity import NodeIdentity

IDENTITY = DirectoryIdentity(run_id="lookups", manifest_hash="m" * 16, version="0.2.0", num_stages=2)


class ScriptedDHT:
    """A DHTNode whose lookups answer what the test put in `entries` (subkey -> (value, expires))."""

    def __init__(self, me: NodeIdentity) -> None:
        self.peer_id = SimpleNamespace(to_base58=lambda: me.peer_id)
        self.entries: dict[bytes, tuple[dict, float]] = {}

    async def get(self, key, latest: bool = False):
        assert latest, "replica lookups must ask for the latest values"
        if not self.entries:
            return None
        value = {k: SimpleNamespace(value=v, expiration_time=e) for k, (v, e) in self.entries.items()}
        return SimpleNamespace(value=value, expiration_time=max(e for _, e in self.entries.values()))


def record(identity: NodeIdentity, **fields) -> tuple[bytes, dict]:
    values = dict(
        peer_id=identity.peer_id,
        address="127.0.0.1:4000",
        stage=0,
        inner_step=4,
        outer_round=2,
        status="serving",
        tokens_per_s=10.0,
        version=IDENTITY.version,
        manifest_hash=IDENTITY.manifest_hash,
        run_id=IDENTITY.run_id,
        updated_at=1000.0,
        capacity=1.0,
        tls_cert="AAAA",
    )
    values.update(fields)
    subkey = RSASignatureValidator(identity.hivemind_key()).local_public_key
    return subkey, StageRecord(**values).dict()


def test_a_lookup_that_misses_an_unexpired_record_still_lists_that_replica_until_it_expires():
    me, fellow = NodeIdentity.generate(), NodeIdentity.generate()
    dht = ScriptedDHT(me)
    directory = PeerDirectory(dht, IDENTITY, RSASignatureValidator(me.hivemind_key()), key=me)
    mine, theirs = record(me), record(fellow, status="matching")
    now = get_dht_time()

    async def lookup() -> list[str]:
        return [r.peer_id for r in await directory.replicas(0, fresh=True)]

    dht.entries = {mine[0]: (mine[1], now + 30), theirs[0]: (theirs[1], now + 30)}
    assert asyncio.run(lookup()) == sorted([me.peer_id, fellow.peer_id])
    dht.entries = {mine[0]: (mine[1], now + 30)}  # the next lookup misses the fellow's entry
    assert asyncio.run(lookup()) == sorted([me.peer_id, fellow.peer_id])

    newer = record(fellow, status="serving", outer_round=3, updated_at=1001.0)
    dht.entries = {newer[0]: (newer[1], now + 40)}  # a later value of the same entry replaces it
    [fellows_record] = [r for r in asyncio.run(directory.replicas(0, fresh=True)) if r.peer_id == fellow.peer_id]
    assert (fellows_record.status, fellows_record.outer_round) == ("serving", 3)

    brief = NodeIdentity.generate()
    briefs = record(brief)
    dht.entries = {briefs[0]: (briefs[1], get_dht_time() + 0.5)}
    assert brief.peer_id in asyncio.run(lookup())
    dht.entries = {mine[0]: (mine[1], now + 30)}
    time.sleep(0.6)  # past its expiration time: gone, though no lookup saw it go
    assert asyncio.run(lookup()) == sorted([me.peer_id, fellow.peer_id])


def test_a_replica_that_announced_it_leaves_stays_gone_when_a_later_lookup_misses_its_entry():
    me, fellow = NodeIdentity.generate(), NodeIdentity.generate()
    dht = ScriptedDHT(me)
    directory = PeerDirectory(dht, IDENTITY, RSASignatureValidator(me.hivemind_key()), key=me)
    now = get_dht_time()
    serving, leaving = record(fellow), record(fellow, status="leaving", updated_at=1001.0)
    dht.entries = {serving[0]: (serving[1], now + 30)}
    asyncio.run(directory.replicas(0, fresh=True))
    dht.entries = {leaving[0]: (leaving[1], now + 30)}  # it announced it leaves: the same entry, newer
    assert asyncio.run(directory.replicas(0, fresh=True)) == []
    dht.entries = {}  # a lookup that finds nothing at all keeps what it knew: the leaving record
    assert asyncio.run(directory.replicas(0, fresh=True)) == []


def test_a_joiners_claim_is_never_the_record_it_is_dialled_by():
    me, joiner = NodeIdentity.generate(), NodeIdentity.generate()
    dht = ScriptedDHT(me)
    directory = PeerDirectory(dht, IDENTITY, RSASignatureValidator(me.hivemind_key()), key=me)
    claim = record(joiner, status="joining", address="", tls_cert="", inner_step=0, updated_at=1000.0)
    now = get_dht_time()
    dht.entries = {claim[0]: (claim[1], now + 30)}
    asyncio.run(directory.replicas(0, fresh=True))  # a routine lookup sees the claim: not a replica
    assert asyncio.run(directory.record_of(joiner.peer_id)) is None  # nothing to dial yet
    serving = record(joiner, status="serving", updated_at=1002.0)
    dht.entries = {serving[0]: (serving[1], now + 40)}  # it announced itself once it served
    found = asyncio.run(directory.record_of(joiner.peer_id))  # the cached claim is looked past at once
    assert found is not None and found.status == "serving" and found.tls_cert == "AAAA"


def test_a_peer_that_left_is_looked_up_afresh_and_found_back_at_its_new_address():
    """A node that copies its own stage's state again leaves and is back within a second or two
    under the same peer id at a new address: a leaving record seen a moment ago is not reused (a
    stage-1 node sent the returning node's first backwards to its old port, refused)."""
    me, mover = NodeIdentity.generate(), NodeIdentity.generate()
    dht = ScriptedDHT(me)
    directory = PeerDirectory(dht, IDENTITY, RSASignatureValidator(me.hivemind_key()), key=me)
    now = get_dht_time()
    leaving = record(mover, status="leaving", address="127.0.0.1:1111", updated_at=1000.0)
    dht.entries = {leaving[0]: (leaving[1], now + 30)}
    found = asyncio.run(directory.record_of(mover.peer_id))  # it still drains: dialled where it was
    assert found is not None and found.address == "127.0.0.1:1111"
    back = record(mover, status="serving", address="127.0.0.1:2222", updated_at=1001.0)
    dht.entries = {back[0]: (back[1], now + 31)}
    found = asyncio.run(directory.record_of(mover.peer_id))
    assert found is not None and (found.status, found.address) == ("serving", "127.0.0.1:2222")


def test_a_peer_of_another_config_stops_counting_once_it_leaves_or_is_no_longer_found():
    """Seen by a newcomer: a node warned of 'peer(s) of this run use another config' 90 s after the
    one such peer had stopped, and in its closing summary."""
    me, stranger, other = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()
    dht = ScriptedDHT(me)
    directory = PeerDirectory(dht, IDENTITY, RSASignatureValidator(me.hivemind_key()), key=me)
    now = get_dht_time()
    theirs = record(stranger, manifest_hash="another")
    leaving = record(stranger, manifest_hash="another", status="leaving", updated_at=1001.0)
    dht.entries = {theirs[0]: (theirs[1], now + 30)}
    asyncio.run(directory.replicas(0, fresh=True))
    assert directory.other_config_peers == {stranger.peer_id: "another"}
    dht.entries = {leaving[0]: (leaving[1], now + 31)}
    asyncio.run(directory.replicas(0, fresh=True))
    assert directory.other_config_peers == {}
    gone = record(other, manifest_hash="third")
    dht.entries = {gone[0]: (gone[1], now + 30)}
    asyncio.run(directory.replicas(0, fresh=True))
    assert directory.other_config_peers == {other.peer_id: "third"}
    assert directory.other_configs.peers(seen_s=-1.0) == {}  # time has passed: not found since
    assert directory.other_config_peers == {}


def test_a_signed_call_from_a_new_address_makes_the_next_record_lookup_fresh():
    """A replica that left and came back under its peer id (a recopy) serves at a new port: the
    record cached from before (up to 5 s) would send its first gradients to the old one."""
    me, fellow = NodeIdentity.generate(), NodeIdentity.generate()
    dht = ScriptedDHT(me)
    directory = PeerDirectory(dht, IDENTITY, RSASignatureValidator(me.hivemind_key()), key=me)
    old, new = record(fellow, address="127.0.0.1:4000"), record(fellow, address="127.0.0.1:4999", updated_at=1001.0)
    dht.entries = {old[0]: (old[1], get_dht_time() + 30)}
    assert asyncio.run(directory.record_of(fellow.peer_id)).address == "127.0.0.1:4000"
    dht.entries = {new[0]: (new[1], get_dht_time() + 30)}  # it is back, announced at the new port
    assert asyncio.run(directory.record_of(fellow.peer_id)).address == "127.0.0.1:4000"  # cached
    directory.saw_address(fellow.peer_id, "127.0.0.1:4000")  # the same address: the cache stays
    assert asyncio.run(directory.record_of(fellow.peer_id)).address == "127.0.0.1:4000"
    directory.saw_address(fellow.peer_id, "127.0.0.1:4999")
    assert asyncio.run(directory.record_of(fellow.peer_id)).address == "127.0.0.1:4999"
