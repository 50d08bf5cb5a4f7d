"""What a lane accepts: the size limits both sides of a lane share, and the field-by-
field checks of a received chunk (invariant 4), for chunks that came over gRPC, the
bulk port or a ``ResendChunk`` pull alike (inter/data/lane/server.py judges with them)."""

from __future__ import annotations

import grpc

from isthmus.inter.data.codecs.chain import crc32
from isthmus.inter.data.round.context import Members
from isthmus.inter.data.transport.wire import Chunk
from isthmus.proto import lane_pb2

__all__ = [
    "CRC_MISMATCH",
    "STREAM_PING_S",
    "STREAM_PING_TIMEOUT_S",
    "Refused",
    "STREAM_WINDOW_BYTES",
    "channel_options",
    "max_payload_bytes",
    "stream_keepalive",
    "stream_ping_policy",
    "validate_chunk",
]

_HEADROOM = 64 * 1024  # protobuf framing and metadata on top of the payload
CRC_MISMATCH = "crc32 mismatch"


def max_payload_bytes(chunk_bytes: int) -> int:
    """The largest payload accepted for ``chunk_bytes`` of fp32 values: zstd's worst
    case on incompressible input (ZSTD_compressBound, about n + n/256 + 64) and slack."""
    return chunk_bytes + chunk_bytes // 128 + 1024


STREAM_WINDOW_BYTES = 32 << 20
"""HTTP/2's per-stream window of a lane (gRPC's default is 64 KiB); a ``PushChunks``
call is a stream of up to half this (push.py). At the default one H200 host moved 0.40
GB/s of raw fp32 under TLS, at this one 0.44 (docs/benchmarks/lanes.md)."""


def channel_options(chunk_bytes: int) -> list[tuple[str, int]]:
    """gRPC message size limits and stream window for a lane of ``chunk_bytes`` chunks
    (server and clients)."""
    limit = max_payload_bytes(chunk_bytes) + _HEADROOM
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
    ]


STREAM_PING_S = 2.0
"""How often a lane's channel pings its peer while a call is open (gRPC keepalive)."""
STREAM_PING_TIMEOUT_S = 10.0
"""How long a ping's answer may take before the connection is taken for dead (its
streams fail UNAVAILABLE): it waits behind the socket buffers (~4-16 MB: 0.3-1.3 s at
100 Mbit/s), so this is generous for any link, and far below ``sync.timeout_s``."""


def stream_keepalive() -> list[tuple[str, int]]:
    """A lane client's keepalive: a ``PushChunks`` stream has no acknowledgement before
    its end, so a connection the network black-holed (one flow of a long link) is only
    noticed by pings that go unanswered. Pings also while no data is sent (a flow
    stalled in the sending direction sends none), none on an idle channel."""
    return [
        ("grpc.keepalive_time_ms", int(STREAM_PING_S * 1000)),
        ("grpc.keepalive_timeout_ms", int(STREAM_PING_TIMEOUT_S * 1000)),
        ("grpc.http2.max_pings_without_data", 0),
        # gRPC's client sends a ping without data received since the last one only
        # every 5 minutes by default: what a stalled flow looks like from its end.
        ("grpc.http2.min_time_between_pings_ms", int(STREAM_PING_S * 1000)),
        ("grpc.keepalive_permit_without_calls", 0),
    ]


def stream_ping_policy() -> list[tuple[str, int]]:
    """A lane server's side of :func:`stream_keepalive`: pings as often as a client
    sends them are welcome (gRPC's default answers a ping more often than every 5
    minutes without data with GOAWAY after two strikes)."""
    return [
        ("grpc.http2.min_ping_interval_without_data_ms", int(STREAM_PING_S * 1000) // 2),
        ("grpc.http2.max_ping_strikes", 0),
    ]


class Refused(Exception):
    """A received chunk or call refused: the gRPC status and the one-line reason."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def validate_chunk(req: Chunk, members: Members, codec: str, chunk_bytes: int) -> None:
    """Raises :class:`Refused` saying why ``req`` is not a sound chunk for a lane of
    ``members`` that takes ``codec`` in chunks of ``chunk_bytes``: the cheap field
    checks first, the CRC last, on a message that is otherwise sound."""
    generation, num_sites = members.generation, members.num_sites
    per = chunk_bytes // 4
    limit = max_payload_bytes(chunk_bytes)
    known = getattr(req, "payload_crc", None)  # a protobuf message (tests) has none
    crc = known if known is not None else crc32(req.payload)
    pre, bad = grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT
    kinds = (lane_pb2.CHUNK_KIND_CONTRIBUTION, lane_pb2.CHUNK_KIND_RESULT)
    checks = (
        (
            req.generation == generation,
            pre,
            f"generation {req.generation} != receiver's {generation}",
        ),
        (req.codec == codec, pre, f"codec {req.codec[:64]!r} != receiver's {codec!r}"),
        (
            req.from_site < num_sites and req.from_site != members.site_index,
            bad,
            f"from_site {req.from_site} is not a peer of site {members.site_index} "
            f"among {num_sites} sites",
        ),
        (req.kind in kinds, bad, f"chunk kind {req.kind} is not CONTRIBUTION or RESULT"),
        (
            req.chunk_index < req.num_chunks,
            bad,
            f"chunk_index {req.chunk_index} >= num_chunks {req.num_chunks}",
        ),
        (
            0 < req.num_elements <= min(per, req.total_elements),
            bad,
            f"num_elements {req.num_elements} outside [1, {min(per, req.total_elements)}]",
        ),
        (
            req.num_chunks == -(-req.total_elements // per),
            bad,
            f"num_chunks {req.num_chunks} does not match total_elements "
            f"{req.total_elements} in chunks of {per}",
        ),
        (len(req.payload) <= limit, bad, f"payload of {len(req.payload)} bytes exceeds {limit}"),
        (
            crc == req.crc32,
            bad,
            f"{CRC_MISMATCH} on chunk {req.chunk_index}: payload has "
            f"{crc:#010x}, header says {req.crc32:#010x}",
        ),
    )
    for ok, code, why in checks:
        if not ok:
            raise Refused(code, why)
