"""PeerDirectory: a hivemind DHTNode in the node's own event loop that announces this node's
stage record on a heartbeat and answers "which replicas of stage s are alive?".

Records of another run, manifest or protocol version are ignored and logged once per peer.
Lookups are cached for `cache_s` so routing does not hit the DHT per microbatch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator
from hivemind.p2p import P2PDaemonError
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from noloco_node.dht.records import StageRecord, make_validators, stage_key
from noloco_node.errors import BootstrapError

log = logging.getLogger(__name__)


def compatible_version(ours: str, theirs: str) -> bool:
    """Same major.minor: the wire contract only changes across minor versions."""
    return ours.split(".")[:2] == theirs.split(".")[:2]


def least_served_stage(replica_counts: list[int]) -> int:
    """`join --stage auto`: the stage with the fewest live replicas; ties go to the lowest index."""
    return min(range(len(replica_counts)), key=lambda s: (replica_counts[s], s))


@dataclass(frozen=True)
class DirectoryIdentity:
    run_id: str
    manifest_hash: str
    version: str
    num_stages: int


class PeerDirectory:
    def __init__(self, node: DHTNode, identity: DirectoryIdentity, signer: RSASignatureValidator, *,
                 cache_s: float = 1.0) -> None:
        self.node, self.identity, self.signer = node, identity, signer
        self.cache_s = cache_s
        self._cache: dict[int, tuple[float, list[StageRecord]]] = {}
        self._ignored: set[str] = set()
        self.peer_id = node.peer_id.to_base58()

    @classmethod
    async def start(cls, identity: DirectoryIdentity, *, initial_peers: list[str], host: str = "127.0.0.1",
                    port: int = 0, identity_path: str | None = None, startup_timeout_s: float = 30.0,
                    client_mode: bool = False, swarm_key: bytes | None = None, max_skew_s: float = 60.0) -> PeerDirectory:
        """Start the DHT node; raises BootstrapError with a fix when the initial peers cannot be reached."""
        # Own key per directory (not hivemind's process-wide one): the subkey is this node's identity.
        signer = RSASignatureValidator(RSAPrivateKey())
        validator = CompositeValidator(make_validators(identity.run_id, identity.num_stages, signer))
        authorizer = None
        if swarm_key is not None:
            from noloco_node.dht.auth import SwarmKeyAuthorizer

            authorizer = SwarmKeyAuthorizer(swarm_key, max_skew_s=max_skew_s)
        try:
            node = await asyncio.wait_for(DHTNode.create(
                initial_peers=list(initial_peers), host_maddrs=[f"/ip4/{host}/tcp/{port}"], identity_path=identity_path,
                record_validator=validator, client_mode=client_mode, startup_timeout=startup_timeout_s,
                authorizer=authorizer,
            ), timeout=startup_timeout_s + 5)
        except (P2PDaemonError, asyncio.TimeoutError, OSError, RuntimeError) as exc:
            # hivemind raises RuntimeError when no initial peer answered a ping: they are down,
            # unreachable, or (in a keyed swarm) ignoring us because our swarm key differs.
            where = ", ".join(initial_peers) or "(none)"
            hint = "" if swarm_key is not None else " (if the swarm uses a key, pass it with --swarm-key)"
            raise BootstrapError(f"could not join the DHT through initial peers {where}: {exc}{hint}".strip()) from None
        return cls(node, identity, signer)

    async def visible_maddrs(self) -> list[str]:
        return [str(m) for m in await self.node.get_visible_maddrs()]

    async def announce(self, record: StageRecord, ttl_s: float) -> bool:
        """Store our record under our own signed subkey for ttl_s seconds."""
        return await self.node.store(stage_key(self.identity.run_id, record.stage), subkey=self.signer.local_public_key,
                                     value=record.dict(), expiration_time=get_dht_time() + ttl_s)

    async def replicas(self, stage: int, *, fresh: bool = False) -> list[StageRecord]:
        """Live, compatible replicas of `stage` (ours included), sorted by peer id."""
        now = time.monotonic()
        cached = self._cache.get(stage)
        if cached is not None and not fresh and now - cached[0] < self.cache_s:
            return cached[1]
        found = await self.node.get(stage_key(self.identity.run_id, stage), latest=True)
        records = []
        if found is not None and isinstance(found.value, dict):
            for entry in found.value.values():
                record = self._accept(entry.value, stage)
                if record is not None:
                    records.append(record)
        records.sort(key=lambda r: r.peer_id)
        self._cache[stage] = (now, records)
        return records

    async def replica_counts(self) -> list[int]:
        return [len(await self.replicas(s, fresh=True)) for s in range(self.identity.num_stages)]

    async def all_records(self, stage: int) -> list[StageRecord]:
        """Every well-formed record under `stage`'s key, unfiltered (for `noloco-node status`)."""
        found = await self.node.get(stage_key(self.identity.run_id, stage), latest=True)
        records = []
        if found is not None and isinstance(found.value, dict):
            for entry in found.value.values():
                try:
                    records.append(StageRecord.parse_obj(entry.value))
                except Exception:  # noqa: BLE001 - malformed values are skipped
                    continue
        return sorted(records, key=lambda r: r.peer_id)

    def _accept(self, value: object, stage: int) -> StageRecord | None:
        try:
            record = StageRecord.parse_obj(value)
        except Exception:  # noqa: BLE001 - any malformed value is skipped, never fatal
            return None
        ident = self.identity
        reason = None
        if record.run_id != ident.run_id:
            reason = f"run {record.run_id!r}"
        elif record.manifest_hash != ident.manifest_hash:
            reason = f"manifest {record.manifest_hash} (ours {ident.manifest_hash})"
        elif not compatible_version(ident.version, record.version):
            reason = f"version {record.version} (ours {ident.version})"
        elif record.stage != stage:
            reason = f"stage {record.stage} under the key of stage {stage}"
        if reason is not None:
            if record.peer_id not in self._ignored:
                self._ignored.add(record.peer_id)
                log.warning("ignoring peer %s: %s", record.peer_id[-8:], reason)
            return None
        if record.status == "leaving":
            return None
        return record

    async def shutdown(self) -> None:
        await self.node.shutdown()
