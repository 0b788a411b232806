from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ProbeRequest(_message.Message):
    __slots__ = ("run_id", "address", "tls_cert")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TLS_CERT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    address: str
    tls_cert: bytes
    def __init__(self, run_id: _Optional[str] = ..., address: _Optional[str] = ..., tls_cert: _Optional[bytes] = ...) -> None: ...

class ProbeReply(_message.Message):
    __slots__ = ("reachable", "detail", "rtt_s", "server_time", "version", "manifest_hash")
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_HASH_FIELD_NUMBER: _ClassVar[int]
    reachable: bool
    detail: str
    rtt_s: float
    server_time: float
    version: str
    manifest_hash: str
    def __init__(self, reachable: _Optional[bool] = ..., detail: _Optional[str] = ..., rtt_s: _Optional[float] = ..., server_time: _Optional[float] = ..., version: _Optional[str] = ..., manifest_hash: _Optional[str] = ...) -> None: ...
