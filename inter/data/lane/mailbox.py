"""Where chunks wait: received ones until a round takes them (:class:`Mailbox`, in bounded
memory whoever sends), sent ones until no peer can ask for them again (:class:`Outbox`),
and what peers hand back for a nonce this rank made (:class:`Handoffs`). No gRPC here:
:mod:`isthmus.inter.data.lane.server` fills them, the rounds empty them.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

from isthmus.inter.data.transport.wire import Chunk, Frame

if TYPE_CHECKING:
    from isthmus.proto import lane_pb2

__all__ = [
    "CORRUPT",
    "MAX_ABORTS",
    "MAX_REASON",
    "MAX_STEPS_AHEAD",
    "NONCE_BYTES",
    "HandoffPeer",
    "Handoffs",
    "Mailbox",
    "MailboxKey",
    "Outbox",
    "OutboxKey",
]

# (step, group, kind, chunk_index, from_site)
MailboxKey = tuple[int, int, "lane_pb2.ChunkKind", int, int]
# (step, group, kind, chunk_index)
OutboxKey = tuple[int, int, "lane_pb2.ChunkKind", int]
CORRUPT = None
"""What ``take_any`` returns in place of a chunk whose payload failed its checksum."""
MAX_STEPS_AHEAD = 4
"""Steps past the live one whose chunks are taken. Every step's rounds need every
site, so a peer's rounds run at most a step or two ahead of ours; 1,500 chunks for
far-future steps once took a rank from 0.65 to 2.2 GB, never released (issue 14)."""
MAX_ABORTS = 1024  # given-up rounds noted at once (a step has a few hundred at most)
MAX_REASON = 512  # characters of a peer's reason kept for the log


class Mailbox:
    """Thread-safe store of received chunks keyed by :data:`MailboxKey`; it also notes
    the rounds a peer gave up, so that this site's part of them fails at once.

    Keeps the keys ever deposited for the live steps, with the payload checksum each
    first copy declared, so a chunk is stored at most once: another payload under a
    key already seen is refused even after it was taken, and an exact copy (same key,
    same declared checksum: a sender sending again what a stalled connection may have
    delivered) is acknowledged and dropped. A step floor refuses chunks of finished
    rounds. Once a round has set the floor, chunks of steps ``max_ahead`` or more past
    it are refused; and the payload bytes waiting never exceed ``max_bytes`` (None:
    unbounded).
    """

    def __init__(self, max_bytes: int | None = None, max_ahead: int = MAX_STEPS_AHEAD) -> None:
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
        if max_ahead < 1:
            raise ValueError(f"max_ahead must be >= 1, got {max_ahead}")
        self.max_bytes, self.max_ahead = max_bytes, max_ahead
        self._cond = threading.Condition()
        self._items: dict[MailboxKey, Chunk | None] = {}
        self._seen: dict[MailboxKey, int] = {}  # key -> its first copy's declared crc32
        self._corrupt: set[MailboxKey] = set()  # marked, not yet replaced by a resend
        self._floor = 0
        self._live = False  # a round set the floor (after a clear, none has yet)
        self._bytes = 0
        # (step, group) -> (site, why): rounds a peer gave up in this generation.
        self._aborts: dict[tuple[int, int], tuple[int, str]] = {}
        self.handoffs = Handoffs()
        """Nonces of what this rank asked of peers (chunks again, bulk tickets), where
        the lane puts what their lanes hand back (inter/data/lane/handoff.py)."""

    def deposit(self, key: MailboxKey, item: Chunk) -> str | None:
        """Stores ``item``; returns None, "again" (an exact copy of a chunk this key
        already had: nothing stored, the sender may be told it arrived), or why it was
        refused: "duplicate" (another payload under a key already seen), "stale",
        "ahead" (a step too far past the live one) or "full" (over the byte budget)."""
        return self._admit(key, item, item.crc32)

    def mark_corrupt(self, key: MailboxKey, crc32: int | None = None) -> str | None:
        """Leaves a :data:`CORRUPT` marker for ``key``, whose copy declared ``crc32``
        (None: unknown, never "again"); same answers as ``deposit``."""
        return self._admit(key, CORRUPT, crc32)

    def _outside_locked(self, step: int) -> str | None:
        """ "stale" or "ahead" when ``step`` is outside the live window, else None."""
        if step < self._floor:
            return "stale"
        if self._live and step >= self._floor + self.max_ahead:
            return "ahead"
        return None

    def _admit(self, key: MailboxKey, item: Chunk | None, crc32: int | None) -> str | None:
        with self._cond:
            outside = self._outside_locked(key[0])
            if outside is not None:
                return outside
            if key in self._seen:
                return "again" if crc32 is not None and self._seen[key] == crc32 else "duplicate"
            size = _size(item)
            if self.max_bytes is not None and self._bytes + size > self.max_bytes:
                return "full"
            self._seen[key] = -1 if crc32 is None else crc32
            if item is CORRUPT:
                self._corrupt.add(key)
            self._items[key] = item
            self._bytes += size
            self._cond.notify_all()
            return None

    def note_abort(self, step: int, group: int, site: int, reason: str) -> str | None:
        """Notes that ``site`` gave up round (step, group): :meth:`aborted` tells the
        round, which then fails at once. Returns None, or why the note was refused:
        "stale" (a finished step), "ahead" (a step too far past the live one) or "full"
        (:data:`MAX_ABORTS` rounds noted). The first site's note stands."""
        with self._cond:
            outside = self._outside_locked(step)
            if outside is not None:
                return outside
            if (step, group) in self._aborts:
                return None
            if len(self._aborts) >= MAX_ABORTS:
                return "full"
            self._aborts[(step, group)] = (site, reason[:MAX_REASON])
            self._cond.notify_all()
            return None

    def aborted(self, step: int, group: int) -> tuple[int, str] | None:
        with self._cond:
            return self._aborts.get((step, group))

    def redeposit(self, key: MailboxKey, item: Chunk) -> bool:
        """Stores the resent copy of a chunk marked corrupt; False if none was marked."""
        with self._cond:
            if key not in self._corrupt or key[0] < self._floor:
                return False
            self._corrupt.discard(key)
            # A pulled copy the round asked for: taken even over the budget.
            self._bytes += _size(item) - _size(self._items.get(key))
            self._items[key] = item
            self._cond.notify_all()
            return True

    def take(self, key: MailboxKey, timeout: float) -> Chunk | None:
        """Waits up to ``timeout`` seconds for ``key``, removes and returns it
        (:data:`CORRUPT` for a chunk that failed its checksum); TimeoutError if none came."""
        found = self.take_any((key,), timeout)
        if found is None:
            raise TimeoutError(f"no chunk {key} within {timeout:.3f}s")
        return found[1]

    def take_any(
        self, keys: Iterable[MailboxKey], timeout: float
    ) -> tuple[MailboxKey, Chunk | None] | None:
        """Waits up to ``timeout`` seconds for any of ``keys``; removes and returns it
        (:data:`CORRUPT` for a chunk that failed its checksum: the caller pulls it again
        and it comes back through :meth:`redeposit`)."""
        wanted = keys if isinstance(keys, (set, frozenset, dict)) else set(keys)
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while True:
                for key in self._items:  # the mailbox is usually the smaller side
                    if key in wanted:
                        item = self._items.pop(key)
                        self._bytes -= _size(item)
                        return key, item
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def discard_before(self, step: int) -> int:
        """Drops everything of steps before ``step`` (returns how many unclaimed chunks)
        and refuses them from now on."""
        with self._cond:
            self._floor = max(self._floor, step)
            self._live = True
            stale = [k for k in self._items if k[0] < step]
            for key in stale:
                self._bytes -= _size(self._items.pop(key))
            self._seen = {k: v for k, v in self._seen.items() if k[0] >= step}
            self._corrupt = {k for k in self._corrupt if k[0] >= step}
            self._aborts = {k: v for k, v in self._aborts.items() if k[0] >= step}
            return len(stale)

    def clear(self) -> None:
        """Forgets everything (a new membership generation starts over)."""
        with self._cond:
            self._items.clear()
            self._seen.clear()
            self._corrupt.clear()
            self._aborts.clear()
            self._floor, self._live, self._bytes = 0, False, 0

    def keys(self) -> list[MailboxKey]:
        with self._cond:
            return list(self._items)

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def snapshot(self) -> tuple[dict, dict[MailboxKey, int], set[MailboxKey], int, bool]:
        """One consistent copy of its items, replay guard (key: the first copy's declared
        crc32), corrupt keys, floor, and whether a round set that floor."""
        with self._cond:
            return dict(self._items), dict(self._seen), set(self._corrupt), self._floor, self._live

    @property
    def floor(self) -> int:
        with self._cond:
            return self._floor

    @property
    def waiting_bytes(self) -> int:
        with self._cond:
            return self._bytes


