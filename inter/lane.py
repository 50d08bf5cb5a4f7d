"""Lanes: the gRPC data plane between the ranks at one mesh coordinate of every site.

This module owns the receiving side: a :class:`LaneServer` receives ``PushChunks``
streams, validates every message field by field and deposits the valid ones in a
:class:`~isthmus.inter.mailbox.Mailbox`. It also owns the limits both sides share
(:func:`max_payload_bytes`, :func:`channel_options`). The sending side,
:class:`~isthmus.inter.lane_peer.LanePeer`, lives in :mod:`isthmus.inter.lane_peer`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc

from isthmus.proto import lane_pb2, lane_pb2_grpc

from .codec import crc32
from .mailbox import Mailbox

__all__ = ["LaneServer", "channel_options", "max_payload_bytes"]

log = logging.getLogger(__name__)

_HEADROOM = 64 * 1024  # protobuf framing and metadata on top of the payload


def max_payload_bytes(chunk_bytes: int) -> int:
    """Returns the largest payload accepted for ``chunk_bytes`` of fp32 values.

    zstd's worst case on incompressible input is a little above the input
    (ZSTD_compressBound is about n + n/256 + 64); allow that and some slack.
    """
    return chunk_bytes + chunk_bytes // 128 + 1024


def channel_options(chunk_bytes: int) -> list[tuple[str, int]]:
    """gRPC message size limits for a lane of ``chunk_bytes`` chunks (server and clients)."""
    limit = max_payload_bytes(chunk_bytes) + _HEADROOM
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class LaneServer(lane_pb2_grpc.LaneServicer):
    """The receiving side of one rank's lane.

    Args:
        site_index: this site's index in the membership's site list.
        num_sites: number of sites in the membership.
        codec: codec name every sender must use (``Codec.name``).
        generation: current membership generation.
        chunk_bytes: the job's chunk size; bounds payloads and messages.
        host: interface to bind; port 0 lets the OS pick.
        port: port to bind (0 = ephemeral).
        max_workers: handler threads; each open stream holds one for its round.
    """

    def __init__(
        self,
        *,
        site_index: int,
        num_sites: int,
        codec: str,
        generation: int = 0,
        chunk_bytes: int = 1 << 20,
        host: str = "127.0.0.1",
        port: int = 0,
        max_workers: int = 32,
    ) -> None:
        if not 0 <= site_index < num_sites:
            raise ValueError(f"site_index must be in [0, {num_sites}), got {site_index}")
        if chunk_bytes < 4 or chunk_bytes % 4:
            raise ValueError(f"chunk_bytes must be a positive multiple of 4, got {chunk_bytes}")
        self.site_index = site_index
        self.codec = codec
        self.chunk_bytes = chunk_bytes
        self.mailbox = Mailbox()
        self._lock = threading.Lock()
        self._generation = generation
        self._num_sites = num_sites
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="lane-rx"),
            options=channel_options(chunk_bytes),
        )
        lane_pb2_grpc.add_LaneServicer_to_server(self, self._server)
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"could not bind lane server to {host}:{port}")
        self._address = f"{host}:{bound}"
        self._server.start()
        log.info("[site %d] lane server listening on %s", site_index, self._address)

    @property
    def address(self) -> str:
        """The "host:port" peers dial."""
        return self._address

    @property
    def generation(self) -> int:
        """The membership generation accepted chunks must carry."""
        with self._lock:
            return self._generation

    def set_generation(self, generation: int, num_sites: int | None = None) -> None:
        """Moves to a new membership; chunks of the old one in the mailbox are dropped."""
        with self._lock:
            self._generation = generation
            if num_sites is not None:
                self._num_sites = num_sites
            self.mailbox.clear()

    def stop(self, grace: float | None = 1.0) -> None:
        """Stops accepting streams; open ones get ``grace`` seconds to finish."""
        self._server.stop(grace).wait(timeout=(grace or 0) + 5)

    def _validate(self, req: lane_pb2.PushChunksRequest) -> None:
        with self._lock:
            generation, num_sites = self._generation, self._num_sites
        per = self.chunk_bytes // 4
        limit = max_payload_bytes(self.chunk_bytes)
        crc = crc32(req.payload)
        pre, bad = grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT
        kinds = (lane_pb2.CHUNK_KIND_CONTRIBUTION, lane_pb2.CHUNK_KIND_RESULT)
        # Cheap field checks first; the CRC last, on a message that is otherwise sound.
        checks = (
            (
                req.generation == generation,
                pre,
                f"generation {req.generation} != receiver's {generation}",
            ),
            (req.codec == self.codec, pre, f"codec {req.codec!r} != receiver's {self.codec!r}"),
            (
                req.from_site < num_sites and req.from_site != self.site_index,
                bad,
                f"from_site {req.from_site} is not a peer of site {self.site_index} "
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
            (
                len(req.payload) <= limit,
                bad,
                f"payload of {len(req.payload)} bytes exceeds {limit}",
            ),
            (
                crc == req.crc32,
                bad,
                f"crc32 mismatch on chunk {req.chunk_index}: payload has "
                f"{crc:#010x}, header says {req.crc32:#010x}",
            ),
        )
        for ok, code, why in checks:
            if not ok:
                raise _Refused(code, why)

    def PushChunks(  # noqa: N802 (gRPC method name)
        self,
        request_iterator: Iterator[lane_pb2.PushChunksRequest],
        context: grpc.ServicerContext,
    ) -> lane_pb2.PushChunksResponse:
        """Validates and deposits each chunk of the stream; aborts on the first bad one.

        Chunks are deposited one by one as they arrive, not at the end of the stream:
        a round's stream stays open until the sender's results are out, and those wait
        for the chunks already sent (holding them back would deadlock). A refused chunk
        changes nothing; valid chunks before it in the stream stay deposited.
        """
        accepted = 0
        for req in request_iterator:
            try:
                self._validate(req)
                key = (req.step, req.group, req.kind, req.chunk_index, req.from_site)
                why = self.mailbox.deposit(key, req)
                if why == "duplicate":
                    raise _Refused(grpc.StatusCode.ALREADY_EXISTS, f"duplicate chunk {key}")
                if why == "stale":
                    raise _Refused(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"chunk {key} belongs to a finished step",
                    )
            except _Refused as exc:
                msg = (
                    f"site {self.site_index} refused chunk from site {req.from_site} "
                    f"(step {req.step} group {req.group}): {exc}"
                )
                log.warning(msg)
                context.abort(exc.code, msg)  # raises; nothing of this chunk was stored
            accepted += 1
        return lane_pb2.PushChunksResponse(accepted=accepted)
