from noloco_node.wire.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Hop(_message.Message):
    __slots__ = ("peer_id", "address", "stage")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    address: str
    stage: int
    def __init__(self, peer_id: _Optional[str] = ..., address: _Optional[str] = ..., stage: _Optional[int] = ...) -> None: ...

class MicrobatchId(_message.Message):
    __slots__ = ("origin_peer", "sequence", "attempt")
    ORIGIN_PEER_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    origin_peer: str
    sequence: int
    attempt: int
    def __init__(self, origin_peer: _Optional[str] = ..., sequence: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class ForwardHeader(_message.Message):
    __slots__ = ("run", "microbatch", "route", "activations", "labels", "target_stage", "token_ids")
    RUN_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    TARGET_STAGE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    run: _tensor_pb2.RunIdentity
    microbatch: MicrobatchId
    route: _containers.RepeatedCompositeFieldContainer[Hop]
    activations: _tensor_pb2.TensorHeader
    labels: _containers.RepeatedScalarFieldContainer[int]
    target_stage: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, run: _Optional[_Union[_tensor_pb2.RunIdentity, _Mapping]] = ..., microbatch: _Optional[_Union[MicrobatchId, _Mapping]] = ..., route: _Optional[_Iterable[_Union[Hop, _Mapping]]] = ..., activations: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., labels: _Optional[_Iterable[int]] = ..., target_stage: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ForwardMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ForwardHeader
    chunk: _tensor_pb2.TensorChunk
    def __init__(self, header: _Optional[_Union[ForwardHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class BackwardHeader(_message.Message):
    __slots__ = ("run", "microbatch", "grad", "loss", "num_tokens", "target_stage")
    RUN_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    GRAD_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_STAGE_FIELD_NUMBER: _ClassVar[int]
    run: _tensor_pb2.RunIdentity
    microbatch: MicrobatchId
    grad: _tensor_pb2.TensorHeader
    loss: float
    num_tokens: int
    target_stage: int
    def __init__(self, run: _Optional[_Union[_tensor_pb2.RunIdentity, _Mapping]] = ..., microbatch: _Optional[_Union[MicrobatchId, _Mapping]] = ..., grad: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., loss: _Optional[float] = ..., num_tokens: _Optional[int] = ..., target_stage: _Optional[int] = ...) -> None: ...

class BackwardMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: BackwardHeader
    chunk: _tensor_pb2.TensorChunk
    def __init__(self, header: _Optional[_Union[BackwardHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class StageAck(_message.Message):
    __slots__ = ("bytes_received",)
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    bytes_received: int
    def __init__(self, bytes_received: _Optional[int] = ...) -> None: ...
