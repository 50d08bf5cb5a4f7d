"""One round's chunks to one peer, over that peer's connections (either transport).

A round hands each chunk to the peer's connection (shared by the peer's rounds) with the
fewest bytes not yet acknowledged: a bulk port's (:class:`.bulk_peer.BulkConnection`) or
one of ``PushChunks`` calls (:class:`.push.StreamConnection`). Either tells the round
what became of each frame: acknowledged, damaged and sent again, stalled, or failed.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from isthmus.inter.data.transport.bulk import RESEND
from isthmus.inter.data.transport.wire import Frame

__all__ = ["Connection", "PeerRound"]


class Connection(Protocol):
    def put(self, rnd: PeerRound, frame: Frame) -> None:
        """Queues ``frame`` of ``rnd``; raises ConnectionError once closed."""

    def load(self) -> tuple[int, int]:
        """Payload bytes queued or in flight on it, not yet acknowledged, and payload
        bytes ever queued on it."""


def _load(conn: Connection) -> tuple[int, int]:
    return conn.load()


class PeerRound:
    """One round's chunks to one peer over its connections (shared by the peer's
    rounds); ``deadline`` (time.monotonic()) is when they must have been taken."""

    def __init__(self, conns: list[Connection], deadline: float) -> None:
        self._conns = conns
        self.deadline = deadline
        self._cond = threading.Condition()
        self._ended = False
        self._error: BaseException | None = None
        self._taken = 0
        self.sent = 0
        self.resent = 0
        """Frames the peer received damaged and asked for again (the bulk port; on
        ``PushChunks`` the receiver pulls a damaged chunk with ``ResendChunk``)."""
        self.stalls = 0
        """Connections that stalled on a frame of this round (the oldest in flight, past
        its deadline), or were lost under it; that frame and those behind it went again
        on a new connection."""

    def send(self, frame: Frame) -> None:
        """Queues one chunk on the least loaded connection: the fewest bytes not yet
        acknowledged, then the fewest ever queued (so idle connections take turns, in
        this round and across the peer's rounds). Thread-safe.

        The peer's rounds share its connections, and a connection held to a per-flow
        cap carries no more than its share: each round taking them in turn from the
        first (as before) put one frame more on the first in every round whose frames
        did not divide evenly (a 256 MiB group of 16 MiB chunks: 16 frames a direction,
        4 of them on the first of 5 connections, which held the link to 80 %).

        A chunk sent after :meth:`end` (a failing round's stragglers) is dropped.
        """
        with self._cond:
            if self._ended or self._error is not None:
                return
            self.sent += 1
        # Outside the round's lock: a connection tells its rounds under its own lock.
        conn = min(self._conns, key=_load)
        try:
            conn.put(self, frame)
        except ConnectionError as exc:
            self.failed(exc)

    def end(self) -> None:
        with self._cond:
            self._ended = True

    def acknowledged(self, status: int, count: int = 1) -> None:
        """``count`` frames were taken (or, ``RESEND``: one goes again, its ack to come)."""
        with self._cond:
            if status == RESEND:
                self.resent += 1
            else:
                self._taken += count
            self._cond.notify_all()

    def stalled(self) -> None:
        with self._cond:
            self.stalls += 1

    def failed(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def failure(self) -> BaseException | None:
        with self._cond:
            return self._error

    def wait(self, timeout: float) -> int:
        """Waits until the peer acknowledged every chunk; returns how many it took.
        Raises grpc.RpcError (the peer refused a chunk: ``BulkRefused`` on the bulk
        port), ConnectionError (a connection broke) or TimeoutError."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._error is None and self._taken < self.sent:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self._taken} of {self.sent} chunks acknowledged")
                self._cond.wait(left)
            if self._error is not None:
                raise self._error
            return self._taken
