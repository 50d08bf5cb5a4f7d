"""A rank's side of the job's membership: it votes on every step and follows generations.

A membership is one value, a :class:`Generation` (its number and its member sites);
:meth:`SiteMembership.adopt` is the one call that moves a rank to another: it opens the
lanes of the new members, closes those of sites gone and moves the rank's lane server
(which checks every incoming chunk against the generation).

:class:`SiteMembership` talks only to its own site's coordinator (site-local): it
votes on each step's rounds (``CommitStep``, a long poll answered with the job's
decision). A watcher thread asks the coordinator which members fell silent and raises
the rank's abort signal (a round that waits on a silent site fails then), so a dead
site costs the failure timeout, not the round's.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from isthmus.inter.control.coordinator_client import (
    CoordinatorClient,
    Decision,
    SiteInfo,
    Verdict,
)
from isthmus.inter.data.lane.peer import LanePeer
from isthmus.inter.data.lane.server import LaneServer
from isthmus.inter.data.round.context import AbortSignal, Members

__all__ = ["Generation", "QuorumLost", "SiteMembership"]

log = logging.getLogger(__name__)

_VOTE_WAIT_MS = 2_000
_RPC_SLACK_S = 5.0
_WATCH_WAIT_MS = 5_000
"""A watch is answered at once on news (a suspect, a generation), so its wait is only
how often it asks again: a rank killed mid-watch ends it at once (its connection
closes), and the coordinator holds a watch half its silence at most (5 s of the 10 s
default). At 1 s a site's watches were 1,024 calls a second at 1,024 ranks, most of what
voting per rank cost (docs/benchmarks/control-plane.md, "Real host agents, a process each")."""


class QuorumLost(RuntimeError):
    """This site cannot go on: the decision was STOP (its reason is the message)."""


class _NamesGeneration(Protocol):
    """What names a generation: the membership a rank first learns, a decision, a watch."""

    @property
    def generation(self) -> int: ...
    @property
    def sites(self) -> Sequence[SiteInfo]: ...


@dataclass(frozen=True, slots=True)
class Generation:
    """One generation of the job's membership, as a rank adopts it whole: its number
    (> 0; every chunk of its rounds carries it) and the member sites by index, each with
    its ranks' lane addresses."""

    number: int
    sites: tuple[SiteInfo, ...]

    def __post_init__(self) -> None:
        if self.number < 1:
            raise ValueError(f"a generation's number must be >= 1, got {self.number}")
        names = self.names
        if len(set(names)) != len(names):
            raise ValueError(f"generation {self.number} names a site twice: {names}")

    @classmethod
    def of(cls, source: _NamesGeneration) -> Generation:
        return cls(source.generation, tuple(source.sites))

    @property
    def names(self) -> list[str]:
        return [info.name for info in self.sites]

    def members(self, site: str) -> Members:
        """The lane server's view of this generation from member ``site`` (ValueError if
        not a member)."""
        names = self.names
        if site not in names:
            raise ValueError(f"{site} is not a member of generation {self.number}: {names}")
        return Members(self.number, names.index(site), len(names), tuple(names))


