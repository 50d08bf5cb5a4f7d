from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChunkKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHUNK_KIND_UNSPECIFIED: _ClassVar[ChunkKind]
    CHUNK_KIND_CONTRIBUTION: _ClassVar[ChunkKind]
    CHUNK_KIND_RESULT: _ClassVar[ChunkKind]
CHUNK_KIND_UNSPECIFIED: ChunkKind
CHUNK_KIND_CONTRIBUTION: ChunkKind
CHUNK_KIND_RESULT: ChunkKind

class PushChunksRequest(_message.Message):
    __slots__ = ("generation", "step", "group", "kind", "chunk_index", "num_chunks", "from_site", "total_elements", "num_elements", "codec", "payload", "crc32")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FROM_SITE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    generation: int
    step: int
    group: int
    kind: ChunkKind
    chunk_index: int
    num_chunks: int
    from_site: int
    total_elements: int
    num_elements: int
    codec: str
    payload: bytes
    crc32: int
    def __init__(self, generation: _Optional[int] = ..., step: _Optional[int] = ..., group: _Optional[int] = ..., kind: _Optional[_Union[ChunkKind, str]] = ..., chunk_index: _Optional[int] = ..., num_chunks: _Optional[int] = ..., from_site: _Optional[int] = ..., total_elements: _Optional[int] = ..., num_elements: _Optional[int] = ..., codec: _Optional[str] = ..., payload: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class PushChunksResponse(_message.Message):
    __slots__ = ("accepted", "corrupt")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    corrupt: int
    def __init__(self, accepted: _Optional[int] = ..., corrupt: _Optional[int] = ...) -> None: ...

class ResendChunkRequest(_message.Message):
    __slots__ = ("generation", "step", "group", "kind", "chunk_index", "from_site", "nonce")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    FROM_SITE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    generation: int
    step: int
    group: int
    kind: ChunkKind
    chunk_index: int
    from_site: int
    nonce: bytes
    def __init__(self, generation: _Optional[int] = ..., step: _Optional[int] = ..., group: _Optional[int] = ..., kind: _Optional[_Union[ChunkKind, str]] = ..., chunk_index: _Optional[int] = ..., from_site: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class ResendChunkResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeliverChunkRequest(_message.Message):
    __slots__ = ("chunk", "nonce")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    chunk: PushChunksRequest
    nonce: bytes
    def __init__(self, chunk: _Optional[_Union[PushChunksRequest, _Mapping]] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class DeliverChunkResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PullStateRequest(_message.Message):
    __slots__ = ("generation", "step", "rank", "site", "from_rank", "nonce")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    FROM_RANK_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    generation: int
    step: int
    rank: int
    site: str
    from_rank: int
    nonce: bytes
    def __init__(self, generation: _Optional[int] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., site: _Optional[str] = ..., from_rank: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class ConfirmPullRequest(_message.Message):
    __slots__ = ("nonce", "generation", "step", "rank", "source")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    generation: int
    step: int
    rank: int
    source: str
    def __init__(self, nonce: _Optional[bytes] = ..., generation: _Optional[int] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., source: _Optional[str] = ...) -> None: ...

class ConfirmPullResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatePiece(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "total_bytes", "data", "crc32")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    total_bytes: int
    data: bytes
    crc32: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class OpenBulkRequest(_message.Message):
    __slots__ = ("from_site", "nonce")
    FROM_SITE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    from_site: int
    nonce: bytes
    def __init__(self, from_site: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class OpenBulkResponse(_message.Message):
    __slots__ = ("port", "ticket")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    port: int
    ticket: bytes
    def __init__(self, port: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class GrantBulkRequest(_message.Message):
    __slots__ = ("nonce", "ticket", "port", "from_site")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    FROM_SITE_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    ticket: bytes
    port: int
    from_site: int
    def __init__(self, nonce: _Optional[bytes] = ..., ticket: _Optional[bytes] = ..., port: _Optional[int] = ..., from_site: _Optional[int] = ...) -> None: ...

class GrantBulkResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortRoundRequest(_message.Message):
    __slots__ = ("generation", "step", "group", "from_site", "reason")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    FROM_SITE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    generation: int
    step: int
    group: int
    from_site: int
    reason: str
    def __init__(self, generation: _Optional[int] = ..., step: _Optional[int] = ..., group: _Optional[int] = ..., from_site: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortRoundResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