def _size(item: Chunk | None) -> int:
    return len(item.payload) if item is not None else 0


NONCE_BYTES = 32
MAX_WAITING = 256
"""Nonces a lane keeps at once: a round pulls a few chunks again, a peer's bulk
connections ask for a few tickets; the oldest go first."""
NONCE_TTL_S = 120.0  # a nonce older than this is forgotten: nothing answers that late


class HandoffPeer(Protocol):
    """The calls a lane makes to a peer's lane to hand something over (``LanePeer``)."""

    address: str

    def deliver(self, frame: Frame | bytes, nonce: bytes, timeout: float) -> None: ...

    def grant_bulk(self, request: lane_pb2.GrantBulkRequest, timeout: float) -> None: ...


class Handoffs:
    """Nonces this rank made for what it asked of peers, and what came back for them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        # nonce -> (what was asked, when, what came back or None)
        self._waiting: dict[bytes, tuple[object, float, object]] = {}

    def expect(self, what: object) -> bytes:
        """A new nonce for a request of ``what`` (compared with what comes back)."""
        nonce = os.urandom(NONCE_BYTES)
        now = time.monotonic()
        with self._cond:
            for old in [n for n, v in self._waiting.items() if now - v[1] > NONCE_TTL_S]:
                del self._waiting[old]
            while len(self._waiting) >= MAX_WAITING:
                del self._waiting[next(iter(self._waiting))]
            self._waiting[nonce] = (what, now, None)
        return nonce

    def deliver(self, nonce: bytes, what: object, item: object) -> bool:
        """Takes ``item`` if ``nonce`` is one of ours, asked for ``what`` and not yet
        answered; False otherwise (nothing changes)."""
        with self._cond:
            found = self._waiting.get(nonce)
            if found is None or found[0] != what or found[2] is not None:
                return False
            self._waiting[nonce] = (found[0], found[1], item)
            self._cond.notify_all()
            return True

    def made(self, nonce: bytes, what: object) -> bool:
        with self._cond:
            found = self._waiting.get(nonce)
            return found is not None and found[0] == what

    def forget(self, nonce: bytes) -> None:
        with self._cond:
            self._waiting.pop(nonce, None)

    def collect(self, nonce: bytes, timeout: float) -> object:
        """What came back for ``nonce`` within ``timeout`` seconds (forgets the nonce),
        or None."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = self._waiting.get(nonce)
                if found is None:
                    return None
                if found[2] is not None or time.monotonic() >= deadline:
                    del self._waiting[nonce]
                    return found[2]
                self._cond.wait(max(0.0, deadline - time.monotonic()))

    def __len__(self) -> int:
        with self._cond:
            return len(self._waiting)


