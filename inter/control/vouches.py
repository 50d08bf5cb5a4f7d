"""Which ranks a host agent vouches for, on a deadline measured against its own lag.

A host agent (inter/control/host_agent.py) names, in its one poll at the coordinator, the
ranks it hears from (``vouched_rank_keys``): each counts as that rank's poll in flight
(inter/control/rank_liveness.py), and a rank it stops naming is declared dead
``failure_timeout_s`` later. A rank is heard from while a watch of its is held here, and
for ``vouch_s`` after the last one ended: time for its watcher to send the next.

That time is the agent's to measure, and an agent starved of CPU measured it wrongly:
2 x 1,024 ranks' agents on 2 cores (issue 59) ran their timers seconds late while the
ranks' next watches sat unread in their sockets, dropped live ranks, and 6 were declared
dead. So the deadline runs on the agent's own time (:class:`OwnTime`): a check later than
``late_s`` after it was due counts the lateness as time the agent was away, drops no one,
and looks again ``late_s`` later, once what waited in its sockets was read. A rank's own
lateness is not excused (a watcher ``vouch_s`` late of the agent's time is dropped), and
a rank whose connection to the agent closed (its process ended) is forgotten at once.

:class:`AgentPoll` is that poll: it names the ranks vouched for, is held as long as the
coordinator holds it, and is sent again as soon as they change. Not thread-safe: the
agent uses both from its event loop alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from isthmus.inter.control.agent_upstream import REFUSED
from isthmus.proto import coordinator_pb2 as pb

__all__ = ["LATE_S", "AgentPoll", "OwnTime", "Vouches"]

log = logging.getLogger("isthmus.host_agent")

_AGENT_WAIT_MS = 10_000
"""How long the agent's own poll may be held: it is answered at once on news like a
rank's, so a longer wait costs nothing but the polls it saves (the coordinator holds a
poll that vouches half its silence at most)."""
_PACE_S = 0.25
"""After an answer that would come at once again (a suspect, no generation, an error):
the pause before the next poll."""
_RPC_SLACK_S = 5.0

LATE_S = 0.25
"""A check this much later than due was not on time: its owner was away (starved of CPU,
stopped); half a second later than the 0.25 s tick that judged ranks before."""


class OwnTime:
    """The time its owner was there to see: ``clock`` less the time its checks ran late
    (a check later than ``late_s`` is late; its lateness is time away)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, late_s: float = LATE_S) -> None:
        if late_s <= 0:
            raise ValueError(f"late_s must be > 0, got {late_s}")
        self._clock = clock
        self.late_s = late_s
        self.away_s = 0.0  # seconds its checks ran late, summed

    def now(self) -> float:
        return self._clock() - self.away_s

    def on_time(self, due: float) -> bool:
        """A check due at ``due`` (own time) runs now: whether it is on time. Late, the
        lateness is counted as time away (``now()`` moves back to ``due``)."""
        late = self.now() - due
        if late <= self.late_s:
            return True
        self.away_s += late
        return False


class Vouches:
    """The rank keys a host's agent vouches for: those with a watch held, and those
    whose last watch ended less than ``vouch_s`` of the agent's own time ago."""

    def __init__(
        self, vouch_s: float, clock: Callable[[], float] = time.monotonic, late_s: float = LATE_S
    ) -> None:
        if vouch_s <= 0:
            raise ValueError(f"vouch_s must be > 0, got {vouch_s}")
        self.vouch_s = vouch_s
        self.time = OwnTime(clock, late_s)
        self._held: dict[str, int] = {}  # key -> its watches held now
        self._ended: dict[str, float] = {}  # key -> own time its last watch ended (none held)
        self._not_before = float("-inf")  # after a late check: the next one, not sooner

    def hold(self, key: str) -> bool:
        """A watch of ``key`` arrived; True when ``key`` was not vouched for."""
        new = key not in self._held and key not in self._ended
        self._held[key] = self._held.get(key, 0) + 1
        self._ended.pop(key, None)
        return new

    def release(self, key: str) -> None:
        """A watch of ``key`` ended (answered, or cancelled by its rank)."""
        left = self._held.get(key, 0) - 1
        if left > 0:
            self._held[key] = left
            return
        self._held.pop(key, None)
        self._ended[key] = self.time.now()

    def forget(self, key: str) -> bool:
        """``key``'s rank is gone (its connection closed): it is vouched for no more, now
        (none of its watches held). True when it was."""
        if self._held.get(key):
            return False
        return self._ended.pop(key, None) is not None

    def keys(self) -> list[str]:
        """The keys vouched for, sorted (as a poll names them)."""
        return sorted([*self._held, *self._ended])

    def __len__(self) -> int:
        return len(self._held) + len(self._ended)

    def next_check(self) -> float | None:
        """When (own time) the next rank may be dropped; None when every one is held."""
        if not self._ended:
            return None
        return max(min(self._ended.values()) + self.vouch_s, self._not_before)

    def check(self, due: float) -> bool:
        """Runs the check that was due at ``due`` (own time, :meth:`next_check`): drops
        the keys past ``vouch_s``; True when it dropped one. A check that runs late
        drops none, and the next runs ``late_s`` later: the watches that waited in the
        agent's sockets while it was away are read first."""
        if not self.time.on_time(due):
            self._not_before = self.time.now() + self.time.late_s
            return False
        now = self.time.now()
        gone = [key for key, at in self._ended.items() if now - at >= self.vouch_s]
        for key in gone:
            del self._ended[key]
        return bool(gone)


