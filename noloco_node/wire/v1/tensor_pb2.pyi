from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_NONE: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_INT8_BLOCKWISE: _ClassVar[Codec]
    CODEC_TOPK: _ClassVar[Codec]
    CODEC_FP8_E4M3_BLOCKWISE: _ClassVar[Codec]
    CODEC_INT4_BLOCKWISE: _ClassVar[Codec]
    CODEC_TOPK_INT2: _ClassVar[Codec]
    CODEC_TOPK_INT4: _ClassVar[Codec]
    CODEC_SLICE: _ClassVar[Codec]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
CODEC_UNSPECIFIED: Codec
CODEC_NONE: Codec
CODEC_BF16: Codec
CODEC_INT8_BLOCKWISE: Codec
CODEC_TOPK: Codec
CODEC_FP8_E4M3_BLOCKWISE: Codec
CODEC_INT4_BLOCKWISE: Codec
CODEC_TOPK_INT2: Codec
CODEC_TOPK_INT4: Codec
CODEC_SLICE: Codec
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT64: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
DTYPE_INT64: DType

class TensorHeader(_message.Message):
    __slots__ = ("name", "dtype", "shape", "codec", "block_size", "payload_bytes", "nnz", "slice_seed", "slice_parts", "slice_part")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    NNZ_FIELD_NUMBER: _ClassVar[int]
    SLICE_SEED_FIELD_NUMBER: _ClassVar[int]
    SLICE_PARTS_FIELD_NUMBER: _ClassVar[int]
    SLICE_PART_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: Codec
    block_size: int
    payload_bytes: int
    nnz: int
    slice_seed: int
    slice_parts: int
    slice_part: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., codec: _Optional[_Union[Codec, str]] = ..., block_size: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., nnz: _Optional[int] = ..., slice_seed: _Optional[int] = ..., slice_parts: _Optional[int] = ..., slice_part: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("index", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class RunIdentity(_message.Message):
    __slots__ = ("run_id", "manifest_hash")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_HASH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    manifest_hash: str
    def __init__(self, run_id: _Optional[str] = ..., manifest_hash: _Optional[str] = ...) -> None: ...
