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
  and kind of refusal a minute, at most ``lines`` lines a minute in all, and a summary
  line of the refusals it did not log: a stall is never silent, a flood never floods
  the log. A caller is its host (a flood opens connection after connection, each with
  its own port), and a kind is the reason without its numbers and quoted names.
* Per caller (issue 33, row 9: a flood of re-polls took steps/s from 1.28 to 0.62 on
  two cores, the refused polls answered at once and asked again in a tight loop): a
  caller — what it claims to be (a site, a rank) at its host — holds at most ``share``
  of the slots, so a flood cannot take those of the ranks that train, and
  :class:`RePolls` paces the polls it gets answered at once: past a burst and a rate,
  such a poll is held a moment before its answer (a bounded number at a time, each on
  a thread the pool keeps for it) or refused with RESOURCE_EXHAUSTED at once, before it
  touches any state. Held, a flooding thread costs no CPU; measured on `isthmus local`
  (2 sites x 1 rank, tiny model, 2 shared cores, 12 flooding threads per coordinator):
  steps/s 5.3-7.6 alone -> 2.2-2.7 flooded before, 5.7 alone -> 6.0-6.2 flooded after.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import grpc
from grpc_health.v1 import health

__all__ = [
    "HEALTH_WATCHES",
    "BoundedHealth",
    "RePolls",
    "RefusalLog",
    "WaitSlots",
    "peer_host",
    "pool_size",
]

log = logging.getLogger("isthmus.bounds")

HEALTH_WATCHES = 2
"""Health ``Watch`` streams a server keeps open at once (probes use ``Check``)."""
_ANSWER_AT_ONCE = 4
"""Threads a server keeps for calls that answer without waiting."""
_MAX_CALLERS = 1024  # callers remembered (the oldest forgotten first)
_VARIABLE = re.compile(r"\d+|'[^']*'|\"[^\"]*\"")  # numbers and quoted names


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string: "ipv4:127.0.0.1:5555" -> "127.0.0.1",
    "ipv6:[::1]:5555" -> "[::1]"; anything else as it is."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in rest:
        return rest.rsplit(":", 1)[0]
    host, colon, port = peer.rpartition(":")
    if colon and port.isdigit() and kind not in ("unix", "unix-abstract"):
        return host  # "127.0.0.1:5555", as a socket's address is often written
    return peer


def pool_size(waiters: int) -> int:
    """Handler threads for a server whose legitimate callers may hold ``waiters``
    waiting calls at once: those, the health watches, and room for the rest."""
    return max(1, waiters) + HEALTH_WATCHES + _ANSWER_AT_ONCE


