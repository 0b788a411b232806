"""Random and mutated messages for every RPC of a node, sent as raw bytes (so a mutation can
break the protobuf itself). Each case is one call (a replayed token: two); `Fuzzer.run` collects
the status codes seen.

The fuzzer is a set of peers: it speaks TLS to the node, pinning the certificate the node
published, and signs each call with one identity of a small pre-generated pool (in turn), so the
messages reach the parsers. Messages that name their sender (a Forward's last hop, a PairRequest's
or FetchStateRequest's peer id) name the identity that signs the call, except in the cases that
test exactly that claim. The bad-token cases: missing, wrong swarm key, stale time, a token for
another method, for another server (audience), a replayed token, garbage."""

from __future__ import annotations

import collections
import math
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from noloco_node.rpc.tensors import encode_tensor, iter_chunks
from noloco_node.transport.credentials import AUTH_HEADER, KEY_HEADER
from noloco_node.wire.v1 import diag_pb2, outer_pb2, stage_pb2, tensor_pb2

from .clients import IdentityPool, secure_channel, signed

FORWARD, BACKWARD = "/noloco.wire.v1.Stage/Forward", "/noloco.wire.v1.Stage/Backward"
EXCHANGE, FETCH, PROBE = (
    "/noloco.wire.v1.Outer/Exchange",
    "/noloco.wire.v1.Outer/FetchState",
    "/noloco.wire.v1.Diagnostics/Probe",
)
EXPECTED = {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAUTHENTICATED", "FAILED_PRECONDITION"}
KINDS = {
    FORWARD: "stream_unary",
    BACKWARD: "stream_unary",
    EXCHANGE: "stream_stream",
    FETCH: "unary_stream",
    PROBE: "unary_unary",
}


TOKEN_CASES = ["missing", "wrong key", "stale", "other method", "other server", "replayed", "garbage"]


class Fuzzer:
    """`info`: the target node's ready JSON (address, peer_id, tls_cert, run_id, manifest_hash).
    `key`: the swarm key (the bad-token cases assume a keyed swarm: in an open one an unsigned
    Probe is allowed, and there is no key to get wrong). `other_server`: a peer id that is not the
    target's, for tokens made for another server and for claims naming another peer."""

    def __init__(
        self,
        *,
        info: dict,
        key: bytes | None,
        identities: IdentityPool,
        other_server: str,
        stage: int,
        hidden: int,
        seq: int,
        seed: int = 0,
    ) -> None:
        self.info, self.key, self.identities, self.other_server = info, key, identities, other_server
        self.stage, self.hidden, self.seq = stage, hidden, seq
        self.run_identity = tensor_pb2.RunIdentity(run_id=info["run_id"], manifest_hash=info["manifest_hash"])
        self.rng = random.Random(seed)
        self.codes: collections.Counter = collections.Counter()
        self.by_case: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.sent = 0
        self.odd: list[tuple[str, str, str]] = []  # (case, code, details) of answers outside the expected codes

    # -- helpers ---------------------------------------------------------------------------
    def _tensor(self, batch: int = 1) -> torch.Tensor:
        return torch.randn(batch, self.seq, self.hidden) * 0.1

    def _forward(
        self, me: str, tensor=None, *, run=None, labels=None, target=None
    ) -> tuple[stage_pb2.ForwardHeader, list]:
        tensor = self._tensor() if tensor is None else tensor
        header, payload = encode_tensor(tensor, self.rng.choice(["none", "bf16"]))
        fwd = stage_pb2.ForwardHeader(
            run=run or self.run_identity,
            microbatch=stage_pb2.MicrobatchId(origin_peer="fuzz", sequence=self.rng.randrange(1 << 40)),
            route=[stage_pb2.Hop(peer_id=me, address="127.0.0.1:9", stage=self.stage - 1)],
            activations=header,
            labels=labels if labels is not None else [1] * (tensor.shape[0] * tensor.shape[1]),
            target_stage=self.stage if target is None else target,
        )
        return fwd, list(iter_chunks(payload, chunk_bytes=self.rng.choice([256, 1024, 4096])))

    def _mutate_bytes(self, data: bytes) -> bytes:
        data = bytearray(data)
        for _ in range(self.rng.randint(1, 8)):
            if not data:
                break
            op = self.rng.random()
            i = self.rng.randrange(len(data))
            if op < 0.5:
                data[i] = self.rng.randrange(256)
            elif op < 0.75:
                del data[i : i + self.rng.randint(1, 16)]
            else:
                data[i:i] = os.urandom(self.rng.randint(1, 16))
        return bytes(data)

    def _flip_keeping_route(self, data: bytes) -> bytes:
        """A mutated header that, if it still parses, still names 127.0.0.1 only: the node sends
        the gradient back to the route's last hop (by its peer id, found through the DHT, where no
        fuzz identity is), but a header must never name an address off this machine."""
        for _ in range(20):
            mutated = self._mutate_bytes(data)
            try:
                parsed = stage_pb2.ForwardMessage.FromString(mutated)
            except Exception:  # noqa: BLE001 - undecodable is what we want
                return mutated
            if all(hop.address == "127.0.0.1:9" for hop in parsed.header.route):
                return mutated
        return os.urandom(len(data))

    # -- cases: each takes the peer id of the identity that will sign the call and returns
    # -- (case name, method, request bytes or list of bytes) ---------------------------------
    def case_random_bytes(self, me: str):
        method = self.rng.choice(list(KINDS))
        blobs = [os.urandom(self.rng.randint(0, 512)) for _ in range(self.rng.randint(1, 4))]
        return "random bytes", method, blobs if KINDS[method].startswith("stream") else blobs[0]

    def case_forward(self, me: str):
        fwd, chunks = self._forward(me)
        mutation = self.rng.choice(
            [
                "huge shape",
                "negative shape",
                "many dims",
                "huge declared size",
                "bad dtype",
                "bad codec",
                "truncated",
                "reordered",
                "duplicate chunk",
                "bad chunk index",
                "nan",
                "inf",
                "labels out of vocab",
                "labels count",
                "wrong stage",
                "wrong run",
                "no header",
                "two headers",
                "flipped header bytes",
                "extra bytes",
                "huge batch",
                "oversize header",
                "route names another peer",
            ]
        )
        a = fwd.activations
        if mutation == "huge shape":
            a.shape[:] = [1, 1 << 40, self.hidden]
        elif mutation == "negative shape":
            a.shape[1] = -self.seq
        elif mutation == "many dims":
            a.shape[:] = [1] * 64
        elif mutation == "huge declared size":
            a.payload_bytes = 1 << 62
        elif mutation == "bad dtype":
            a.dtype = self.rng.choice([0, 5, 6, 99])
        elif mutation == "bad codec":
            a.codec = self.rng.choice([0, 3, 77])
        elif mutation == "truncated" and chunks:
            chunks[-1] = tensor_pb2.TensorChunk(
                index=chunks[-1].index, data=chunks[-1].data[: len(chunks[-1].data) // 2]
            )
        elif mutation == "reordered" and len(chunks) > 1:
            chunks[0], chunks[1] = chunks[1], chunks[0]
        elif mutation == "duplicate chunk":
            chunks.append(chunks[-1])
        elif mutation == "bad chunk index":
            chunks[0] = tensor_pb2.TensorChunk(index=7, data=chunks[0].data)
        elif mutation in ("nan", "inf"):
            values = self._tensor()
            values[0, 0, 0] = math.nan if mutation == "nan" else math.inf
            fwd, chunks = self._forward(me, values)
        elif mutation == "labels out of vocab":
            fwd.labels[:] = [10**9] * len(fwd.labels)
        elif mutation == "labels count":
            fwd.labels[:] = [1] * self.rng.choice([0, 1, 10**5])
        elif mutation == "wrong stage":
            fwd.target_stage = self.stage + 5
        elif mutation == "wrong run":
            fwd.run.CopyFrom(tensor_pb2.RunIdentity(run_id="other", manifest_hash="0" * 16))
        elif mutation == "oversize header":
            fwd.labels[:] = [10**12] * 300_000  # ~2 MB of header: over the node's 1 MiB header limit
        elif mutation == "huge batch":
            fwd.activations.shape[0] = 1 << 20
        elif mutation == "route names another peer":  # the caller claims to forward for someone else
            fwd.route[-1].peer_id = self.other_server
        messages = [stage_pb2.ForwardMessage(header=fwd).SerializeToString()]
        if mutation == "no header":
            messages = []
        elif mutation == "two headers":
            messages.append(messages[0])
        elif mutation == "flipped header bytes":
            messages[0] = self._flip_keeping_route(messages[0])
        messages += [stage_pb2.ForwardMessage(chunk=c).SerializeToString() for c in chunks]
        if mutation == "extra bytes":
            messages.append(os.urandom(100))
        return f"forward: {mutation}", FORWARD, messages

    def case_backward(self, me: str):
        header, payload = encode_tensor(self._tensor(), "none")
        back = stage_pb2.BackwardHeader(
            run=self.run_identity,
            microbatch=stage_pb2.MicrobatchId(origin_peer="fuzz", sequence=self.rng.randrange(99)),
            grad=header,
            loss=self.rng.choice([1.0, math.nan, math.inf, -1e300]),
            num_tokens=self.rng.choice([0, 16, 1 << 60]),
            target_stage=self.stage,
        )
        mutation = self.rng.choice(
            ["unknown microbatch", "huge declared size", "wrong run", "flipped bytes", "no payload"]
        )
        if mutation == "huge declared size":
            back.grad.payload_bytes = 1 << 50
        elif mutation == "wrong run":
            back.run.run_id = "x" * 300
        messages = [stage_pb2.BackwardMessage(header=back).SerializeToString()]
        if mutation == "flipped bytes":
            messages[0] = self._mutate_bytes(messages[0])
        if mutation != "no payload":
            messages += [stage_pb2.BackwardMessage(chunk=c).SerializeToString() for c in iter_chunks(payload)]
        return f"backward: {mutation}", BACKWARD, messages

    def case_exchange(self, me: str):
        request = outer_pb2.PairRequest(
            run=self.run_identity,
            stage=self.stage,
            round=self.rng.randrange(1 << 20),
            inner_step=self.rng.randrange(1 << 20),
            peer_id=me,
            nonce=os.urandom(8),
            codec=self.rng.choice([0, 1, 2, 3, 9]),
        )
        mutation = self.rng.choice(
            [
                "wrong run",
                "wrong stage",
                "no request first",
                "flipped bytes",
                "garbage after",
                "huge manifest",
                "claims another peer",
            ]
        )
        if mutation == "claims another peer":
            request.peer_id = self.other_server
        elif mutation == "wrong run":
            request.run.manifest_hash = "f" * 16
        elif mutation == "wrong stage":
            request.stage = self.stage + 3
        messages = [outer_pb2.ExchangeMessage(request=request).SerializeToString()]
        if mutation == "no request first":
            messages = [outer_pb2.ExchangeMessage(receipt=outer_pb2.Receipt(sha256=os.urandom(32))).SerializeToString()]
        elif mutation == "flipped bytes":
            messages[0] = self._mutate_bytes(messages[0])
        elif mutation == "garbage after":
            messages += [os.urandom(64) for _ in range(3)]
        elif mutation == "huge manifest":
            messages.append(
                outer_pb2.ExchangeMessage(
                    manifest=outer_pb2.SnapshotManifest(num_tensors=1 << 30, payload_bytes=1 << 62)
                ).SerializeToString()
            )
        return f"exchange: {mutation}", EXCHANGE, messages

    def case_fetch_state(self, me: str):
        mutation = self.rng.choice(["wrong run", "wrong stage", "flipped bytes", "claims another peer"])
        request = outer_pb2.FetchStateRequest(run=self.run_identity, stage=self.stage, peer_id=me)
        if mutation == "claims another peer":
            request.peer_id = self.other_server
        elif mutation == "wrong run":
            request.run.run_id = "nope"
        elif mutation == "wrong stage":
            request.stage = 1000
        data = request.SerializeToString()
        if mutation == "flipped bytes":
            data = self._mutate_bytes(data)
        return f"fetch state: {mutation}", FETCH, data

    def case_probe(self, me: str):
        # Only addresses that are not host:port, or loopback ones: the node dials what it is given.
        address = self.rng.choice(
            ["", "nonsense", "127.0.0.1:0", "127.0.0.1:99999", ":80", "x" * 1000, "127.0.0.1:-1", "[::1]", "127.0.0.1"]
        )
        mutation = self.rng.choice(["bad address", "wrong run"])
        request = diag_pb2.ProbeRequest(
            run_id=self.run_identity.run_id if mutation == "bad address" else "other", address=address
        )
        return f"probe: {mutation}", PROBE, request.SerializeToString()

    def case_bad_token(self, me: str):
        _, method, payload = self.rng.choice([self.case_forward, self.case_probe, self.case_fetch_state])(me)
        return "token: " + self.rng.choice(TOKEN_CASES), method, payload

    # -- sending ------------------------------------------------------------------------------
    def _metadata(self, case: str, method: str, identity):
        """The metadata of one call, made at call time (tokens carry the time and are one-time)."""
        info, key = self.info, self.key
        if case == "token: missing":
            return ()
        if case == "token: wrong key":
            return signed(identity, method, info, key=b"w" * 32)
        if case == "token: stale":
            return signed(identity, method, info, key=key, now=1.0)
        if case == "token: other method":
            return signed(identity, PROBE if method != PROBE else FORWARD, info, key=key)
        if case == "token: other server":
            return signed(identity, method, self.other_server, key=key)
        if case == "token: garbage":
            return [(AUTH_HEADER, os.urandom(12).hex()), (KEY_HEADER, os.urandom(32).hex())]
        return signed(identity, method, info, key=key)

    def call(self, channel: grpc.Channel, case: str, method: str, payload, identity) -> grpc.StatusCode:
        # The sync API: grpc.aio's client reports INTERNAL "Internal error from Core" instead of
        # the server's status when the server ends a client-streaming call before the client
        # finished writing (grpc/grpc#36066), which is exactly what a node does to bad input.
        kind = KINDS[method]
        stub = getattr(channel, kind)(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        metadata = self._metadata(case, method, identity)
        if case == "token: replayed":  # a valid token, used once (whatever that call earns), then again
            self._send(stub, kind, payload, metadata)
        return self._send(stub, kind, payload, metadata, case)

    def _send(self, stub, kind: str, payload, metadata, case: str | None = None) -> grpc.StatusCode:
        try:
            if kind in ("stream_unary", "stream_stream"):
                result = stub(iter(payload), timeout=15, metadata=metadata)
            else:
                result = stub(payload, timeout=15, metadata=metadata)
            if kind.endswith("stream"):
                for _ in result:
                    pass
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            if case is not None and exc.code().name not in EXPECTED and len(self.odd) < 50:
                self.odd.append((case, exc.code().name, (exc.details() or "")[:300]))
            return exc.code()

    def next_case(self, me: str):
        return self.rng.choices(
            [
                self.case_random_bytes,
                self.case_forward,
                self.case_backward,
                self.case_exchange,
                self.case_fetch_state,
                self.case_probe,
                self.case_bad_token,
            ],
            weights=[3, 6, 2, 2, 1, 1, 2],
        )[0](me)

    def run(self, count: int, *, concurrency: int = 8) -> None:
        """Send `count` cases, signed in turn by the pool's identities. Real identities are costly
        to make, so they repeat: the node under fuzz is configured with a ban threshold the fuzz
        cannot reach (security.ban_after_invalid), so every case reaches the parsers. Bans are
        tested separately, with one fixed identity against a node with the default threshold."""
        first = self.sent
        identities = [self.identities[first + i] for i in range(count)]
        # Drawn up front (the rng is not thread-safe), each naming the identity that will sign it.
        cases = [self.next_case(identity.peer_id) for identity in identities]

        def one(i: int) -> None:
            case, method, payload = cases[i]
            code = self.call(channel, case, method, payload, identities[i])
            with lock:
                self.codes[code.name] += 1
                self.by_case[case][code.name] += 1
                self.sent += 1

        lock = threading.Lock()
        with secure_channel(self.info) as channel, ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(count)))
