"""The state a site's coordinator shares among its pieces, changed by named transitions.

The RPC handlers, the failover loop, the leader, the peer loop and the admission rule all
read and change one membership, and what the site knows of its peers and of itself.
:class:`CoordinatorState` owns it, and every change is one of its named transitions, so
each can be tested on its own and a reader finds in one file what moves the membership
(the partition scenario once deadlocked in code that wrote it from four modules). The
votes and decisions are :class:`~isthmus.inter.control.ballots.Ballots`'s, under the same lock.

Locking: one re-entrant condition, ``CoordinatorState.cond``, guards all of it. A
``_locked`` method must be called with it held; every other takes it itself. A view reads
one field without it (a single read is atomic); a caller that needs several fields to
agree holds ``cond``. Every transition but ``heard_from_locked`` (a timestamp) wakes the
waiters on ``cond``. The ranks' long polls wait for their own news instead
(inter/control/wakeups.py): :attr:`CoordinatorState.membership_news`, and a vote for the
decision on its key (``Ballots.decision_event_locked``).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from isthmus.inter.control.abort import JobAbort
from isthmus.inter.control.arrivals import ArrivalDeadlines
from isthmus.inter.control.incarnations import Incarnations
from isthmus.inter.control.join_claims import JoinClaims
from isthmus.inter.control.replicas import ReplicaDigests
from isthmus.inter.control.settings import CoordinatorSettings
from isthmus.inter.control.wakeups import Broadcast, KeyedWakeups
from isthmus.proto import coordinator_pb2 as pb

__all__ = ["Adoption", "CoordinatorState", "Key"]

log = logging.getLogger("isthmus.inter.control.coordinator")
failover_log = logging.getLogger("isthmus.inter.control.failover")

Key = tuple[int, int]
"""(step, generation): what a vote and a decision are about."""
T = TypeVar("T")


class _Read(Generic[T]):
    """A read-only view of the field ``_<name>`` (through ``copy``, for what is mutable)."""

    def __init__(self, copy: Callable[[Any], T] | None = None) -> None:
        self._copy = copy

    def __set_name__(self, owner: type, name: str) -> None:
        self._field = "_" + name

    def __get__(self, obj: object, owner: type | None = None) -> T:
        value = getattr(obj, self._field)
        return value if self._copy is None else self._copy(value)


class Adoption(enum.Enum):
    """What :meth:`CoordinatorState.adopt_generation_locked` did."""

    STALE = "stale"
    """Not newer than the current generation: ignored (generations only move forward)."""
    ADOPTED = "adopted"
    READMITTED = "readmitted"
    """Adopted by a site the job had left out: it pulls the state from another member."""


class CoordinatorState:
    """The membership of one site's coordinator and the transitions that change it; every
    time in here is read from ``clock`` (seconds, monotonic)."""

    def __init__(
        self, settings: CoordinatorSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.site, self.site_names = settings.site, list(settings.site_names)
        self.index, self.ranks, self.peers = settings.index, settings.ranks, settings.peers
        self.failure_timeout_s = settings.failure_timeout_s
        self.clock = clock
        self.arrivals = ArrivalDeadlines(
            period_s=settings.heartbeat_s, ceiling_s=settings.failure_timeout_s, clock=clock
        )
        self.address = ""  # where the coordinator listens, once its server is bound
        self.cond = threading.Condition(threading.RLock())
        self.stopped = threading.Event()  # the site left: loops end, long polls answer
        self.started_at: float | None = None
        self._error: str | None = None
        self._generation = self._start_step = self._committed_steps = self._step = 0
        self._members: list[str] = []
        self._state_source = ""
        self._joining = self._excluded = self._finished = False
        self._lanes: list[str | None] = [None] * self.ranks
        self._ready_sites: dict[str, pb.SiteInfo] = {}
        self._told_ready: set[str] = set()
        self._restarted: set[str] = set()
        self._asked_to_join: set[str] = set()
        self._digest: tuple[int, str] = (0, "")
        self._peer_steps: dict[str, int] = {}
        self._finished_peers: set[str] = set()
        self._finished_claims: dict[str, str] = {}
        self.incarnations = Incarnations()  # guarded by ``cond``
        self.replicas = ReplicaDigests(self.site)  # its own lock
        self.join_claims = JoinClaims()  # until each peer's own answer settles them
        self.abort = JobAbort(self.site, self.peers, clock)  # its own lock
        self.membership_news = Broadcast()
        """Published (under ``cond``) when what a ``GetMembership`` long poll waits for
        may have changed: the generation, joining, the error, a stop, the suspects."""
        self.decision_news: KeyedWakeups[Key] = KeyedWakeups()
        """Published (under ``cond``) per (step, generation) decided, for the votes
        waiting on it (``Ballots``); every key on a stop or a readmission."""

    # Views: read-only, a copy of what is mutable.
    error: _Read[str | None] = _Read()  # why the job cannot go on, or None
    generation: _Read[int] = _Read()  # 0 until every site is present and ready
    members: _Read[list[str]] = _Read(list)
    """The sites of the current generation, in index order."""
    start_step: _Read[int] = _Read()  # a joining site's first step,
    state_source: _Read[str] = _Read()  # and the member it pulls the state from
    joining: _Read[bool] = _Read()  # this site asks a running job to admit it
    excluded: _Read[bool] = _Read()  # the job went on without this site
    lanes: _Read[list[str | None]] = _Read(list)
    """The lane address each local rank registered (None: not yet)."""
    ready_sites: _Read[Mapping[str, pb.SiteInfo]] = _Read(MappingProxyType)
    """Peers that said they are ready, with their SiteInfo."""
    told_ready: _Read[frozenset[str]] = _Read(frozenset)
    """Peers this site told, in a join, that it is ready."""
    restarted: _Read[frozenset[str]] = _Read(frozenset)
    """Members seen joining afresh: their earlier incarnation is dead."""
    committed_steps: _Read[int] = _Read()
    """Steps this site has committed: the next step it runs."""
    asked_to_join: _Read[frozenset[str]] = _Read(frozenset)
    """Sites whose join of the running job awaits their answer at their own address."""
    step: _Read[int] = _Read()  # the step this site's ranks last reported
    finished: _Read[bool] = _Read()  # this site's ranks ran their last step
    digest: _Read[tuple[int, str]] = _Read()  # (step, digest): rank 0's latest
    peer_steps: _Read[Mapping[str, int]] = _Read(MappingProxyType)
    """The step each peer last said it runs, in its own answer."""
    finished_peers: _Read[frozenset[str]] = _Read(frozenset)
    """Peers that said in their own answer (at their address) that they ran their last step."""
    finished_claims: _Read[frozenset[str]] = _Read(frozenset)
    """Peers that a heartbeat in their name said finished, not yet asked: anyone with
    the token can send one (issue 63: one stopped a restarting site for good)."""

    @property
    def last_seen(self) -> Mapping[str, float]:  # when each peer was last heard from
        return self.arrivals.last_heard()

    @property
    def running(self) -> bool:
        """A member of a running job: a generation exists and this site is in it."""
        return self._generation > 0 and not self._joining

    def seconds_since_start(self) -> float:
        """How long ago the coordinator started (0 before it did)."""
        started = self.started_at
        return 0.0 if started is None else self.clock() - started

    def local_ready_locked(self) -> bool:  # every local rank registered its lane
        return all(self._lanes)

    def own_info_locked(self) -> pb.SiteInfo:
        """This site's SiteInfo: its lanes ("" for a rank not yet registered)."""
        lanes = [lane or "" for lane in self._lanes]
        return pb.SiteInfo(
            name=self.site, index=self.index, lane_addresses=lanes, coordinator_address=self.address
        )

    def infos_locked(
        self, names: Iterable[str], extra: Mapping[str, pb.SiteInfo] | None = None
    ) -> list[pb.SiteInfo]:
        """The SiteInfo of ``names`` (ready peers, this site, and ``extra`` such as joiners
        being admitted), in index order."""
        infos = {**self._ready_sites, **(extra or {}), self.site: self.own_info_locked()}
        return sorted((infos[n] for n in names if n in infos), key=lambda info: info.index)

    def suspects_locked(self) -> list[str]:
        """Members other than this site silent past their deadline (``arrivals``: at most
        the failure timeout), and members that restarted (their old incarnation is gone)."""
        started = self.started_at if self.started_at is not None else self.clock()
        return [
            m
            for m in self._members
            if m != self.site and (m in self._restarted or self.arrivals.silent(m, started))
        ]

    def await_membership(self, known_generation: int, deadline: float) -> None:
        """Waits until ``deadline`` (on :attr:`clock`) for a generation past
        ``known_generation``, an error, a stop, or (for a caller that knows a generation)
        a member fallen silent: what a ``GetMembership`` long poll waits for."""
        while True:
            with self.cond:
                if (
                    self._error is not None
                    or self.stopped.is_set()
                    or self._generation > known_generation
                    or (known_generation and self.suspects_locked())
                ):
                    return
                left = deadline - self.clock()
                if left <= 0:
                    return
                news = self.membership_news.event()
            news.wait(left)

    def mark_started(self) -> None:
        """The coordinator started: silence is counted from now, and the join timeout."""
        with self.cond:
            self.started_at = self.clock()

    def register_lane_locked(self, rank: int, address: str) -> None:
        """Local ``rank`` serves its lane at ``address``; the last one may form generation 1."""
        self._lanes[rank] = address
        self._form_first_generation_locked()
        self.cond.notify_all()

    def lose_ranks_locked(self, reason: str) -> None:
        """A rank of this site died, and its torch.distributed world with it: the site comes
        back as a restarted one would (a new incarnation, no lanes, left out until admitted)."""
        self._lanes = [None] * self.ranks
        self.incarnations.renew()
        self.exclude_locked(reason)
        self.decision_news.publish_all()

    def admit_locked(self, info: pb.SiteInfo) -> bool:
        """A peer said it is ready; the first SiteInfo stands (a new generation brings newer
        ones). Returns whether it was news. The last ready peer may form generation 1."""
        if info.name not in self.peers:
            raise ValueError(f"{info.name[:64]!r} is not a peer of {self.site}")
        news = info.name not in self._ready_sites
        if news:
            self._ready_sites[info.name] = info
        self._form_first_generation_locked()
        self.cond.notify_all()
        return news

    def mark_told_ready_locked(self, name: str) -> None:
        """This site told peer ``name``, in a join, that it is ready."""
        self._told_ready.add(name)
        self.cond.notify_all()

    def doubt_locked(self, name: str) -> None:
        """A call in peer ``name``'s name said it is ready: settled with ``name`` itself, at
        its address. This site joins it again and admits the SiteInfo of its answer."""
        if name in self.peers and name not in self._ready_sites:
            self._told_ready.discard(name)
            self.cond.notify_all()

    def await_admission_locked(self, generation: int) -> bool:
        """A peer answered a first join with ``generation``: the job runs without this
        site, which now waits to be admitted by its leader. Returns whether that is news."""
        if self._generation != 0 or self._joining or generation <= 0:
            return False
        log.info("[%s] the job is running (generation %d): asking to join", self.site, generation)
        self._joining = True
        self.membership_news.publish()
        self.cond.notify_all()
        return True

    def exclude_locked(self, reason: str) -> bool:
        """The job went on without this site (``reason``): it is left out and asks to be
        admitted again (idempotent). Returns whether it was news."""
        news = not self._excluded
        if news:
            log.warning("[%s] %s: joining again", self.site, reason)
        self._excluded = self._joining = True
        self.membership_news.publish()
        self.cond.notify_all()
        return news

    def suspect_locked(self, name: str) -> None:
        """Member ``name`` restarted: suspect it now, not after the failure timeout, until
        a generation takes it back in."""
        self._restarted.add(name)
        self.cond.notify_all()

    def heard_from_locked(self, name: str) -> None:
        """A call or an answer of peer ``name`` arrived (wakes nobody: silence is timed)."""
        self.arrivals.heard(name)

    def heartbeat_locked(self, name: str, finished: bool, caller: str) -> None:
        """A heartbeat in peer ``name``'s name from ``caller`` counts as hearing from it
        (docs/security.md); its progress is a claim: "finished" is kept to be asked of
        ``name`` itself (``peer_progress_locked`` settles it), and its step is not taken."""
        self.arrivals.heard(name)
        if finished and name in self.peers and name not in self._finished_peers:
            self._finished_claims[name] = caller[:128]  # one a peer: the latest caller
        self.cond.notify_all()  # a peer's news: waiters re-check

    def peer_progress_locked(self, name: str, step: int, finished: bool) -> str | None:
        """Peer ``name``'s own answer, at its configured address: it runs ``step`` (and
        whether it finished). Settles a claim that it finished; returns the caller of a
        claim its answer belies, else None."""
        self.arrivals.heard(name)
        self._peer_steps[name] = step
        claimed = self._finished_claims.pop(name, None)
        if finished:
            self._finished_peers.add(name)
        self.cond.notify_all()  # a peer's progress: waiters re-check
        return claimed if claimed is not None and not finished else None

    def report_progress_locked(
        self, step: int, finished: bool, digest_step: int, digest: str
    ) -> None:
        """This site's ranks report ``step`` (and its digest, if any); finished stays so."""
        self._step = step
        self._finished = self._finished or finished
        if digest:
            self._digest = (digest_step, digest)

    def ask_to_join_locked(self, name: str) -> None:
        """``name`` asked to join the running job; settled by its answer at its address."""
        self._asked_to_join.add(name)

    def settle_join_locked(self, name: str) -> None:
        """``name``'s own answer settled its join (it waits to be admitted, or not)."""
        self._asked_to_join.discard(name)

    def commit_locked(self, step: int) -> None:
        """``step`` committed: this site runs the steps after it."""
        self._committed_steps = max(self._committed_steps, step + 1)
        self.cond.notify_all()

    def adopt_generation_locked(
        self,
        generation: int,
        sites: Sequence[pb.SiteInfo],
        *,
        start_step: int,
        state_source: str,
        leader: str,
    ) -> Adoption:
        """Move to ``generation`` with the members ``sites`` (proposed or decided by
        ``leader``), which a site joining starts at ``start_step`` with the state of
        ``state_source``. An older or equal generation is ignored. Clears ``joining``
        and ``excluded``; a member that restarted is trusted again in its new incarnation."""
        if generation <= self._generation:
            return Adoption.STALE
        left_out = self._excluded
        for info in sites:
            if info.name != self.site:
                self._ready_sites[info.name] = info
                self.arrivals.expect(info.name)
        self._generation = generation
        self._members = [info.name for info in sites]
        self._start_step = start_step
        self._state_source = state_source
        self._joining = self._excluded = False
        self._restarted -= set(self._members)
        failover_log.info(
            "[%s] membership generation %d from %s: %s (from step %d)",
            self.site,
            generation,
            leader,
            ", ".join(self._members),
            start_step,
        )
        readmitted = left_out and self.site in self._members and state_source not in ("", self.site)
        if readmitted:
            self._committed_steps = start_step  # the state it pulls has these steps applied
        self.membership_news.publish()
        self.cond.notify_all()
        return Adoption.READMITTED if readmitted else Adoption.ADOPTED

    def fail(self, message: str) -> None:
        """The job cannot go on (the first reason stands); waiters hear it at once."""
        with self.cond:
            if self._error is None:
                self._error = message
                log.error("[%s] %s", self.site, message)
            self.membership_news.publish()
            self.cond.notify_all()

    def stop(self) -> None:
        """The site leaves: loops end and long polls answer."""
        self.stopped.set()
        self.wake()

    def wake(self) -> None:
        """Wake every waiter on news kept outside this state (a grant of the witness)."""
        with self.cond:
            self.membership_news.publish()
            self.decision_news.publish_all()
            self.cond.notify_all()

    def _form_first_generation_locked(self) -> None:
        """Generation 1, once every local rank and every peer is ready (and this site
        is not joining a job that runs already)."""
        if (
            self._generation == 0
            and not self._joining
            and self.local_ready_locked()
            and set(self._ready_sites) == self.peers
        ):
            self._generation = 1
            self._members = list(self.site_names)
            self.membership_news.publish()
            log.info("[%s] membership generation 1: %s", self.site, ", ".join(self.site_names))
