"""The stage record every node publishes, and the validators that guard it.

Key `noloco_{run_id}_stage_{s}` (hivemind's SchemaValidator prefix + field), subkey = the
writer's RSA public-key marker, so hivemind's RSASignatureValidator lets a peer write only its own
subkey; the value is schema-validated with strict types before any node stores it.
"""

from __future__ import annotations

import re
import time
from typing import Dict, Optional

import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator

from noloco_node.runtime.node_status import Status

REACHES = ("direct", "holepunched", "relayed")

CLOCK_AHEAD_S = 600.0
"""How far past the reader's clock a record's `updated_at` may lie: honest clocks differ by seconds
(a signed call allows 60 s), and a time further on would read as "seen just now" for ever."""


class StageRecord(pydantic.BaseModel):
    """What a node announces about itself (docs/architecture.md, Discovery)."""

    peer_id: pydantic.StrictStr
    address: pydantic.StrictStr
    stage: pydantic.conint(strict=True, ge=0)
    inner_step: pydantic.conint(strict=True, ge=0)
    outer_round: pydantic.conint(strict=True, ge=0)
    status: pydantic.StrictStr
    tokens_per_s: pydantic.confloat(strict=True, ge=0.0)
    version: pydantic.constr(strict=True, max_length=64)
    manifest_hash: pydantic.StrictStr
    run_id: pydantic.StrictStr
    updated_at: pydantic.confloat(strict=True, ge=0.0)
    """The writer's clock (Unix seconds) when it wrote the record; at most CLOCK_AHEAD_S past the reader's."""
    reach: pydantic.StrictStr = "direct"
    """How peers reach this node: `direct` (TLS gRPC at `address`), `holepunched` or `relayed`
    (gRPC over a libp2p stream to `peer_id`, dialled through `p2p_addrs`)."""
    tls_cert: pydantic.constr(strict=True, max_length=4096) = ""
    """The node's self-signed TLS certificate (DER, base64): clients pin it."""
    p2p_addrs: pydantic.conlist(pydantic.constr(strict=True, max_length=512), max_items=16) = []
    """libp2p multiaddrs that reach the node (a /p2p-circuit address through its relay when relayed)."""
    capacity: pydantic.confloat(strict=True, ge=0.0, le=1e9) = 0.0
    """Measured sequences per second of compute time (runtime/throughput.py); 0 = not measured yet."""
    throughput: pydantic.confloat(strict=True, ge=0.0, le=1e9) = 0.0
    """Measured sequences per wall-clock second."""
    busy: pydantic.confloat(strict=True, ge=0.0, le=1.0) = 0.0
    """Microbatches in flight / the in-flight window."""
    hop_s: pydantic.confloat(strict=True, ge=0.0, le=1e6) = 0.0
    """Seconds per Forward call to the next stage."""
    link_mbit_s: pydantic.confloat(strict=True, ge=0.0, le=1e9) = 0.0
    """Median bandwidth the node measured to its peers, in Mbit/s (runtime/link_estimates.py); 0 =
    not measured yet (and in records from nodes that predate the field)."""
    memory_estimate_bytes: pydantic.conint(strict=True, ge=0, le=1 << 50) = 0
    """The node's estimate of its stage's peak training memory where it computes (model/memory.py:
    host RAM on CPU, device memory on a GPU); 0 = not given (records that predate the field)."""
    memory_peak_bytes: pydantic.conint(strict=True, ge=0, le=1 << 50) = 0
    """The most the stage has used so far, measured the same way: the process's peak RSS on CPU,
    torch.cuda.max_memory_allocated on a GPU, less what the process held before building it."""
    outer_round_bytes: pydantic.conint(strict=True, ge=0, le=1 << 50) = 0
    """Payload bytes this node sent in its last outer round (its snapshot, one way; what
    outer.codec_phi and outer.codec_delta make of the stage); 0 = no round yet."""
    movable: pydantic.StrictBool = False
    """Whether the node may move to another stage when rebalancing (pipeline/rebalance.py)."""
    moved_at: pydantic.confloat(strict=True, ge=0.0) = 0.0
    """Unix time of the node's last move between stages; 0 = never moved."""
    move_claimed_at: pydantic.confloat(strict=True, ge=0.0) = 0.0
    """Unix time the node claimed a rebalancing move it is about to make (pipeline/rebalance.py);
    0 = none. Everyone else's plan waits while a claim is in the DHT."""
    loss: Optional[pydantic.confloat(strict=True, ge=0.0, le=1e6)] = None
    """Stage 0: the training loss of the last microbatch this replica drove through the pipeline
    (computed at the last stage, returned with its gradients); None elsewhere or before the first."""
    attention: pydantic.conlist(pydantic.constr(strict=True, max_length=200), max_items=4) = []
    """What needs a person's attention at this node, in words with the likely cause (node/attention.py):
    outer rounds going solo, no progress for a long while; [] when all is well."""

    class Config:
        extra = pydantic.Extra.forbid

    @pydantic.validator("status", pre=True)
    def _plain_status(cls, value):
        # A Status member is stored (and sent) as its plain string: StrictStr refuses Enum members.
        return value.value if isinstance(value, Status) else value

    @pydantic.validator("status")
    def _known_status(cls, value: str) -> str:
        if value not in tuple(Status):
            raise ValueError(f"unknown status {value!r}")
        return value

    @pydantic.validator("updated_at")
    def _not_far_ahead(cls, value: float) -> float:
        if not value <= time.time() + CLOCK_AHEAD_S:
            raise ValueError(f"updated_at {value!r} is more than {CLOCK_AHEAD_S:.0f} s past this clock")
        return value

    @pydantic.validator("reach")
    def _known_reach(cls, value: str) -> str:
        if value not in REACHES:
            raise ValueError(f"unknown reach {value!r}")
        return value


def key_prefix(run_id: str) -> str:
    return "noloco_" + re.sub(r"[^A-Za-z0-9_]", "_", run_id)


def stage_key(run_id: str, stage: int) -> str:
    return f"{key_prefix(run_id)}_stage_{stage}"


def make_validators(run_id: str, num_stages: int, signer: RSASignatureValidator) -> list:
    """Signature validator (own subkey only) + schema validator for this run's stage keys."""
    fields = {f"stage_{s}": (Optional[Dict[BytesWithPublicKey, StageRecord]], None) for s in range(num_stages)}
    schema = pydantic.create_model(f"RunSchema_{num_stages}", **fields)
    # Other keys (hivemind averager matchmaking for the DiLoCo baseline) are allowed; ours are checked.
    return [signer, SchemaValidator(schema, allow_extra_keys=True, prefix=key_prefix(run_id))]