class RefusalLog:
    """Logs refusals with the caller's address, boundedly, and counts them all.

    A refusal is logged once per (caller host, kind) per ``window_s``, with how many of
    that kind the host had so far, and at most ``lines`` refusals are logged per window
    in all; the rest are counted, and when the window ends (at the next refusal, or on
    a thread every log of the process shares) one line says how many were not logged,
    from how many hosts, and which host sent the most. The kind is ``reason`` with its
    numbers and quoted names left out; the line carries ``reason`` and ``detail`` whole,
    so ``detail`` is the place for an exception's text or a name a caller chose.
    ``where`` names the server in each line ("coordinator of site0").
    """

    def __init__(
        self,
        where: str,
        *,
        lines: int = 20,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lines < 1 or window_s <= 0:
            raise ValueError(f"lines must be >= 1 and window_s > 0; got {lines}, {window_s}")
        self.where, self.lines, self.window_s = where, lines, window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], tuple[float | None, int]] = {}  # logged last, how many
        self._began: float | None = None  # when this window began (None: no window)
        self._logged = 0  # refusals logged in this window
        self._unlogged: dict[str, int] = {}  # host -> refusals not logged in this window
        self._overflow = 0  # of those, from hosts past the first _MAX_CALLERS
        self.count = 0  # refusals so far, logged or not

    def note(self, peer: str, reason: str, detail: str = "") -> None:
        """Counts a refusal from ``peer`` (``context.peer()``, or "HOST:PORT"), and logs it
        unless the bounds above say otherwise. ``reason`` stays the same words for the
        same refusal (numbers and quoted names may vary)."""
        now = self._clock()
        host = peer_host(peer)
        key = (host, _VARIABLE.sub("#", reason))
        with self._lock:
            self.count += 1
            summary = self._roll_locked(now)
            if self._began is None:
                self._began = now
                _SUMMARIES.due(self, self.window_s)
            last, times = self._seen.pop(key, (None, 0))
            times += 1
            loud = (last is None or now - last >= self.window_s) and self._logged < self.lines
            self._seen[key] = (now if loud else last, times)  # most recently seen last
            while len(self._seen) > _MAX_CALLERS:
                del self._seen[next(iter(self._seen))]
            if loud:
                self._logged += 1
            elif host in self._unlogged or len(self._unlogged) < _MAX_CALLERS:
                self._unlogged[host] = self._unlogged.get(host, 0) + 1
            else:
                self._overflow += 1
        if summary:
            log.warning("%s", summary)
        if loud:
            said = f"{reason}: {detail}" if detail else reason
            suffix = f" ({times} from {host} so far)" if times > 1 else ""
            log.warning("%s: %s from %s%s", self.where, said, peer, suffix)

    def flush(self) -> None:
        """Writes the summary of a window that has ended, if it has one."""
        with self._lock:
            summary = self._roll_locked(self._clock())
        if summary:
            log.warning("%s", summary)

    def _roll_locked(self, now: float) -> str:
        """Ends the window if ``window_s`` has passed; returns its summary ("": none)."""
        if self._began is None or now - self._began < self.window_s:
            return ""
        took, by_host, overflow = now - self._began, self._unlogged, self._overflow
        self._began, self._logged, self._unlogged, self._overflow = None, 0, {}, 0
        if not by_host:
            return ""
        unlogged = sum(by_host.values()) + overflow
        hosts = f"{len(by_host)}{'+' if overflow else ''} host(s)"
        host, most = max(by_host.items(), key=lambda kv: kv[1])
        return (
            f"{self.where}: {unlogged} refusal(s) from {hosts} not logged in the last "
            f"{took:.0f} s (most from {host}: {most})"
        )


class _Summaries:
    """One thread for every :class:`RefusalLog` of the process: writes a log's summary
    when its window ends, though no refusal comes after to write it. The thread starts
    at the first window and sleeps while no window is open."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, weakref.ref[RefusalLog]]] = []  # a heap
        self._order = itertools.count()  # ties broken by order, never by the weakref
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        os.register_at_fork(after_in_child=self._forget_thread)

    def _forget_thread(self) -> None:  # a forked child has the heap but not the thread
        self._cond, self._thread = threading.Condition(), None

    def due(self, refusals: RefusalLog, after_s: float) -> None:
        """``refusals.flush()`` runs ``after_s`` seconds from now (a little later)."""
        with self._cond:
            at = time.monotonic() + after_s + 0.05  # just past the window's end
            heapq.heappush(self._due, (at, next(self._order), weakref.ref(refusals)))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="refusal-summaries", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._cond.wait(self._due[0][0] - time.monotonic() if self._due else None)
                refusals = heapq.heappop(self._due)[2]()
            if refusals is not None:
                refusals.flush()


_SUMMARIES = _Summaries()


class RePolls:
    """Paces a caller's polls that were answered at once (no slot for them to wait in).

    A caller may be answered at once ``burst`` times, then ``per_s`` times a second
    (a token bucket); a poll beyond that is held ``hold_s`` before its answer, so a
    client that asks again as soon as it is answered asks ``1 / hold_s`` times a
    second instead of as fast as the CPU goes. At most ``holds`` polls are held at
    once (each holds a thread the server keeps: ``pool_size``); one that finds none free
    is refused at once.
    """

    def __init__(
        self,
        *,
        per_s: float = 5.0,
        burst: int = 20,
        hold_s: float = 1.0,
        holds: int = 16,
        clock=time.monotonic,
    ) -> None:
        if per_s <= 0 or burst < 1 or hold_s < 0 or holds < 0:
            raise ValueError(
                f"per_s, burst, hold_s, holds must be > 0, >= 1, >= 0, >= 0; got "
                f"{per_s}, {burst}, {hold_s}, {holds}"
            )
        self.per_s, self.burst, self.hold_s, self.holds = per_s, burst, hold_s, holds
        self._clock = clock
        self._tokens: dict[str, tuple[float, float]] = {}  # caller -> (tokens, at)
        self._lock = threading.Lock()
        self._holding = threading.BoundedSemaphore(holds) if holds else None
        self._woken = threading.Event()

    def too_fast(self, caller: str) -> bool:
        """Takes one of ``caller``'s tokens; True when it had none left."""
        now = self._clock()
        with self._lock:
            tokens, at = self._tokens.pop(caller, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - at) * self.per_s)
            self._tokens[caller] = (max(0.0, tokens - 1.0), now)  # most recent last
            while len(self._tokens) > _MAX_CALLERS:
                del self._tokens[next(iter(self._tokens))]
        return tokens < 1.0

    def hold(self) -> bool:
        """Holds the calling thread ``hold_s``; False at once when ``holds`` are held."""
        if self._holding is None or not self._holding.acquire(blocking=False):
            return False
        try:
            self._woken.wait(self.hold_s)
        finally:
            self._holding.release()
        return True

    def release_all(self) -> None:
        """Ends every hold now (the server is stopping)."""
        self._woken.set()


