"""Limits that keep a server's handler threads for the calls that train.

grpcio's synchronous server runs every call on a thread of a fixed pool, and a call
that waits (a long poll, a health ``Watch``, an open ``PushChunks`` stream) holds its
thread while it waits. Tried from outside (issue 14): 20 health watches, or 32 long
polls, or 40 silent streams, took every thread of a coordinator or a lane, and the job
froze for as long as they stayed open, silently. So waiting is rationed:

* :class:`WaitSlots` — a call that may wait takes a slot; without one it answers at
  once with what it knows (a long poll returns "nothing new yet", the caller asks again)
  or, for a stream, is refused with RESOURCE_EXHAUSTED. Slots are fewer than threads,
  so the calls that answer at once always find one.
* :class:`BoundedHealth` — grpc.health.v1 with at most a few ``Watch`` streams open;
  ``Check`` is never limited.
* :class:`RefusalLog` — each refusal logged with the caller's address, once per caller
  and reason per minute: a stall is never silent, a flood never floods the log.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health

__all__ = ["HEALTH_WATCHES", "BoundedHealth", "RefusalLog", "WaitSlots", "pool_size"]

log = logging.getLogger("isthmus.bounds")

HEALTH_WATCHES = 2
"""Health ``Watch`` streams a server keeps open at once (probes use ``Check``)."""
_ANSWER_AT_ONCE = 4
"""Threads a server keeps for calls that answer without waiting."""
_LOG_EVERY_S = 60.0


def pool_size(waiters: int) -> int:
    """Handler threads for a server whose legitimate callers may hold ``waiters``
    waiting calls at once: those, the health watches, and room for the rest."""
    return max(1, waiters) + HEALTH_WATCHES + _ANSWER_AT_ONCE


class RefusalLog:
    """Logs a refusal once per (caller, reason) per minute, with the caller's address.

    Args:
        where: names the server in each line, e.g. "coordinator of site0".
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self._last: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self.count = 0
        """Refusals so far (logged or not)."""

    def note(self, peer: str, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.count += 1
            key = (peer, reason)
            if now - self._last.get(key, -_LOG_EVERY_S) < _LOG_EVERY_S:
                return
            self._last[key] = now
            if len(self._last) > 1024:  # callers come and go: forget the oldest
                for stale in sorted(self._last, key=self._last.__getitem__)[:512]:
                    del self._last[stale]
        log.warning("%s: %s from %s", self.where, reason, peer)


class WaitSlots:
    """At most ``slots`` calls wait at once (see the module docstring).

    Args:
        slots: calls that may wait at once.
        what: what a slot is for, in the refusal's log line ("long polls").
        refusals: where a call turned away is logged.
    """

    def __init__(self, slots: int, what: str, refusals: RefusalLog) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots, self.what, self.refusals = slots, what, refusals
        self._free = threading.BoundedSemaphore(slots)

    @contextlib.contextmanager
    def wait(self, context: grpc.ServicerContext) -> Iterator[bool]:
        """Yields True with a slot held for the block, or False (answer at once)."""
        held = self._free.acquire(blocking=False)
        if not held:
            self.refusals.note(
                context.peer(), f"all {self.slots} {self.what} slots busy; answered at once"
            )
        try:
            yield held
        finally:
            if held:
                self._free.release()

    def hold_for_stream(self, context: grpc.ServicerContext) -> None:
        """Takes a slot until the call ends, or refuses it with RESOURCE_EXHAUSTED."""
        if not self._free.acquire(blocking=False):
            reason = f"all {self.slots} {self.what} slots busy"
            self.refusals.note(context.peer(), reason)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)
        context.add_callback(self._free.release)


class BoundedHealth(health.HealthServicer):
    """grpc.health.v1 with at most :data:`HEALTH_WATCHES` ``Watch`` streams open.

    Args:
        refusals: where a watch turned away is logged.
    """

    def __init__(self, refusals: RefusalLog) -> None:
        super().__init__()
        self._watches = WaitSlots(HEALTH_WATCHES, "health watch", refusals)

    def Watch(self, request, context, send_response_callback=None):  # noqa: N802
        self._watches.hold_for_stream(context)
        return super().Watch(request, context, send_response_callback)
