"""The hop between a rank and its host agent: protobuf messages in length-prefixed frames
on one Unix socket connection a rank, kept open.

Over gRPC each vote or watch a rank sent its agent cost the agent ~100 µs of Python and
C-core work and two thread hand-offs, and 256 agents of 8 ranks, with the decision's
fan-out to 2,048 ranks, were more than 2 cores could carry (docs/benchmarks/control-plane.md,
"Real host agents, a process each"). A frame here costs a ``write`` and a ``recv``, and the
agent learns that a rank is gone the moment its socket closes. The messages are the
coordinator's own (``isthmus.v1``); only the framing is new:

    payload length (u32, big-endian) | kind (u8) | request id (u32) | payload

A request and its answer carry the same id; a rank may have several in flight (a vote
from its training thread, a watch from its watcher). A length over ``MAX_PAYLOAD`` is
refused as soon as its header is read, before anything is buffered, and the connection is
dropped. :class:`Frames` cuts frames out of a byte stream for both ends; :class:`RankWire`
is the agent's end (an asyncio protocol), the rank's is
:class:`~isthmus.inter.control.agent_socket.AgentConnection`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import struct
from collections.abc import Callable
from typing import Any

import grpc

from isthmus.inter.control.channels import MAX_MESSAGE_BYTES

__all__ = ["HEADER", "MAX_PAYLOAD", "FrameError", "Frames", "Kind", "RankWire", "StatusError"]

log = logging.getLogger("isthmus.host_agent")

HEADER = struct.Struct("!IBI")
"""A frame's header: its payload's length in bytes, its :class:`Kind`, its request id."""
MAX_PAYLOAD = MAX_MESSAGE_BYTES
"""The largest payload taken (a membership naming every lane is the largest message);
the coordinator's gRPC limit."""
_MAX_DETAILS = 1024
"""Bytes of an error's details sent (a refusal's reason is one line)."""


class Kind(enum.IntEnum):
    """What a frame's payload is."""

    VOTE = 1
    """rank -> agent: a ``CommitHostStepRequest`` that waits (``wait_ms`` > 0)."""
    WATCH = 2
    """rank -> agent: a ``GetMembershipRequest`` with the rank's key and a generation."""
    CANCEL = 3
    """rank -> agent: ends the watch of this id now (no payload); answered CANCELLED."""
    DECISION = 4
    """agent -> rank: the ``Decision`` that answers a vote."""
    MEMBERSHIP = 5
    """agent -> rank: the ``GetMembershipResponse`` that answers a watch."""
    ERROR = 6
    """agent -> rank: the status a request ends with (:func:`status_payload`)."""


class FrameError(Exception):
    """The byte stream is no stream of frames (a length over the limit): drop it."""


class StatusError(grpc.RpcError):
    """A request that ended with a gRPC status, as a call's error names it: what the agent
    answered (a refusal of the coordinator's, passed on), or UNAVAILABLE when the agent
    could not be reached (the rank then calls its coordinator)."""

    def __init__(self, code: grpc.StatusCode, details: str | None) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details or ""

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def frame(kind: int, rid: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), kind, rid) + payload


def status_payload(code: grpc.StatusCode, details: str) -> bytes:
    """An ERROR frame's payload: the status code's number (one byte), then its details."""
    return bytes([code.value[0]]) + details.encode("utf-8", "replace")[:_MAX_DETAILS]


def status_error(payload: bytes) -> StatusError:
    """The error an ERROR frame's payload names (UNKNOWN for a code gRPC lacks)."""
    code = _CODES.get(payload[0], grpc.StatusCode.UNKNOWN) if payload else grpc.StatusCode.UNKNOWN
    return StatusError(code, payload[1:].decode("utf-8", "replace"))


class Frames:
    """Whole frames out of a byte stream, as its pieces arrive (no I/O of its own); a
    header naming a payload over ``limit`` bytes raises :class:`FrameError` before
    anything of it is buffered."""

    def __init__(self, limit: int = MAX_PAYLOAD) -> None:
        self.limit = limit
        self._buffer = bytearray()

    @property
    def partial(self) -> int:
        """Bytes of a frame begun but not whole yet (0 between frames)."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        """The frames that ``data`` completes, in order: (kind, request id, payload)."""
        buffer = self._buffer
        buffer += data
        frames, at, size = [], 0, HEADER.size
        while len(buffer) - at >= size:
            length, kind, rid = HEADER.unpack_from(buffer, at)
            if length > self.limit:
                buffer.clear()
                raise FrameError(f"a frame of {length} bytes (at most {self.limit})")
            end = at + size + length
            if len(buffer) < end:
                break
            frames.append((kind, rid, bytes(buffer[at + size : end])))
            at = end
        del buffer[:at]
        return frames


OnFrame = Callable[["RankWire", int, int, bytes], None]


class RankWire(asyncio.Protocol):
    """The agent's end of one rank's connection: each whole frame goes to
    ``on_frame(wire, kind, rid, payload)``, and ``on_lost(wire)`` runs once it closed (the
    rank's process ended, or it closed its client). A stream that is no stream of frames
    is dropped, as is a rank that reads none of its answers (its socket's buffer full).
    ``keys``: the rank keys seen on it; ``held``: what the agent holds of it, by request id.
    """

    def __init__(self, on_frame: OnFrame, on_lost: Callable[[RankWire], None]) -> None:
        self._on_frame, self._on_lost = on_frame, on_lost
        self._frames = Frames()
        self._transport: asyncio.Transport | None = None
        self.closed = False
        self.keys: set[str] = set()
        self.held: dict[int, Any] = {}

    def connection_made(self, transport) -> None:
        self._transport = transport
        # A rank that stops reading its answers is dropped, never buffered without end.
        transport.set_write_buffer_limits(high=4 * MAX_PAYLOAD)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._frames.feed(data)
        except FrameError as exc:
            log.warning("host agent: a rank's connection dropped: %s", exc)
            self.abort()
            return
        for kind, rid, payload in frames:
            if self.closed:
                return
            self._on_frame(self, kind, rid, payload)

    def pause_writing(self) -> None:
        log.warning("host agent: a rank that reads none of its answers dropped")
        self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._on_lost(self)

    def send(self, kind: int, rid: int, payload: bytes) -> None:  # not once closed
        if not self.closed and self._transport is not None:
            self._transport.write(frame(kind, rid, payload))

    def error(self, rid: int, code: grpc.StatusCode, details: str) -> None:
        self.send(Kind.ERROR, rid, status_payload(code, details))

    def abort(self) -> None:
        """Drops the connection now (the rank hears its end and calls its coordinator)."""
        if self._transport is not None:
            self._transport.abort()
