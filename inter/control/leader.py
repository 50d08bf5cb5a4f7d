"""The leader site's decisions on a step: commit, retry without silent sites, admit
joiners, stop without quorum, and take over from a leader that fell silent.

A :class:`Leader` runs only at the leader (the lowest-index member still heard from);
:class:`~isthmus.inter.control.failover.Failover` holds one and calls it (that module's
docstring says the protocol). The state's condition guards everything here too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from isthmus.inter.control.ballots import Ballots
from isthmus.inter.control.state import Adoption, CoordinatorState, Key
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from isthmus.inter.control.witness import WitnessLink

__all__ = ["Leader", "has_quorum"]

log = logging.getLogger("isthmus.inter.control.failover")


def has_quorum(alive: Iterable[str], site_names: list[str], *, tie_break: bool = True) -> bool:
    """True when ``alive`` may go on: a majority of the job's sites, or exactly half
    of them including the job's first site (the tie-breaker of an even split) unless
    ``tie_break`` is off: a job with a witness (inter/control/witness.py) asks it instead."""
    alive = set(alive) & set(site_names)
    total = len(site_names)
    half_with_first = 2 * len(alive) == total and site_names[0] in alive
    return 2 * len(alive) > total or (tie_break and half_with_first)


_Vote = tuple[bool, frozenset[str]]
"""A site's vote on a step: ok, and the sites it suspects."""


@dataclass(kw_only=True, frozen=True, slots=True)
class _Change:
    """A new generation the leader proposes for a step."""

    members: list[str]  # the current generation's
    new_members: list[str]  # the proposed generation's
    joiners: list[str] | None
    """The sites it admits (the step then commits in it); None: it drops failed or
    silent members and the step is retried."""
    source: str  # the site the joiners copy the state from ("" when none join)
    start: int  # the first step of the proposed generation


