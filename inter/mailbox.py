"""The mailbox: where a lane server leaves the chunks it accepted until a round takes them.

Owns :data:`MailboxKey` and :class:`Mailbox`, which refuses replays and chunks of
finished steps. No gRPC here; :mod:`isthmus.inter.lane` fills it, the all-reduce empties it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from isthmus.proto import lane_pb2

__all__ = ["Mailbox", "MailboxKey"]

# (step, group, kind, chunk_index, from_site)
MailboxKey = tuple[int, int, int, int, int]


class Mailbox:
    """Thread-safe store of received chunks keyed by :data:`MailboxKey`.

    Keeps the keys ever deposited for the live steps so a replayed chunk is refused
    even after it was taken, and a step floor so chunks of finished rounds are refused.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: dict[MailboxKey, lane_pb2.PushChunksRequest] = {}
        self._seen: set[MailboxKey] = set()
        self._floor = 0

    def deposit(self, key: MailboxKey, item: lane_pb2.PushChunksRequest) -> str | None:
        """Stores ``item``; returns None, or why it was refused ("duplicate"/"stale")."""
        with self._cond:
            if key[0] < self._floor:
                return "stale"
            if key in self._seen:
                return "duplicate"
            self._seen.add(key)
            self._items[key] = item
            self._cond.notify_all()
            return None

    def take(self, key: MailboxKey, timeout: float) -> lane_pb2.PushChunksRequest:
        """Waits up to ``timeout`` seconds for ``key``, removes and returns it.

        Raises:
            TimeoutError: nothing arrived under ``key`` in time.
        """
        found = self.take_any((key,), timeout)
        if found is None:
            raise TimeoutError(f"no chunk {key} within {timeout:.3f}s")
        return found[1]

    def take_any(
        self, keys: Iterable[MailboxKey], timeout: float
    ) -> tuple[MailboxKey, lane_pb2.PushChunksRequest] | None:
        """Waits up to ``timeout`` seconds for any of ``keys``; removes and returns it."""
        wanted = keys if isinstance(keys, (set, frozenset, dict)) else set(keys)
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while True:
                for key in self._items:  # the mailbox is usually the smaller side
                    if key in wanted:
                        return key, self._items.pop(key)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def discard_before(self, step: int) -> int:
        """Drops everything of steps before ``step`` and refuses them from now on.

        Returns:
            The number of unclaimed chunks dropped.
        """
        with self._cond:
            self._floor = max(self._floor, step)
            stale = [k for k in self._items if k[0] < step]
            for key in stale:
                del self._items[key]
            self._seen = {k for k in self._seen if k[0] >= step}
            return len(stale)

    def clear(self) -> None:
        """Forgets everything (a new membership generation starts over)."""
        with self._cond:
            self._items.clear()
            self._seen.clear()
            self._floor = 0

    def keys(self) -> list[MailboxKey]:
        """Returns a snapshot of the keys waiting to be taken."""
        with self._cond:
            return list(self._items)

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)
