"""The leader site's decisions on a step: commit, retry without silent sites, admit
joiners, stop without quorum, and take over from a leader that fell silent.

:class:`Leader` is the part of :class:`~isthmus.inter.control.failover.Failover` that runs
only at the leader (the lowest-index member still heard from); see that module's
docstring for the protocol. It shares Failover's state and the coordinator's
condition variable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent import futures
from typing import TYPE_CHECKING

import grpc

from isthmus.proto import coordinator_pb2 as pb

if TYPE_CHECKING:
    from isthmus.inter.control.coordinator import Coordinator

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


class Leader:
    """Decisions taken at the leader site (a base of ``Failover``)."""

    c: Coordinator
    failure_timeout_s: float
    min_sites: int
    quorum_wait_s: float
    committed_steps: int
    _site_votes: dict
    _rank_votes: dict
    _decisions: dict
    _joiners: dict
    _deciding: set
    _stuck_since: float | None
    _highest_generation: int
    proposing: dict[int, list[str]]

    def _evaluate(self, key: tuple[int, int]) -> None:
        """As leader, decide (step, generation) if its votes or the suspects allow."""
        c = self.c
        step, generation = key
        with c._cond:
            if key in self._decisions or key in self._deciding or generation != c._generation:
                return
            # Leader only because the generation's leader fell silent: take over
            # first, so a COMMIT it gave out before dying is honoured.
            old_leader = c.members[0] if c.members and c.members[0] != c.site else None
        if old_leader is not None:
            self._takeover(key, old_leader)
            return
        with c._cond:
            if key in self._decisions or key in self._deciding or generation != c._generation:
                return
            members = list(c.members)
            votes = self._site_votes.get(key, {})
            suspects = set(self.suspects_locked())
            for _, theirs in votes.values():
                suspects |= theirs
            suspects.discard(c.site)
            alive = [m for m in members if m not in suspects]
            mine = self._rank_votes.get(key, {})
            own_ok = len(mine) == c.ranks and all(mine.values())
            if len(mine) == c.ranks:
                votes = {**votes, c.site: (own_ok, frozenset())}
            all_ok = all(m in votes and votes[m][0] for m in members)
            # Decide a retry once every member still heard from has voted: a dead
            # member is then dropped in one go instead of after a retry with it.
            failed = (any(not ok for ok, _ in votes.values()) or len(alive) < len(members)) and all(
                m in votes for m in alive
            )
            fresh = time.monotonic() - self.failure_timeout_s
            joiners = [j for j, _ in self._joiners.items() if c.last_seen.get(j, 0.0) > fresh]
            if all_ok and not joiners:
                self._decide_locked(
                    key,
                    pb.Decision(
                        step=step,
                        verdict=pb.VERDICT_COMMIT,
                        generation=generation,
                        sites=self._sites_of(members),
                    ),
                )
                return
            if all_ok:
                new_members, source, start = self._ordered(members + joiners), c.site, step + 1
            elif failed:
                if not self._quorum_ok_locked(key, alive):
                    return
                new_members, source, start = alive, "", step
            else:
                return  # waiting for votes
            self._deciding.add(key)
            sites = self._sites_of(new_members)
            new_gen = max(generation, self._highest_generation) + 1
        try:
            answers = self._propose_all(new_gen, sites, start, source)
            if not self._accepted_by_quorum(answers, new_gen):
                return
            with c._cond:
                self._adopt_locked(new_gen, sites, start, source, c.site)
                if all_ok:
                    decision = pb.Decision(
                        step=step,
                        verdict=pb.VERDICT_COMMIT,
                        generation=new_gen,
                        sites=sites,
                        state_source=source,
                        state_step=step,
                        reason=f"admits {', '.join(joiners)}",
                    )
                else:
                    gone = sorted(set(members) - set(new_members))
                    decision = pb.Decision(
                        step=step,
                        verdict=pb.VERDICT_RETRY,
                        generation=new_gen,
                        sites=sites,
                        reason=f"without {', '.join(gone)}" if gone else "a round failed",
                    )
                self._decide_locked(key, decision)
        finally:
            with c._cond:
                self._deciding.discard(key)

    def _may_go_on(self, sites: list[str]) -> bool:
        """A quorum of the job's sites; with a witness, exactly half of them only with
        its grant (asked in the background: False until it answers)."""
        witness = self.c.witness
        if has_quorum(sites, self.c.site_names, tie_break=witness is None):
            return True
        return witness is not None and witness.granted(sites)

    def _quorum_ok_locked(self, key: tuple[int, int], alive: list[str]) -> bool:
        """False while ``alive`` may not go on; after quorum_wait_s, decide STOP."""
        c = self.c
        if self._may_go_on(alive) and len(alive) >= self.min_sites:
            self._stuck_since = None
            return True
        now = time.monotonic()
        if self._stuck_since is None:
            self._stuck_since = now
            log.warning(
                "[%s] no quorum: reaches %s of %s (min_sites %d); waiting up to %.0fs",
                c.site,
                alive,
                c.site_names,
                self.min_sites,
                self.quorum_wait_s,
            )
        if now - self._stuck_since >= self.quorum_wait_s:
            self._decide_locked(
                key,
                pb.Decision(
                    step=key[0],
                    verdict=pb.VERDICT_STOP,
                    generation=c._generation,
                    reason=(
                        f"{c.site} lost quorum: it reaches {', '.join(alive)} of "
                        f"{', '.join(c.site_names)} (min_sites {self.min_sites}) and waited "
                        f"{self.quorum_wait_s:.0f}s; a side holding a quorum carries on"
                    ),
                ),
            )
        return False

    def _propose_all(
        self, generation: int, sites: list[pb.SiteInfo], start: int, source: str
    ) -> dict[str, pb.ProposeResponse]:
        """Propose to every other member in parallel; returns the answers received."""
        c = self.c
        request = pb.ProposeRequest(
            leader=c.site, generation=generation, sites=sites, start_step=start, state_source=source
        )
        targets = [info.name for info in sites if info.name != c.site]
        answers: dict[str, pb.ProposeResponse] = {}
        if not targets:
            return answers
        # Each member asks this site, at its own address, whether it proposes this
        # (failover.propose): a Propose in its name from anyone else is refused.
        with c._cond:
            self.proposing[generation] = [info.name for info in sites]
        with futures.ThreadPoolExecutor(len(targets)) as pool:
            calls = {
                name: pool.submit(c.peer_stub(name).Propose, request, timeout=c.rpc_timeout_s)
                for name in targets
            }
            for name, call in calls.items():
                try:
                    answers[name] = call.result()
                    self._highest_generation = max(
                        self._highest_generation, answers[name].generation
                    )
                except grpc.RpcError as exc:
                    log.warning("[%s] propose to %s: %s", c.site, name, exc.code().name)
        with c._cond:
            self.proposing.pop(generation, None)
        return answers

    def _accepted_by_quorum(self, answers: dict[str, pb.ProposeResponse], generation: int) -> bool:
        """True when the sites that accepted ``generation`` (this one included) hold a
        quorum. A refusal from a site already past it means the job went on without
        this site: it asks to be admitted again instead."""
        c = self.c
        accepted = [name for name, a in answers.items() if a.accepted] + [c.site]
        if self._may_go_on(accepted):
            return True
        with c._cond:
            if any(a.generation >= generation and not a.accepted for a in answers.values()):
                log.warning(
                    "[%s] generation %d refused by sites already past it: joining again",
                    c.site,
                    generation,
                )
                c.excluded = c.joining = True
        return False

    def _takeover(self, key: tuple[int, int], leader: str) -> None:
        """The leader fell silent and this site is next: form generation g+1 and decide
        the pending step so that any COMMIT the old leader gave out stands."""
        c = self.c
        step, generation = key
        with c._cond:
            if key in self._decisions or key in self._deciding or generation != c._generation:
                return
            suspects = set(self.suspects_locked()) | {leader}
            alive = [m for m in c.members if m not in suspects]
            if not self._quorum_ok_locked(key, alive):
                return
            self._deciding.add(key)
            sites = self._sites_of(alive)
            new_gen = max(generation, self._highest_generation) + 1
        try:
            log.warning("[%s] leader %s is silent; taking over", c.site, leader)
            answers = self._propose_all(new_gen, sites, step, "")
            if not self._accepted_by_quorum(answers, new_gen):
                return
            with c._cond:
                committed = max(
                    [self.committed_steps] + [a.committed_steps for a in answers.values()]
                )
                self._adopt_locked(new_gen, sites, step, "", c.site)
                verdict = pb.VERDICT_COMMIT if committed > step else pb.VERDICT_RETRY
                self._decide_locked(
                    key,
                    pb.Decision(
                        step=step,
                        verdict=verdict,
                        generation=new_gen,
                        sites=sites,
                        reason=f"{leader} fell silent",
                    ),
                )
        finally:
            with c._cond:
                self._deciding.discard(key)
