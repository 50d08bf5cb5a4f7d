"""Whether a site's own ranks are alive: a rank that stops beating is declared dead.

A rank of a site that dies while its coordinator lives (a node lost under ``srun``
without ``--kill-on-bad-exit``) left the job waiting for its vote until
``sync.timeout_s + failover.quorum_wait_s``. Every rank already beats: its membership
watcher (inter/data/sync/membership.py), a thread of its own, long-polls
``GetMembership`` with the rank's key without pause while the main thread computes,
saves or collects garbage. So a rank with a poll in flight is alive, and one with none in
flight for longer than ``silence_s`` (``failure_timeout_s``: what makes a peer site a
suspect makes a rank dead) is not. A host agent's poll names the ranks whose watches it
holds (``vouched_rank_keys``): each counts as that rank's poll in flight. A rank's vote,
its own or in its agent's batch, is a beat too.

Silence is measured on the coordinator's own time (inter/control/vouches.py,
``OwnTime``): a check of the ranks' silence that runs late (a coordinator starved of
CPU, or whose failover loop waited on a peer) counts the lateness as time it was away
and declares no one until it has looked again on time, so neither a late agent nor a
late coordinator is taken for a dead rank; a rank whose agent polls without it, or falls
silent with it (a node lost), is.

A rank is watched from its first watcher poll (``known_generation`` > 0) until it
registers again: a test's or a tool's rank that runs no watcher is never declared dead.
The failover loop makes the site leave the job until all its ranks are back
(docs/reliability.md, "A rank that dies while its coordinator lives").
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

from isthmus.inter.control.vouches import OwnTime

__all__ = ["CHECK_S", "RankLiveness", "beating_ranks"]

CHECK_S = 0.25
"""How often the ranks' silence is checked (each check walks the ranks with no poll in
flight); a check more than ``vouches.LATE_S`` later than that was late."""


MAX_VOUCHED = 256
"""Ranks one poll may vouch for: a host's, as many as one ``CommitHostStep`` votes for."""


@dataclass(slots=True)
class _Rank:
    watched: bool = False
    """It sent a watcher poll since it last registered."""
    calls: int = 0
    """Its polls in flight now."""
    last: float = 0.0
    """When a poll of it last arrived or ended (on the coordinator's own time)."""


class RankLiveness:
    """When each local rank was last heard from (thread-safe; its own lock, so the
    ranks' polls never wait on the state's condition for it). A watched rank with no poll
    in flight for longer than ``silence_s`` of the coordinator's own time is dead;
    :meth:`silent` is called every ``check_s``."""

    def __init__(
        self,
        ranks: int,
        silence_s: float,
        clock: Callable[[], float],
        check_s: float = CHECK_S,
    ) -> None:
        if silence_s <= 0 or check_s <= 0:
            raise ValueError(f"silence_s and check_s must be > 0, got {silence_s}, {check_s}")
        self.silence_s = silence_s
        self.check_s = check_s
        self.time = OwnTime(clock)  # the clock less the time its checks ran late
        self._ranks = [_Rank() for _ in range(ranks)]
        self._quiet: set[int] = set()  # watched ranks with no poll in flight
        self._checked: float | None = None  # own time of the last check
        self._lock = threading.Lock()
        self.left_for: str | None = None
        """Why the site left the job (its ranks were declared dead), until every rank
        registered again; set and cleared by the failover loop and RegisterRank under
        the state's condition."""

    def registered(self, rank: int) -> None:
        """``rank`` registered (again): a new process, not watched until it polls."""
        with self._lock:
            self._ranks[rank] = _Rank()
            self._quiet.discard(rank)

    @contextlib.contextmanager
    def polling(
        self,
        ranks: Collection[int],
        *,
        watcher: bool,
        ended_by: Callable[[Callable[[], None]], object] | None = None,
    ) -> Iterator[None]:
        """A poll of each of ``ranks`` is in flight inside the block (a rank's own, or its
        host agent's for it: inter/control/host_agent.py); ``watcher``: it is the
        watcher's (the ranks are watched from now on). ``ended_by`` (the call's
        ``add_callback``) ends the beat when the call ends before the block does: an
        agent cancels its poll when a rank it vouched for falls silent, and the handler
        waits on until its deadline."""
        if not ranks:
            yield
            return
        with self._lock:
            beats = [self._ranks[rank] for rank in ranks]
            now = self.time.now()
            for rank, beat in zip(ranks, beats, strict=True):
                beat.watched = beat.watched or watcher
                beat.calls += 1
                beat.last = now
                self._quiet.discard(rank)
        ended = False

        def end() -> None:
            nonlocal ended
            with self._lock:
                if ended:
                    return
                ended = True
                now = self.time.now()
                for rank, beat in zip(ranks, beats, strict=True):
                    beat.calls -= 1
                    beat.last = now
                    if beat.calls == 0 and beat.watched and self._ranks[rank] is beat:
                        self._quiet.add(rank)

        if ended_by is not None:
            ended_by(end)
        try:
            yield
        finally:
            end()

    def voted(self, ranks: Collection[int]) -> None:
        """A vote of each of ``ranks`` came now (its own, or in its host agent's batch):
        as good a beat as a poll. An agent late to poll again (its host starved of CPU)
        that still sends its ranks' votes does not have them declared dead; a rank that
        neither votes nor is vouched for is."""
        with self._lock:
            now = self.time.now()
            for rank in ranks:
                beat = self._ranks[rank]
                if beat.watched and beat.calls == 0:
                    beat.last = max(beat.last, now)

    def silent(self) -> list[int]:
        """The watched ranks with no poll in flight for longer than ``silence_s`` of the
        coordinator's own time; none when this check itself runs late (more than
        ``LATE_S`` after ``check_s``): its lateness is the coordinator's, and the polls
        that waited meanwhile are counted before anyone is judged."""
        with self._lock:
            checked, self._checked = self._checked, self.time.now()
            if checked is not None and not self.time.on_time(checked + self.check_s):
                self._checked = self.time.now()
                return []
            now = self._checked
            return sorted(
                rank
                for rank in self._quiet
                if self._ranks[rank].calls == 0 and now - self._ranks[rank].last > self.silence_s
            )

    def watched(self) -> list[int]:
        """The ranks that sent a watcher poll since they last registered."""
        with self._lock:
            return [rank for rank, beat in enumerate(self._ranks) if beat.watched]

    def forget(self) -> None:
        """Watch no rank until it polls again (the site left: its ranks start anew)."""
        with self._lock:
            for beat in self._ranks:
                beat.watched = False
            self._quiet.clear()


def beating_ranks(
    own: int | None, vouched_keys: Sequence[str], rank_of: Callable[[str], int | None]
) -> set[int]:
    """The ranks one ``GetMembership`` poll beats for: the caller's own (``own``, from its
    key; None for a caller that is no rank) and those whose keys it vouches for;
    ``ValueError`` when one that is no rank's vouches, or vouches for over ``MAX_VOUCHED``."""
    if not vouched_keys:
        return set() if own is None else {own}
    if own is None or len(vouched_keys) > MAX_VOUCHED:
        raise ValueError(
            f"a poll vouches for at most {MAX_VOUCHED} ranks, and only with a rank's own key"
        )
    vouched = {rank_of(key) for key in vouched_keys}
    return {own} | {rank for rank in vouched if rank is not None}