class Outbox:
    """Thread-safe store of the chunks this site sent, by :data:`OutboxKey`, and of the
    peer lanes this site's rounds talk to.

    A receiver may ask for a chunk again after this site's round returned (its copy
    failed the checksum), so chunks stay until :meth:`discard_before` drops their step.
    A chunk asked for again goes to the lane it was first sent to, never to the caller.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[OutboxKey, tuple[Frame | bytes, dict[int, HandoffPeer]]] = {}
        self._peers: dict[int, dict[str, HandoffPeer]] = {}  # site -> address -> lane

    def meet(self, peers: Mapping[int, HandoffPeer]) -> None:
        with self._lock:
            for site, peer in peers.items():
                self._peers.setdefault(site, {})[peer.address] = peer

    def peers_of(self, site: int) -> list[HandoffPeer]:
        with self._lock:
            return list(self._peers.get(site, {}).values())

    def put(
        self, key: OutboxKey, item: Frame | bytes, recipients: Mapping[int, HandoffPeer]
    ) -> None:
        """Keeps ``item`` (the chunk as sent, or its serialized ``PushChunksRequest``) for the
        sites in ``recipients``, each with the lane it was sent to."""
        with self._lock:
            self._items[key] = (item, dict(recipients))

    def get(self, key: OutboxKey, site: int) -> tuple[Frame | bytes, HandoffPeer] | None:
        """The chunk and the lane it went to, if it was sent to ``site``; else None."""
        with self._lock:
            found = self._items.get(key)
        if found is None or site not in found[1]:
            return None
        return found[0], found[1][site]

    def discard_before(self, step: int) -> None:
        with self._lock:
            self._items = {k: v for k, v in self._items.items() if k[0] >= step}

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._peers.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