@dataclass(eq=False, kw_only=True)
class Leader:
    """Decisions taken at the leader site; ``state``'s condition guards this object too."""

    state: CoordinatorState
    ballots: Ballots  # shared with failover
    peer_stub: Callable[[str], pb_grpc.CoordinatorStub]  # a peer's, by name
    rpc_timeout_s: float  # deadline of each Propose
    witness: WitnessLink | None
    """The job's witness, if it has one: a side holding exactly half the sites goes on
    only with its grant."""
    min_sites: int  # never go on with fewer live sites
    quorum_wait_s: float  # how long a leader without quorum waits before it decides STOP
    proposing: dict[int, list[str]] = field(default_factory=dict, init=False)
    """generation -> members, while this site proposes it (asked by the members)."""
    _deciding: set[Key] = field(default_factory=set, init=False)
    _stuck: tuple[int, float] | None = field(default=None, init=False)
    """(generation, since when) it has had no quorum; a new generation starts afresh."""
    _highest_generation: int = field(default=0, init=False)
    """The highest generation any proposal answer named: a retried proposal goes above
    it, so a site that accepted a failed attempt is not asked the same number."""

    def _busy_locked(self, key: Key) -> bool:
        """``key`` is decided, being decided, or of a generation this site has left."""
        b = self.ballots
        return key in b.decisions or key in self._deciding or key[1] != self.state.generation

    def _ordered(self, names: Iterable[str]) -> list[str]:
        return sorted(set(names), key=self.state.site_names.index)

    def evaluate(self, key: Key) -> None:
        """As leader, decide (step, generation) if its votes or the suspects allow."""
        st = self.state
        with st.cond:
            if self._busy_locked(key):
                return
            # Leader only because the generation's leader fell silent: take over
            # first, so a COMMIT it gave out before dying is honoured.
            members = st.members
            old_leader = members[0] if members and members[0] != st.site else None
        if old_leader is not None:
            self.takeover(key, old_leader)
            return
        with st.cond:
            if self._busy_locked(key):
                return
            change = self._commit_or_plan_locked(key)
            if change is None:
                return
            self._deciding.add(key)
            proposal = self._proposal_locked(key, change.new_members, change.start, change.source)
        try:
            self._reconfigure(key, change, proposal)
        finally:
            with st.cond:
                self._deciding.discard(key)

    def _tally_locked(self, key: Key, members: list[str]) -> tuple[dict[str, _Vote], list[str]]:
        """The votes on ``key`` (this site's own once all its ranks voted) and the
        members not suspected by this site nor by any voter."""
        st, b = self.state, self.ballots
        votes = b.site_votes.get(key, {})
        suspects = set(st.suspects_locked())
        for _, theirs in votes.values():
            suspects |= theirs
        suspects.discard(st.site)
        alive = [m for m in members if m not in suspects]
        mine = b.rank_votes.get(key, {})
        own_ok = len(mine) == st.ranks and all(mine.values())
        if len(mine) == st.ranks:
            votes = {**votes, st.site: (own_ok, frozenset())}
        return votes, alive

    def _commit_or_plan_locked(self, key: Key) -> _Change | None:
        """Decide COMMIT when every member voted ok and nobody asks to join; else the
        new generation to propose (joiners admitted, or failed members dropped), or
        None while votes are missing or a quorum is not reached."""
        st, b = self.state, self.ballots
        step, generation = key
        members = st.members
        votes, alive = self._tally_locked(key, members)
        all_ok = all(m in votes and votes[m][0] for m in members)
        # Decide a retry once every member still heard from has voted: a dead
        # member is then dropped in one go instead of after a retry with it.
        failed = (any(not ok for ok, _ in votes.values()) or len(alive) < len(members)) and all(
            m in votes for m in alive
        )
        fresh = st.clock() - st.failure_timeout_s
        last_seen = st.last_seen
        joiners = [j for j in b.joiners if last_seen.get(j, 0.0) > fresh]
        if all_ok and not joiners:
            b.decide_locked(
                key,
                pb.Decision(
                    step=step,
                    verdict=pb.VERDICT_COMMIT,
                    generation=generation,
                    sites=b.sites_of_locked(members),
                ),
            )
            return None
        if all_ok:
            new_members = self._ordered(members + joiners)
            return _Change(
                members=members,
                new_members=new_members,
                joiners=joiners,
                source=st.site,
                start=step + 1,
            )
        if failed and self._quorum_ok_locked(key, alive):
            return _Change(members=members, new_members=alive, joiners=None, source="", start=step)
        return None  # waiting for votes, or for a quorum

    def _proposal_locked(
        self, key: Key, members: list[str], start: int, source: str
    ) -> pb.ProposeRequest:
        """The generation after ``key``'s (and ``_highest_generation``), of ``members``."""
        return pb.ProposeRequest(
            leader=self.state.site,
            generation=max(key[1], self._highest_generation) + 1,
            sites=self.ballots.sites_of_locked(members),
            start_step=start,
            state_source=source,
        )

    def _reconfigure(self, key: Key, change: _Change, proposal: pb.ProposeRequest) -> None:
        """Propose; once a quorum accepted it and this site adopted it, decide ``key``:
        COMMIT admitting the joiners, or RETRY without the dropped."""
        answers = self._propose_all(proposal)
        if not self._accepted_by_quorum(answers, proposal.generation):
            return
        with self.state.cond:
            if not self._adopt_own_locked(proposal):
                return
            decision = pb.Decision(step=key[0], generation=proposal.generation)
            decision.sites.extend(proposal.sites)
            if change.joiners is not None:
                decision.verdict = pb.VERDICT_COMMIT
                decision.state_source, decision.state_step = change.source, key[0]
                decision.reason = f"admits {', '.join(change.joiners)}"
                # The source's lanes serve its state to these sites' ranks only.
                decision.admitted.extend(change.joiners)
            else:
                gone = sorted(set(change.members) - set(change.new_members))
                decision.verdict = pb.VERDICT_RETRY
                decision.reason = f"without {', '.join(gone)}" if gone else "a round failed"
            self.ballots.decide_locked(key, decision)

    def _adopt_own_locked(self, proposal: pb.ProposeRequest) -> bool:
        """Adopt the generation this site proposed and a quorum accepted. False when this
        site moved past it meanwhile (another leader's proposal): generations only move
        forward, and a decision in the one it left would contradict the newer one."""
        adopted = self.ballots.adopt_locked(proposal)
        if adopted is Adoption.STALE:
            log.warning(
                "[%s] generation %d accepted, but this site is at %d already: no decision",
                self.state.site,
                proposal.generation,
                self.state.generation,
            )
        return adopted is not Adoption.STALE

    def _may_go_on(self, sites: list[str]) -> bool:
        """A quorum of the job's sites; with a witness, exactly half of them only with
        its grant (asked in the background: False until it answers)."""
        witness = self.witness
        if has_quorum(sites, self.state.site_names, tie_break=witness is None):
            return True
        return witness is not None and witness.granted(sites)

    def _quorum_ok_locked(self, key: Key, alive: list[str]) -> bool:
        """False while ``alive`` may not go on; after quorum_wait_s, decide STOP."""
        st = self.state
        if self._may_go_on(alive) and len(alive) >= self.min_sites:
            self._stuck = None
            return True
        now = st.clock()
        if self._stuck is None or self._stuck[0] != st.generation:
            self._stuck = (st.generation, now)
            log.warning(
                "[%s] no quorum: reaches %s of %s (min_sites %d); waiting up to %.0fs",
                st.site,
                alive,
                st.site_names,
                self.min_sites,
                self.quorum_wait_s,
            )
        if now - self._stuck[1] >= self.quorum_wait_s:
            self.ballots.decide_locked(
                key,
                pb.Decision(
                    step=key[0],
                    verdict=pb.VERDICT_STOP,
                    generation=st.generation,
                    reason=(
                        f"{st.site} lost quorum: it reaches {', '.join(alive)} of "
                        f"{', '.join(st.site_names)} (min_sites {self.min_sites}) and waited "
                        f"{self.quorum_wait_s:.0f}s; a side holding a quorum carries on"
                    ),
                ),
            )
        return False

    def _propose_all(self, request: pb.ProposeRequest) -> dict[str, pb.ProposeResponse]:
        """Propose to every other member in parallel; returns the answers received."""
        st, generation = self.state, request.generation
        targets = [info.name for info in request.sites if info.name != st.site]
        answers: dict[str, pb.ProposeResponse] = {}
        if not targets:
            return answers
        # Each member asks this site, at its own address, whether it proposes this
        # (failover.propose): a Propose in its name from anyone else is refused.
        with st.cond:
            self.proposing[generation] = [info.name for info in request.sites]
        with futures.ThreadPoolExecutor(len(targets)) as pool:
            calls = {
                name: pool.submit(self.peer_stub(name).Propose, request, timeout=self.rpc_timeout_s)
                for name in targets
            }
            for name, call in calls.items():
                try:
                    answers[name] = call.result()
                    self._highest_generation = max(
                        self._highest_generation, answers[name].generation
                    )
                except grpc.RpcError as exc:
                    log.warning("[%s] propose to %s: %s", st.site, name, exc.code().name)
        with st.cond:
            self.proposing.pop(generation, None)
        return answers

    def _accepted_by_quorum(self, answers: dict[str, pb.ProposeResponse], generation: int) -> bool:
        """True when the sites that accepted ``generation`` (this one included) hold a
        quorum. A refusal from a site already past it means the job went on without
        this site: it asks to be admitted again instead."""
        st = self.state
        accepted = [name for name, a in answers.items() if a.accepted] + [st.site]
        if self._may_go_on(accepted):
            return True
        with st.cond:
            if any(a.generation >= generation and not a.accepted for a in answers.values()):
                st.exclude_locked(f"generation {generation} refused by sites already past it")
        return False

    def takeover(self, key: Key, leader: str) -> None:
        """The leader fell silent and this site is next: form generation g+1 and decide
        the pending step so that any COMMIT the old leader gave out stands."""
        st, b, step = self.state, self.ballots, key[0]
        with st.cond:
            if self._busy_locked(key):
                return
            suspects = set(st.suspects_locked()) | {leader}
            alive = [m for m in st.members if m not in suspects]
            if not self._quorum_ok_locked(key, alive):
                return
            self._deciding.add(key)
            proposal = self._proposal_locked(key, alive, step, "")
        try:
            log.warning("[%s] leader %s is silent; taking over", st.site, leader)
            answers = self._propose_all(proposal)
            if not self._accepted_by_quorum(answers, proposal.generation):
                return
            with st.cond:
                committed = max(
                    [st.committed_steps] + [a.committed_steps for a in answers.values()]
                )
                if not self._adopt_own_locked(proposal):
                    return
                verdict = pb.VERDICT_COMMIT if committed > step else pb.VERDICT_RETRY
                why = f"{leader} fell silent"
                decision = pb.Decision(step=step, verdict=verdict, reason=why)
                decision.generation = proposal.generation
                decision.sites.extend(proposal.sites)
                b.decide_locked(key, decision)
        finally:
            with st.cond:
                self._deciding.discard(key)