class AgentPoll:
    """A host agent's one long poll at its coordinator, naming the ranks ``vouches``
    vouches for: sent when a rank is new or gone (:meth:`changed`), held as long as the
    coordinator holds it, and its answer, the host's membership (or a refusal), handed
    to ``on_news``. ``send(request, timeout_s, done)`` starts a poll that has ``cancel()``,
    ``cancelled()`` and ``result()``, and calls ``done(poll)`` on ``loop`` once it ended
    (agent_upstream.py's ``poll``).
    """

    def __init__(
        self,
        vouches: Vouches,
        loop: asyncio.AbstractEventLoop,
        send: Callable[[pb.GetMembershipRequest, float, Callable], Any],
        on_news: Callable[[], None],
        site: str,
    ) -> None:
        self._vouches, self._loop, self._send, self._on_news = vouches, loop, send, on_news
        self.site = site
        self.membership = pb.GetMembershipResponse()
        """The coordinator's latest answer (its sites kept from the last that named them)."""
        self.error: grpc.RpcError | None = None  # a refusal of the last poll (job failed)
        self.seen = False  # answered once: the agent answers its ranks' watches itself
        self.polls = 0
        self.keys: list[str] = []  # those the poll in flight (or the last) names
        self._known = 0
        self._poll: Any = None
        self._pacing: asyncio.TimerHandle | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self._expiry_due: float | None = None
        self._stopped = False

    def close(self) -> None:
        """Ends the poll in flight and the timers."""
        self._stopped = True
        for timer in (self._pacing, self._expiry):
            if timer is not None:
                timer.cancel()
        if self._poll is not None:
            self._poll.cancel()

    def arm_expiry(self) -> None:
        """The timer of the next check of the ranks vouched for (:meth:`_expire`)."""
        due = self._vouches.next_check()
        if due == self._expiry_due:
            return
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self._expiry_due = due
        if due is not None and not self._stopped:
            delay = max(0.0, due - self._vouches.time.now())
            self._expiry = self._loop.call_later(delay, self._expire, due)

    def _expire(self, due: float) -> None:
        self._expiry, self._expiry_due = None, None
        if self._vouches.check(due):
            self.changed()  # a rank fell silent: the poll names it no more
        self.arm_expiry()

    def changed(self) -> None:
        """Sends the agent's poll when none is in flight, or cancels the one in flight
        when it names other ranks than those to vouch for now (its end sends the next)."""
        if self._stopped or self._pacing is not None:
            return
        keys = self._vouches.keys()
        if self._poll is not None:
            # A poll that knows no generation is answered at once: the next names them.
            if self._known and keys != self.keys:
                self._poll.cancel()
            return
        if not keys:  # no rank watches: the next watch sends it
            return
        self.polls += 1
        known, self.keys = self._known, keys
        wait_ms = _AGENT_WAIT_MS if known else 0
        request = pb.GetMembershipRequest(known_generation=known, wait_ms=wait_ms, rank_key=keys[0])
        request.vouched_rank_keys.extend(keys)
        self._poll = self._send(request, _AGENT_WAIT_MS / 1000 + _RPC_SLACK_S, self._polled)

    def _polled(self, poll) -> None:
        """The agent's poll ended: its answer is the host's, and the next one goes."""
        if poll is not self._poll:
            return
        self._poll = None
        if self._stopped:
            return
        if poll.cancelled():  # the ranks it vouches for changed: ask again, naming them
            self.changed()
            return
        try:
            reply = poll.result()
        except grpc.RpcError as exc:
            refused = exc.code() in REFUSED
            self.error = exc if refused else None
            if refused:
                self.seen = True
                self._on_news()
            else:
                log.debug("%s host agent: membership poll failed: %s", self.site, exc)
            self._pace()
            return
        if reply.generation != self._known or reply.sites:
            if not reply.sites and reply.generation == self.membership.generation:
                reply.sites.extend(self.membership.sites)
            self.membership = reply
        else:
            del self.membership.suspects[:]
            self.membership.suspects.extend(reply.suspects)
        self.error = None
        self.seen = True
        self._on_news()
        self._known = reply.generation
        if reply.suspects or not self._known:
            self._pace()  # answered at once and would be again: pace it
        else:
            self.changed()

    def _pace(self) -> None:
        def resume() -> None:
            self._pacing = None
            self.changed()

        self._pacing = self._loop.call_later(_PACE_S, resume)