class SiteMembership:
    """One rank's membership client. ``lane`` is moved to each new generation;
    ``make_peer(info, rank)`` builds the lane client of a peer site's rank (proxy, TLS,
    chunk size); ``joined`` is adopted here; the watcher asks for silent members every
    ``watch_s``."""

    def __init__(
        self,
        *,
        client: CoordinatorClient,
        site: str,
        rank: int,
        lane: LaneServer,
        make_peer: Callable[[SiteInfo, int], LanePeer],
        joined: Generation,
        decision_timeout_s: float = 300.0,
        watch_s: float = 0.25,
    ) -> None:
        joined.members(site)  # a one-line refusal before anything starts
        self.client = client
        self.site = site
        self.rank = rank
        self.lane = lane
        self.make_peer = make_peer
        self.abort = AbortSignal()
        """Raised to fail the running rounds at once (a round failed, or the watcher found
        a member silent or left out of a newer generation); lowered by each generation."""
        self.decision_timeout_s = decision_timeout_s
        self.watch_s = watch_s
        self._current = joined
        self._peers: dict[tuple[str, str], LanePeer] = {}
        self._same_rank: dict[int, LanePeer] = {}
        self._peers_lock = threading.Lock()  # rounds of several groups open peers at once
        self._stop = threading.Event()
        self.poll: grpc.Future | None = None  # the watcher's long poll, for close()
        self._poll_lock = threading.Lock()
        self.adopt(joined)
        self.watcher = threading.Thread(target=self._watch, name="membership-watch", daemon=True)
        self.watcher.start()

    @property
    def current(self) -> Generation:
        return self._current

    @property
    def generation(self) -> int:
        return self._current.number

    @property
    def sites(self) -> tuple[SiteInfo, ...]:
        return self._current.sites

    @property
    def member_names(self) -> list[str]:
        return self._current.names

    @property
    def members(self) -> Members:
        """The lane's view of the generation the rank is in (rounds run under it)."""
        return self.lane.members

    def peers(self) -> dict[int, LanePeer]:
        """The lane of this rank at every other member site, by site index."""
        return self._same_rank

    def first_ranks(self) -> dict[int, LanePeer]:
        """The lane of every other member site's rank 0 (this rank is its site's)."""
        me = self.members.site_index
        return {s: self.peer(s, 0) for s in range(len(self.sites)) if s != me}

    def weight(self, units: dict[str, int]) -> float | None:
        """This site's weight in the members' mean, by each site's ``units`` (tokens);
        None when they count alike."""
        if not units or len({units[n] for n in self.member_names}) == 1:
            return None
        shares = [units[n] for n in self.member_names]
        return shares[self.members.site_index] * len(shares) / sum(shares)

    def follow(self, decision: Decision, step: int) -> Decision | None:
        """After ``step``'s COMMIT: adopts the generation it names (a site was
        admitted); returns it when this site is to offer the joiner its state."""
        if decision.generation == self.generation:
            return None
        self.adopt(Generation.of(decision))
        if decision.state_source == self.site and decision.state_step == step:
            return decision
        return None

    def adopt(self, generation: Generation) -> None:
        """Moves the rank to ``generation`` (between rounds): the one place it changes.
        ValueError if this site is not a member (nothing changes then)."""
        members = generation.members(self.site)
        # The lanes of other ranks (sites of different sizes) are opened on first use;
        # those of sites or addresses no longer members close here.
        live = {(info.name, a) for info in generation.sites for a in info.lane_addresses}
        with self._peers_lock:
            for key in [k for k in self._peers if k not in live]:
                self._peers.pop(key).close()
        self._current = generation
        # The same rank; a smaller site has no such rank, but between sites of different
        # sizes every round names its own peers (GradientSync's pieces), so this default
        # is never used there.
        self._same_rank = {
            i: self.peer(i, self.rank % len(info.lane_addresses))
            for i, info in enumerate(generation.sites)
            if info.name != self.site
        }
        self.lane.set_members(members)
        self.abort.clear()
        names = ", ".join(generation.names)
        log.info("[%s/%d] generation %d: %s", self.site, self.rank, generation.number, names)

    def site_ranks(self) -> list[int]:
        return [len(info.lane_addresses) for info in self.sites]

    def peer(self, site_index: int, rank: int) -> LanePeer:
        """The lane client of ``rank`` at member site ``site_index`` (opened once;
        keyed by address too: a restarted site's lanes listen somewhere new)."""
        info = self._current.sites[site_index]
        key = (info.name, info.lane_addresses[rank])
        with self._peers_lock:
            if key not in self._peers:
                self._peers[key] = self.make_peer(info, rank)
            return self._peers[key]

    def vote(self, step: int, ok: bool) -> Decision:
        """Votes on ``step``'s rounds; returns the job's decision (never PENDING).
        QuorumLost if none came within ``decision_timeout_s``."""
        deadline = time.monotonic() + self.decision_timeout_s
        while time.monotonic() < deadline:
            try:
                decision = self.client.commit_step(
                    site=self.site,
                    rank=self.rank,
                    step=step,
                    generation=self.generation,
                    ok=ok,
                    wait_ms=_VOTE_WAIT_MS,
                    timeout_s=_VOTE_WAIT_MS / 1000 + _RPC_SLACK_S,
                )
            except grpc.RpcError as exc:
                if exc.code() in (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.FAILED_PRECONDITION,
                ):
                    raise QuorumLost(f"vote on step {step} refused: {exc.details()}") from exc
                time.sleep(0.2)
                continue
            except TimeoutError:  # the vote's stream went silent; the next vote opens another
                continue
            if decision.verdict != Verdict.PENDING:
                return decision
        raise QuorumLost(
            f"[{self.site}/{self.rank}] no decision on step {step} after "
            f"{self.decision_timeout_s:.0f}s"
        )

    def vote_ahead(self, step: int, generation: int) -> None:
        """Casts this rank's "ok" on ``step``'s rounds, run in ``generation``, without
        waiting for the decision: for a round that lands steps after it ended (an outer
        round with a delay), the :meth:`vote` at landing then finds the decision made.
        Best effort: that :meth:`vote` votes again (an "ok" counts once)."""
        try:
            self.client.commit_step(
                site=self.site,
                rank=self.rank,
                step=step,
                generation=generation,
                ok=True,
                wait_ms=0,
                timeout_s=_RPC_SLACK_S,
            )
        except grpc.RpcError as exc:
            log.debug("[%s/%d] early vote on step %d: %s", self.site, self.rank, step, exc)

    def _watch(self) -> None:
        # A long poll: the coordinator answers at once when a member falls silent or
        # the generation moves, else after _WATCH_WAIT_MS (`close` cancels it).
        while not self._stop.is_set():
            try:
                reply = self.client.membership_now(
                    known_generation=self.generation,
                    # Spread: a site's ranks start together, and watches that asked the
                    # same wait came back together for good, 1,024 at once.
                    wait_ms=int(_WATCH_WAIT_MS * random.uniform(0.75, 1.0)),
                    timeout_s=_WATCH_WAIT_MS / 1000 + _RPC_SLACK_S,
                    on_call=self._hold_poll,
                )
            except grpc.FutureCancelledError:
                return  # closed
            except grpc.RpcError:
                self._stop.wait(self.watch_s)
                continue
            silent = [s for s in reply.suspects if s in self.member_names and s != self.site]
            # The job went on without a member while this rank's round still waits on
            # it: once out of the membership it is no suspect any more, and the round
            # would wait out sync.timeout_s (a 3-site kill-leader run took 120 s).
            left = []
            if reply.generation > self.generation and reply.sites:
                newer = {info.name for info in reply.sites}
                left = [s for s in self.member_names if s not in newer]
            if silent or left:
                self.abort.set(
                    f"site(s) {', '.join(silent)} fell silent"
                    if silent
                    else f"generation {reply.generation} went on without {', '.join(left)}"
                )
            if silent or reply.generation != self.generation:
                # Answered at once and would be again (a member still silent, or the
                # coordinator in a generation this rank has not moved to): pace the asking.
                self._stop.wait(self.watch_s)

    def _hold_poll(self, call: grpc.Future) -> None:
        with self._poll_lock:
            self.poll = call
            if self._stop.is_set():
                call.cancel()

    def close(self) -> None:
        """Stops the watcher and closes the peers' channels."""
        self._stop.set()
        # End the long poll now: waiting it out cost every rank up to 1 s at the end of a job.
        with self._poll_lock:
            if self.poll is not None:
                self.poll.cancel()
        self.watcher.join(timeout=_WATCH_WAIT_MS / 1000 + _RPC_SLACK_S)
        with self._peers_lock:
            for peer in self._peers.values():
                peer.close()
            self._peers.clear()
