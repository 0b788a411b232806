from noloco_node.wire.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StateEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_ENCODING_DENSE: _ClassVar[StateEncoding]
    STATE_ENCODING_COMPACT: _ClassVar[StateEncoding]
    STATE_ENCODING_TOP_UP: _ClassVar[StateEncoding]
STATE_ENCODING_DENSE: StateEncoding
STATE_ENCODING_COMPACT: StateEncoding
STATE_ENCODING_TOP_UP: StateEncoding

class PairRequest(_message.Message):
    __slots__ = ("run", "stage", "round", "inner_step", "peer_id", "nonce", "send_slow_weights", "codec")
    RUN_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SEND_SLOW_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    run: _tensor_pb2.RunIdentity
    stage: int
    round: int
    inner_step: int
    peer_id: str
    nonce: bytes
    send_slow_weights: bool
    codec: _tensor_pb2.Codec
    def __init__(self, run: _Optional[_Union[_tensor_pb2.RunIdentity, _Mapping]] = ..., stage: _Optional[int] = ..., round: _Optional[int] = ..., inner_step: _Optional[int] = ..., peer_id: _Optional[str] = ..., nonce: _Optional[bytes] = ..., send_slow_weights: _Optional[bool] = ..., codec: _Optional[_Union[_tensor_pb2.Codec, str]] = ...) -> None: ...

class PairReply(_message.Message):
    __slots__ = ("decision", "wait_s", "reason", "peer_id")
    class Decision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        DECISION_UNSPECIFIED: _ClassVar[PairReply.Decision]
        ACCEPT: _ClassVar[PairReply.Decision]
        BUSY: _ClassVar[PairReply.Decision]
        WAIT: _ClassVar[PairReply.Decision]
        MISMATCH: _ClassVar[PairReply.Decision]
    DECISION_UNSPECIFIED: PairReply.Decision
    ACCEPT: PairReply.Decision
    BUSY: PairReply.Decision
    WAIT: PairReply.Decision
    MISMATCH: PairReply.Decision
    DECISION_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    decision: PairReply.Decision
    wait_s: float
    reason: str
    peer_id: str
    def __init__(self, decision: _Optional[_Union[PairReply.Decision, str]] = ..., wait_s: _Optional[float] = ..., reason: _Optional[str] = ..., peer_id: _Optional[str] = ...) -> None: ...

class SnapshotManifest(_message.Message):
    __slots__ = ("num_tensors", "payload_bytes")
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_tensors: int
    payload_bytes: int
    def __init__(self, num_tensors: _Optional[int] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class Receipt(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: bytes
    def __init__(self, sha256: _Optional[bytes] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ExchangeMessage(_message.Message):
    __slots__ = ("request", "reply", "manifest", "tensor", "chunk", "receipt", "abort")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    request: PairRequest
    reply: PairReply
    manifest: SnapshotManifest
    tensor: _tensor_pb2.TensorHeader
    chunk: _tensor_pb2.TensorChunk
    receipt: Receipt
    abort: Abort
    def __init__(self, request: _Optional[_Union[PairRequest, _Mapping]] = ..., reply: _Optional[_Union[PairReply, _Mapping]] = ..., manifest: _Optional[_Union[SnapshotManifest, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., receipt: _Optional[_Union[Receipt, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ...) -> None: ...

class FetchStateRequest(_message.Message):
    __slots__ = ("run", "stage", "peer_id", "names", "encoding")
    RUN_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    run: _tensor_pb2.RunIdentity
    stage: int
    peer_id: str
    names: _containers.RepeatedScalarFieldContainer[str]
    encoding: StateEncoding
    def __init__(self, run: _Optional[_Union[_tensor_pb2.RunIdentity, _Mapping]] = ..., stage: _Optional[int] = ..., peer_id: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ..., encoding: _Optional[_Union[StateEncoding, str]] = ...) -> None: ...

class StateManifest(_message.Message):
    __slots__ = ("inner_step", "outer_round", "num_tensors", "payload_bytes", "counters_json")
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    OUTER_ROUND_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_JSON_FIELD_NUMBER: _ClassVar[int]
    inner_step: int
    outer_round: int
    num_tensors: int
    payload_bytes: int
    counters_json: str
    def __init__(self, inner_step: _Optional[int] = ..., outer_round: _Optional[int] = ..., num_tensors: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., counters_json: _Optional[str] = ...) -> None: ...

class StateMessage(_message.Message):
    __slots__ = ("manifest", "tensor", "chunk")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    manifest: StateManifest
    tensor: _tensor_pb2.TensorHeader
    chunk: _tensor_pb2.TensorChunk
    def __init__(self, manifest: _Optional[_Union[StateManifest, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...
