"""The bulk chunk stream's wire form: protobuf bytes, with the payload kept out of parsing.

A lane moves gigabytes per step, and python protobuf copies a ``bytes`` field when it
parses a message and again each time the field is read; with grpcio's own copies that
made a 4 MiB chunk cross memory about ten times per hop. So this module writes and reads
``PushChunksRequest`` (and ``DeliverChunkRequest``, a resent chunk) itself: the header
fields go through protobuf, the payload field is written by hand in one ``bytes.join``
(:func:`encode_chunk`) and read as a ``memoryview`` of the received bytes, no copy until
the round decodes it (:func:`parse_chunk`).

The bytes are an ordinary protobuf encoding of ``proto/lane.proto`` (fields in any
order, the last payload wins), so any protobuf client can talk to a lane. Malformed
input raises :class:`WireError`; nothing here trusts a length it has not checked
against the bytes at hand (docs/design.md, invariant 4).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from isthmus.proto import lane_pb2

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

__all__ = [
    "Chunk",
    "ChunkWire",
    "DeliverWire",
    "Delivery",
    "Frame",
    "WireError",
    "encode_chunk",
    "encode_delivery",
    "parse_chunk",
    "parse_header",
]

_PAYLOAD_FIELD = 11  # PushChunksRequest.payload
_DELIVER_CHUNK_FIELD = 1  # DeliverChunkRequest.chunk
_DELIVER_NONCE_FIELD = 2  # DeliverChunkRequest.nonce
_LEN = 2  # wire type of length-delimited fields
_PAYLOAD_TAG = bytes([(_PAYLOAD_FIELD << 3) | _LEN])
_DELIVER_TAG = bytes([(_DELIVER_CHUNK_FIELD << 3) | _LEN])
_NONCE_TAG = bytes([(_DELIVER_NONCE_FIELD << 3) | _LEN])
MAX_NONCE = 64  # bytes of a nonce looked at; a lane makes 32


class WireError(ValueError):
    """Bytes that are not a well-formed message of the lane protocol."""


@dataclasses.dataclass(slots=True)
class Chunk:
    """One received chunk: ``PushChunksRequest``'s fields, the payload as a view.

    Field meanings and units are those of ``proto/lane.proto``. ``payload`` is a
    read-only ``memoryview`` of the received message (or ``bytes``); it stays valid as
    long as the chunk is referenced.
    """

    generation: int
    step: int
    group: int
    kind: lane_pb2.ChunkKind
    chunk_index: int
    num_chunks: int
    from_site: int
    total_elements: int
    num_elements: int
    codec: str
    payload: memoryview | bytes
    crc32: int
    payload_crc: int | None = None
    """The payload's CRC-32C as this process computed it while receiving (never read
    from the wire): spares the lane a second pass. None: not computed yet."""
    payload_finite: bool | None = None
    """For a ``raw`` payload received on a bulk connection: whether every fp32 value is
    finite, checked in the same pass. None: not checked."""

    def header(self) -> lane_pb2.PushChunksRequest:
        return _header(self)


# PushChunksRequest's fields but the payload, read from the proto so a new header field
# cannot be dropped on the way (Chunk must then name it too, or building one fails).
_HEADER_FIELDS = tuple(
    f.name for f in lane_pb2.PushChunksRequest.DESCRIPTOR.fields if f.name != "payload"
)


def _header(c: Chunk) -> lane_pb2.PushChunksRequest:
    return lane_pb2.PushChunksRequest(**{f: getattr(c, f) for f in _HEADER_FIELDS})


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _read_varint(data: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift >= 64:
            raise WireError("varint longer than 10 bytes")


def encode_chunk(
    header: lane_pb2.PushChunksRequest, payload: Buffer | list[Buffer] | tuple[Buffer, ...]
) -> bytes:
    """The full ``PushChunksRequest``: ``header``'s fields (its own payload unset, else
    it would be sent twice), then ``payload``, one bytes-like object or a sequence of
    them (e.g. an int8 codec's scale and values), written as field 11 without a copy."""
    parts = list(payload) if isinstance(payload, (list, tuple)) else [payload]
    views = [memoryview(p).cast("B") for p in parts]
    size = sum(v.nbytes for v in views)
    return b"".join([header.SerializeToString(), _PAYLOAD_TAG, _varint(size), *views])


@dataclasses.dataclass(frozen=True, slots=True)
class Frame:
    """One chunk to send: its header fields serialized, and its payload not yet copied.

    A bulk connection writes the two with one scatter-gather ``sendmsg``; gRPC and
    resends take :meth:`joined`, the ordinary protobuf message. ``payload`` must stay
    unchanged while the frame may still be sent or asked for again (a CPU round's
    tensor view, or bytes of its own).
    """

    header: bytes
    payload: memoryview

    @classmethod
    def from_message(cls, message: bytes | memoryview) -> Frame:
        """The frame of a whole ``PushChunksRequest`` encoding (clients written by hand,
        tests). Raises :class:`WireError` if it is not one."""
        chunk = parse_chunk(message)
        payload = memoryview(bytes(chunk.payload))
        chunk.payload = b""
        return cls(chunk.header().SerializeToString(), payload)

    @property
    def payload_bytes(self) -> int:
        return self.payload.nbytes

    def joined(self) -> bytes:
        return b"".join([self.header, _PAYLOAD_TAG, _varint(self.payload.nbytes), self.payload])


def parse_header(data: bytes | memoryview) -> Chunk:
    """Parses the header of a bulk frame: every field of a ``PushChunksRequest`` but
    the payload, which follows it on the connection (set by the caller). WireError if
    malformed, or if it carries a payload of its own."""
    chunk = parse_chunk(data)
    if len(chunk.payload):
        raise WireError("a bulk frame's header carries a payload field")
    return chunk


def parse_chunk(data: bytes | memoryview) -> Chunk:
    """Parses a ``PushChunksRequest`` with its payload as a view of ``data``; WireError
    if it is not a well-formed one."""
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
    if view.format != "B":
        view = view.cast("B")
    end = len(view)
    pos = 0
    header_spans: list[tuple[int, int]] = []
    payload: memoryview = view[0:0]
    while pos < end:
        start = pos
        tag, pos = _read_varint(view, pos, end)
        field, wire = tag >> 3, tag & 7
        if field == 0:
            raise WireError("field number 0")
        if wire == 0:
            _, pos = _read_varint(view, pos, end)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == _LEN:
            size, pos = _read_varint(view, pos, end)
            if size > end - pos:
                raise WireError(f"field {field} claims {size} bytes, {end - pos} left")
            if field == _PAYLOAD_FIELD:
                payload = view[pos : pos + size]
                pos += size
                continue
            pos += size
        else:
            raise WireError(f"field {field} has unsupported wire type {wire}")
        if pos > end:
            raise WireError(f"field {field} runs past the end of the message")
        header_spans.append((start, pos))
    head = b"".join(view[a:b] for a, b in header_spans)
    try:
        msg = lane_pb2.PushChunksRequest.FromString(head)
    except Exception as exc:  # DecodeError, bad UTF-8 in codec
        raise WireError(f"{type(exc).__name__}: {str(exc)[:200]}") from None
    return Chunk(**{f: getattr(msg, f) for f in _HEADER_FIELDS}, payload=payload.toreadonly())


def encode_delivery(frame: bytes, nonce: bytes) -> bytes:
    """A ``DeliverChunkRequest``: the chunk whose encoding is ``frame``, and ``nonce``."""
    return b"".join(
        [_DELIVER_TAG, _varint(len(frame)), frame, _NONCE_TAG, _varint(len(nonce)), nonce]
    )


@dataclasses.dataclass(slots=True)
class Delivery:
    """A parsed ``DeliverChunkRequest``."""

    chunk: Chunk
    nonce: bytes


def _parse_delivery(data: bytes) -> Delivery:
    view = memoryview(data)
    end, pos = len(view), 0
    found: memoryview | None = None
    nonce = b""
    while pos < end:
        tag, pos = _read_varint(view, pos, end)
        field, wire = tag >> 3, tag & 7
        if wire != _LEN or field not in (_DELIVER_CHUNK_FIELD, _DELIVER_NONCE_FIELD):
            raise WireError(f"unexpected field {field} (wire type {wire}) in DeliverChunkRequest")
        size, pos = _read_varint(view, pos, end)
        if size > end - pos:
            raise WireError(f"field {field} claims {size} bytes, {end - pos} left")
        if field == _DELIVER_CHUNK_FIELD:
            found = view[pos : pos + size]
        elif size > MAX_NONCE:
            raise WireError(f"nonce of {size} bytes exceeds {MAX_NONCE}")
        else:
            nonce = bytes(view[pos : pos + size])
        pos += size
    if found is None:
        raise WireError("DeliverChunkRequest holds no chunk")
    return Delivery(parse_chunk(found), nonce)


class ChunkWire:
    """``PushChunksRequest`` (de)serializers for grpcio: bytes in, :class:`Chunk` out
    (:class:`WireError` if malformed). ``DESCRIPTOR`` names the message, so a refusal of
    malformed bytes (:mod:`isthmus.inter.malformed`) names it too."""

    DESCRIPTOR = lane_pb2.PushChunksRequest.DESCRIPTOR

    # A classmethod, not a staticmethod: malformed.py names the message of a refused
    # request through the deserializer's __self__.DESCRIPTOR.
    @classmethod
    def FromString(cls, data: bytes) -> Chunk:  # noqa: N802 (protobuf's name)
        return parse_chunk(data)


class DeliverWire:
    """``DeliverChunkRequest`` deserializer for the lane that asked for the chunk."""

    DESCRIPTOR = lane_pb2.DeliverChunkRequest.DESCRIPTOR

    @classmethod
    def FromString(cls, data: bytes) -> Delivery:  # noqa: N802 (as ChunkWire's)
        return _parse_delivery(data)