class WaitSlots:
    """At most ``slots`` calls wait at once (see the module docstring); ``what`` names a
    slot in the refusal's log line ("long polls"), and ``repolls`` (if any) paces the
    callers answered at once."""

    def __init__(
        self, slots: int, what: str, refusals: RefusalLog, repolls: RePolls | None = None
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots, self.what, self.refusals, self.repolls = slots, what, refusals, repolls
        self._used = 0  # slots held now
        self._held: dict[str, int] = {}  # caller -> slots it holds
        # One lock, taken once a call each way: a semaphore behind it took a second lock
        # (its condition's), and 1,024 ranks' watches, answered together, queued on both
        # (docs/benchmarks/control-plane.md, "Real host agents, a process each").
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        with self._lock:
            return self.slots - self._used

    def _take(self, caller: str, share: int | None) -> str | None:
        """Takes a slot for ``caller`` (holding at most ``share``: None, any number);
        returns why not, or None."""
        with self._lock:
            if share is not None and self._held.get(caller, 0) >= share:
                return f"{caller} holds its {share} {self.what} slots"
            if self._used >= self.slots:
                return f"all {self.slots} {self.what} slots busy"
            self._used += 1
            self._held[caller] = self._held.get(caller, 0) + 1
            return None

    def _give(self, caller: str) -> None:
        with self._lock:
            left = self._held.pop(caller) - 1
            if left:
                self._held[caller] = left
            self._used -= 1

    @contextlib.contextmanager
    def wait(
        self,
        context: grpc.ServicerContext,
        caller: str = "",
        share: int | None = None,
        *,
        paced: bool = True,
    ) -> Iterator[bool]:
        """Yields True with a slot held for the block, or False (answer at once). The
        caller is what the call claims to be ("site0 rank 1") at its host, holding at
        most ``share`` slots; ``paced``: ``repolls`` paces it (not a rank that proved its key)."""
        peer = context.peer()
        who = f"{caller or 'a caller'} at {peer_host(peer)}"
        busy = self._take(who, self.slots if share is None else share)
        held = busy is None
        if not held:
            self.refusals.note(peer, f"{busy}; answered at once")
            repolls = self.repolls if paced else None
            if repolls is not None and repolls.too_fast(who) and not repolls.hold():
                why = f"{who} re-polls faster than {repolls.per_s:g}/s"
                self.refusals.note(peer, why)
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
        try:
            yield held
        finally:
            if held:
                self._give(who)

    def hold_for_stream(
        self, context: grpc.ServicerContext, caller: str = "", share: int | None = None
    ) -> None:
        """Takes a slot until the call ends, or refuses it with RESOURCE_EXHAUSTED;
        ``caller`` is who holds the stream as the server knows it ("" for anyone)."""
        who = caller or "a caller"
        busy = self._take(who, share)
        release = functools.partial(self._give, who)
        if busy is not None:
            self.refusals.note(context.peer(), busy)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, busy)
        context.add_callback(release)


class BoundedHealth(health.HealthServicer):
    """grpc.health.v1 with at most :data:`HEALTH_WATCHES` ``Watch`` streams open."""

    def __init__(self, refusals: RefusalLog) -> None:
        super().__init__()
        self._watches = WaitSlots(HEALTH_WATCHES, "health watch", refusals)

    def Watch(self, request, context, send_response_callback=None):  # noqa: N802
        self._watches.hold_for_stream(context)
        return super().Watch(request, context, send_response_callback)
