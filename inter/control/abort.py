"""A job-level abort: a user's script raised in one rank, so the job stops at every site.

A rank whose script raised tells its own coordinator (``AbortJob``, site-local, with the
rank's key). Its peers learn it from that site's answers to their own heartbeats and
joins (``HeartbeatResponse.aborted``), at its own address, as every claim about a site
is settled (docs/design.md, invariant 7): no call sent to a site can stop it. The
aborting site keeps answering until every live peer has heard it (:meth:`JobAbort.wait_told`),
then its launcher stops.

Only a script's own error aborts the job: a rank killed by a signal, or a site lost to
the network, is failover's (the job goes on at the sites still alive).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

__all__ = ["MAX_ABORT_CHARS", "MAX_REASON_CHARS", "JobAbort", "abort_problem"]

log = logging.getLogger("isthmus.inter.control.coordinator")

MAX_REASON_CHARS = 512
"""Longest error line a rank may report (a traceback's last line, trimmed by the rank)."""
MAX_ABORT_CHARS = MAX_REASON_CHARS + 128
"""Longest abort a peer's answer may carry: the reason and "SITE rank R: " before it."""


def abort_problem(reason: str) -> str | None:
    """Why ``reason`` cannot be an abort's error line, or None."""
    if not 1 <= len(reason) <= MAX_REASON_CHARS:
        return f"reason must have 1 to {MAX_REASON_CHARS} characters, got {len(reason)}"
    if not reason.isprintable():
        return "reason must be one printable line"
    return None


class JobAbort:
    """What one site knows of the job's abort (thread-safe); ``wait_told``'s deadline is
    read on ``clock``."""

    def __init__(self, site: str, peers: Iterable[str], clock: Callable[[], float]) -> None:
        self.site = site
        self.peers = frozenset(peers)
        self._clock = clock
        self._cond = threading.Condition()
        self._line: str | None = None
        self._source: str | None = None
        self._told: set[str] = set()

    @property
    def line(self) -> str | None:
        """ "SITE rank R: LINE" once the job is aborted (here or at a peer), else None."""
        return self._line

    @property
    def here(self) -> bool:
        """The abort came from one of this site's ranks."""
        return self._source == self.site

    def raise_here(self, rank: int, reason: str) -> bool:
        """A local rank's script raised; False when the job was aborted already (the
        first abort stands)."""
        return self._set(f"{self.site} rank {rank}: {reason}", self.site)

    def learn(self, peer: str, line: str) -> bool:
        """``peer`` answered that a script raised there; False (nothing changes) when
        the line is empty, malformed, or not about ``peer`` itself."""
        if not line or peer not in self.peers:
            return False
        if len(line) > MAX_ABORT_CHARS or not line.isprintable():
            log.warning("[%s] %s answered an abort that is not one short line", self.site, peer)
            return False
        if not line.startswith(f"{peer} rank "):  # a site speaks for its own ranks only
            log.warning("[%s] %s answered an abort in another site's name", self.site, peer)
            return False
        return self._set(line, peer)

    def _set(self, line: str, source: str) -> bool:
        with self._cond:
            if self._line is not None:
                return False
            self._line, self._source = line, source
            self._cond.notify_all()
        log.error("[%s] the job stops at every site: %s", self.site, line)
        return True

    def answer_for(self, peer: str) -> str:
        """What an answer to ``peer`` carries: this site's abort, or "". A peer given it
        has heard it."""
        with self._cond:
            if not self.here or peer not in self.peers:
                return ""
            self._told.add(peer)
            self._cond.notify_all()
            return self._line or ""

    def wait_told(self, peers: Iterable[str], timeout_s: float) -> list[str]:
        """Waits until each of ``peers`` has been answered with this site's abort, at
        most ``timeout_s``; returns those that were not (sorted)."""
        wanted = set(peers) & self.peers
        deadline = self._clock() + timeout_s
        with self._cond:
            while True:
                missing = sorted(wanted - self._told)
                left = deadline - self._clock()
                if not missing or left <= 0:
                    return missing
                # Short waits: the clock may be a test's, which no notify follows.
                self._cond.wait(min(left, 0.1))
