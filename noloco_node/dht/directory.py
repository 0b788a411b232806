"""PeerDirectory: a hivemind DHTNode in the node's own event loop that announces this node's
stage record on a heartbeat and answers "which replicas of stage s are alive?".

Records of another run, manifest or protocol version, or filed under another stage's key, are
ignored and logged once per peer. A record whose `peer_id` is not the one its signing key proves
(the key in its subkey hashes to another peer id) is refused and counted: a node speaks only for
itself. Lookups are cached for `cache_s` so routing does not hit the DHT per microbatch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator
from hivemind.utils.timed_storage import get_dht_time

from noloco_node.dht.daemon import join_dht, peers_by_id, ping_peers
from noloco_node.dht.other_configs import OtherConfigs
from noloco_node.errors import BootstrapError
from noloco_node.dht.records import StageRecord, make_validators, stage_key
from noloco_node.runtime.node_status import Status
from noloco_node.transport.identity import NodeIdentity, peer_id_of_owner_marker

log = logging.getLogger(__name__)


def compatible_version(ours: str, theirs: str) -> bool:
    """Same major.minor: the wire contract only changes across minor versions."""
    return ours.split(".")[:2] == theirs.split(".")[:2]


@dataclass(frozen=True)
class DirectoryIdentity:
    run_id: str
    manifest_hash: str
    version: str
    num_stages: int


class PeerDirectory:
    def __init__(
        self,
        node: DHTNode,
        identity: DirectoryIdentity,
        signer: RSASignatureValidator,
        *,
        key: NodeIdentity,
        cache_s: float = 1.0,
    ) -> None:
        self.node, self.identity, self.signer, self.key = node, identity, signer, key
        self.cache_s = cache_s
        self._cache: dict[int, tuple[float, list[StageRecord]]] = {}
        self._seen: dict[int, dict[object, tuple[float, object]]] = {}  # stage -> subkey -> (expires, value)
        self._ignored: set[str] = set()  # peers whose incompatible records were logged once
        self.other_configs = OtherConfigs()  # peers of our run with another manifest
        self._impostors: set[str] = set()  # claimed peer ids whose impostor records were logged once
        self.impostor_records = 0  # records refused because they claim another node's peer id
        self._by_peer: dict[str, tuple[float, StageRecord]] = {}  # every accepted record, leaving ones too
        self.peer_id = node.peer_id.to_base58()
        self._restarting = False
        self._start_args: dict = {"initial_peers": []}
        assert self.peer_id == key.peer_id, "the DHT must run under the node's own identity key"

    @property
    def p2p(self):
        """The libp2p daemon this directory runs on (the libp2p transport shares it)."""
        return self.node.p2p

    @classmethod
    async def start(
        cls,
        identity: DirectoryIdentity,
        *,
        initial_peers: list[str],
        host: str = "127.0.0.1",
        port: int = 0,
        identity_path: str | None = None,
        startup_timeout_s: float = 30.0,
        client_mode: bool = False,
        swarm_key: bytes | None = None,
        max_skew_s: float = 60.0,
        key: NodeIdentity | None = None,
        p2p_options: dict | None = None,
        alone_if_unanswered: bool = False,
    ) -> PeerDirectory:
        """Start the DHT node under `key` (the node's identity: its libp2p key and record-signing key
        at once); raises BootstrapError with a fix when the initial peers cannot be reached, or,
        with `alone_if_unanswered` (a bootstrap, whose initial peers are the other bootstraps),
        starts alone and links to them when they answer (keep_in_touch). Our own multiaddr among
        the initial peers is left out (one config file shared by every peer of a host lists it).
        `p2p_options` go to hivemind.P2P.create (relay and reachability settings)."""
        if key is None:
            key = NodeIdentity.load_or_create(identity_path) if identity_path else NodeIdentity.generate()
        signer = RSASignatureValidator(key.hivemind_key())
        validator = CompositeValidator(make_validators(identity.run_id, identity.num_stages, signer))
        initial_peers = [m for m in initial_peers if m.rpartition("/p2p/")[2] != key.peer_id]
        start_args = dict(
            initial_peers=initial_peers,
            host=host,
            port=port,
            startup_timeout_s=startup_timeout_s,
            client_mode=client_mode,
            swarm_key=swarm_key,
            max_skew_s=max_skew_s,
            key=key,
        )
        try:
            node, p2p = await join_dht(start_args, validator, p2p_options)
        except BootstrapError as exc:
            if not (alone_if_unanswered and initial_peers):
                raise
            log.warning("%s; starting alone, and linking to them when they answer", exc)
            node, p2p = await join_dht(start_args | {"initial_peers": []}, validator, p2p_options)
        directory = cls(node, identity, signer, key=key)
        directory._own_p2p, directory._start_args = p2p, start_args
        return directory

    @property
    def restarting(self) -> bool:
        """Whether the DHT node (and its libp2p daemon) is being restarted right now."""
        return self._restarting

    @property
    def initial_peers(self) -> list[str]:
        """The multiaddrs this directory bootstrapped from."""
        return list(self._start_args["initial_peers"])

    async def restart(self, p2p_options: dict) -> None:
        """Start the DHT node again under the same identity with other libp2p settings (behind NAT:
        a private peer with relays; public again once a peer reached us), in place, so everything
        holding this directory keeps working. Meanwhile (a node may restart while it trains)
        lookups answer from the cache and announcements wait for the next heartbeat."""
        self._restarting = True
        try:
            await self.shutdown()
            fresh = await PeerDirectory.start(self.identity, **self._start_args, p2p_options=p2p_options)
            self.node, self.signer, self._own_p2p = fresh.node, fresh.signer, fresh._own_p2p
            self._cache.clear()
        finally:
            self._restarting = False

    async def visible_maddrs(self) -> list[str]:
        return [str(m) for m in await self.node.get_visible_maddrs()]

    async def announce(self, record: StageRecord, ttl_s: float) -> bool:
        """Store our record under our own signed subkey for ttl_s seconds."""
        if self._restarting:
            return False
        return await self.node.store(
            stage_key(self.identity.run_id, record.stage),
            subkey=self.signer.local_public_key,
            value=record.dict(),
            expiration_time=get_dht_time() + ttl_s,
        )

    async def replicas(self, stage: int, *, fresh: bool = False) -> list[StageRecord]:
        """Live, compatible replicas of `stage` (ours included), sorted by peer id. A joiner's claim
        (status joining, pipeline/stage_choice.py) is not a replica yet: it serves nothing."""
        now = time.monotonic()
        cached = self._cache.get(stage)
        if cached is not None and (self._restarting or not fresh and now - cached[0] < self.cache_s):
            return cached[1]
        if self._restarting:
            return []
        records = []
        for subkey, value in await self._entries(stage):
            if (record := self._accept(value, stage, subkey)) is None:
                continue
            known = self._by_peer.get(record.peer_id)
            # A node that moved between stages has a newer record under its new stage's key than
            # its leaving one under the old key: keep the newest (its address now).
            if known is None or known[1].updated_at <= record.updated_at:
                self._by_peer[record.peer_id] = (now, record)
            if record.status not in (Status.LEAVING, Status.JOINING):
                records.append(record)
        records.sort(key=lambda r: r.peer_id)
        self._cache[stage] = (now, records)
        return records

    async def replica_capacities(self) -> list[list[float]]:
        """Each stage's live replicas' measured capacities (0 = not measured yet)."""
        return [[r.capacity for r in await self.replicas(s, fresh=True)] for s in range(self.identity.num_stages)]

    async def claims(self) -> list[StageRecord]:
        """Every stage's compatible joining records: joiners that claimed a stage and are settling."""
        return [r for r in await self.compatible_records() if r.status == Status.JOINING]

    async def compatible_records(self) -> list[StageRecord]:
        """Every stage's compatible records, whatever their status (joining and leaving too); none
        while the DHT node restarts."""
        out = []
        if self._restarting:
            return out
        for stage in range(self.identity.num_stages):
            for subkey, value in await self._entries(stage):
                if (record := self._accept(value, stage, subkey)) is not None:
                    out.append(record)
        return out

    async def all_records(self, stage: int) -> list[StageRecord]:
        """Every well-formed record of `stage` under its key, of any run or config (for `status`)."""
        records = []
        for subkey, value in await self._entries(stage):
            try:
                record = StageRecord.parse_obj(value)
            except Exception:  # noqa: BLE001 - malformed values are skipped
                continue
            if self._proven(record, subkey) and record.stage == stage:
                records.append(record)
        return sorted(records, key=lambda r: r.peer_id)

    async def _entries(self, stage: int) -> list[tuple[object, object]]:
        """(subkey, value) of each unexpired entry under `stage`'s key, unparsed: what this lookup
        found, and what earlier lookups found that it did not. A lookup under load can miss a
        subkey (an RPC to the peer holding it timed out); a record is live until its expiration
        time, so one partial answer must not make a replica vanish (a round then thought itself
        alone in its stage and its partner fell a round behind)."""
        found = await self.node.get(stage_key(self.identity.run_id, stage), latest=True)
        fresh = {}
        if found is not None and isinstance(found.value, dict):
            for subkey, entry in found.value.items():
                try:
                    fresh[subkey] = (entry.expiration_time, entry.value)
                except TypeError:  # an unhashable subkey: no owner marker, so no record of anyone's
                    continue
        known = self._seen.setdefault(stage, {})
        now = get_dht_time()
        for subkey in [k for k, (expires, _) in known.items() if expires < now]:
            del known[subkey]
        for subkey, (expires, value) in fresh.items():
            if subkey not in known or known[subkey][0] <= expires:
                known[subkey] = (expires, value)
        if len(known) > 4096:  # a flood of records: remember none beyond what this lookup found
            known.clear()
            known.update(fresh)
        return [(subkey, value) for subkey, (_, value) in known.items()]

    def _proven(self, record: StageRecord, subkey: object) -> bool:
        """Whether the key that signed the record (hivemind checked the signature against the
        subkey) proves the peer id the record claims; refused and counted if not."""
        if peer_id_of_owner_marker(subkey) == record.peer_id:
            return True
        self.impostor_records += 1
        if record.peer_id not in self._impostors and len(self._impostors) < 4096:
            self._impostors.add(record.peer_id)
            log.warning("refusing a record that claims peer id %s but is signed by another key", record.peer_id[-8:])
        return False

    @property
    def other_config_peers(self) -> dict[str, str]:
        """Peers of our run seen live with another manifest (dht/other_configs.py)."""
        return self.other_configs.peers()

    def _accept(self, value: object, stage: int, subkey: object) -> StageRecord | None:
        try:
            record = StageRecord.parse_obj(value)
        except Exception:  # noqa: BLE001 - any malformed value is skipped, never fatal
            return None
        if not self._proven(record, subkey):
            return None
        ident = self.identity
        reason = None
        if record.run_id != ident.run_id:
            reason = f"run {record.run_id!r}"
        elif record.manifest_hash != ident.manifest_hash:
            reason = f"manifest {record.manifest_hash} (ours {ident.manifest_hash})"
            self.other_configs.found(record)
        elif not compatible_version(ident.version, record.version):
            reason = f"version {record.version} (ours {ident.version})"
        elif record.stage != stage:
            reason = f"stage {record.stage} under the key of stage {stage}"
        if reason is not None:
            if record.peer_id not in self._ignored:  # status and doctor (no manifest of ours) judge peers themselves
                self._ignored.add(record.peer_id)
                log.log(
                    logging.WARNING if ident.manifest_hash else logging.DEBUG,
                    "ignoring peer %s: %s",
                    record.peer_id[-8:],
                    reason,
                )
            return None
        return record

    async def record_of(self, peer_id: str, max_age_s: float = 5.0) -> StageRecord | None:
        """The latest record of `peer_id` that can be dialled (a leaving one too: it still drains),
        from the lookups of the last `max_age_s`, else from a fresh lookup of every stage. A
        joiner's claim (no address: seen, a stage-1 node failed every backward to a new replica
        dialled by it) and a leaving record (its peer may be back at a new address, a recopy) are
        always looked up afresh."""
        known = self._by_peer.get(peer_id)
        cached = known is not None and known[1].status not in (Status.JOINING, Status.LEAVING)
        if cached and time.monotonic() - known[0] < max_age_s:
            return known[1]
        for stage in range(self.identity.num_stages):
            await self.replicas(stage, fresh=True)
        known = self._by_peer.get(peer_id)
        if known is None or known[1].status == Status.JOINING:
            return None
        if len(self._by_peer) > 4096:  # forget peers not seen for a long while
            cutoff = time.monotonic() - 600
            self._by_peer = {p: v for p, v in self._by_peer.items() if v[0] > cutoff}
        return known[1]

    def saw_address(self, peer_id: str, address: str) -> None:
        """Forget a cached record of `peer_id` at another address than its own signed call gave (a
        recopy's new port: its first gradients went to the old one, lost: 60 s waited, an audit)."""
        if address and (known := self._by_peer.get(peer_id)) is not None and known[1].address != address:
            del self._by_peer[peer_id]

    async def keep_in_touch(self, timeout_s: float = 3.0, max_met: int = 8) -> int:
        """Dial and ping the initial peers again; if none answers, up to `max_met` peers met through
        their records. A restarted bootstrap has forgotten everyone: the ping puts each of us in the
        other's routing table again, so it re-learns the swarm, and a node still finds the swarm
        after every bootstrap is gone. Called on every heartbeat; returns how many answered."""
        if self._restarting:
            return 0
        # Only peers we are not connected to are dialled, but every one is pinged: a connection says
        # nothing of the DHT. Behind NAT the libp2p daemon reconnects to a restarted bootstrap (its
        # relay) by itself; skipping the ping then left a node out of that bootstrap's routing table,
        # and the bootstrap out of its own, for good (an audit's NAT-only swarm never trained again).
        try:
            connected = {info.peer_id.to_base58() for info in await self.p2p.list_peers()}
        except Exception as exc:  # noqa: BLE001 - the daemon is restarting or stopping: next heartbeat
            log.debug("could not list libp2p peers: %r", exc)
            return 0
        answered = await ping_peers(
            self.p2p, self.node, peers_by_id(self.initial_peers, self.peer_id), timeout_s, connected
        )
        if answered == 0:
            met = {
                r.peer_id: r.p2p_addrs
                for _, r in sorted(self._by_peer.values(), key=lambda v: -v[0])
                if r.peer_id != self.peer_id and r.status != Status.LEAVING
            }
            addrs = [
                a if "/p2p/" in a else f"{a}/p2p/{peer}"
                for peer, found in list(met.items())[:max_met]
                for a in found
                if "p2p-circuit" not in a
            ]
            answered = await ping_peers(self.p2p, self.node, peers_by_id(addrs, self.peer_id), timeout_s, connected)
        return answered

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the DHT node, then its libp2p daemon. A Ctrl-C in a terminal or systemd's stop reaches
        the daemon too (it is in our process group and cgroup), and once it has exited, hivemind's
        DHTNode.shutdown waits forever on its socket: so it runs only until the daemon is gone, at
        most `timeout_s`."""
        child = getattr(self._own_p2p, "_child", None)
        stopping = asyncio.ensure_future(self.node.shutdown())  # does not stop a P2P it was handed
        # hivemind's shutdown leaves the node's cache refresh task pending; collected later (after a
        # relayed node's DHT restart), asyncio logged "Task was destroyed but it is pending!" as an ERROR.
        refreshing = getattr(self.node, "cache_refresh_task", None)
        if refreshing is not None and not refreshing.done():
            refreshing.cancel()
        watched = {stopping}
        if child is not None:
            watched.add(asyncio.ensure_future(child.wait()))
        done, pending = await asyncio.wait(watched, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if stopping in done and stopping.exception() is not None:
            log.debug("DHT node shutdown: %r", stopping.exception())
        elif stopping not in done:
            log.debug("the libp2p daemon went first; DHT node stopped without it")
        try:
            await asyncio.wait_for(self._own_p2p.shutdown(), timeout=timeout_s)
        except asyncio.TimeoutError:
            log.warning("the libp2p daemon did not exit in %.0f s; killing it", timeout_s)
            if child is not None and child.returncode is None:
                child.kill()
