"""The votes and decisions of a site's coordinator, per (step, generation), shared by the
failover loop and the leader, and guarded by ``CoordinatorState.cond`` like the state."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from isthmus.inter.control.state import Adoption, CoordinatorState, Key, failover_log
from isthmus.proto import coordinator_pb2 as pb

__all__ = ["Ballots"]

_KEEP_STEPS = 8  # decisions and votes this many steps back still answer late askers


class Ballots:
    """Per (step, generation): the local ranks' votes, the member sites' votes (at the
    leader) and the decision; and the sites waiting to be admitted at the next commit.
    Guarded by ``state.cond`` like the state itself (every method is ``_locked``)."""

    def __init__(self, state: CoordinatorState) -> None:
        self.state = state
        self.rank_votes: dict[Key, dict[int, bool]] = {}
        self.site_votes: dict[Key, dict[str, tuple[bool, frozenset[str]]]] = {}
        self.decisions: dict[Key, pb.Decision] = {}
        self.joiners: dict[str, pb.SiteInfo] = {}
        self.rejoin: pb.Decision | None = None
        """The REJOIN for ranks that voted before this site was admitted back."""
        self._lean: dict[Key, pb.Decision] = {}
        """A COMMIT without its sites, per key, for the voters that have them."""

    def vote_rank_locked(self, key: Key, rank: int, ok: bool) -> None:
        """Local ``rank``'s vote; a "not ok" stands once cast. Wakes the failover loop
        only once every local rank voted on ``key``: waking on every vote was N x 2N
        wake-ups a step, 11 CPU seconds a step at 1,024 ranks
        (docs/benchmarks/control-plane.md, "The control plane at scale")."""
        votes = self.rank_votes.setdefault(key, {})
        votes[rank] = votes.get(rank, True) and ok
        if len(votes) >= self.state.ranks:
            self.state.cond.notify_all()

    def vote_site_locked(self, key: Key, site: str, ok: bool, suspects: Iterable[str]) -> None:
        """Member ``site``'s vote at the leader. A site's vote is resent while it waits;
        a "not ok" stands once cast, so a second call saying "ok" (a forged one) cannot
        turn a failed round into a commit: the worst it can do is make the step run again."""
        votes = self.site_votes.setdefault(key, {})
        ok = votes[site][0] and ok if site in votes else ok
        votes[site] = (ok, frozenset(suspects))
        self.state.cond.notify_all()

    def voted_locked(self, ranks: int) -> list[Key]:
        """Undecided keys every one of the ``ranks`` local ranks voted on, in order."""
        return sorted(
            key
            for key, votes in self.rank_votes.items()
            if len(votes) == ranks and key not in self.decisions
        )

    def add_joiner_locked(self, info: pb.SiteInfo) -> None:
        """A site outside the membership asked to join (settled with its own answer)."""
        if info.name not in self.joiners:
            failover_log.info(
                "[%s] %s asks to join; admitted at the next commit", self.state.site, info.name
            )
        self.joiners[info.name] = info
        self.state.cond.notify_all()

    def sites_of_locked(self, names: Iterable[str]) -> list[pb.SiteInfo]:
        """The SiteInfo of ``names``, joiners being admitted included, in index order."""
        return self.state.infos_locked(names, extra=self.joiners)

    def retry_locked(self, step: int, reason: str) -> pb.Decision:
        """A RETRY of ``step`` in the current generation."""
        state = self.state
        return pb.Decision(
            step=step,
            verdict=pb.VERDICT_RETRY,
            generation=state.generation,
            sites=self.sites_of_locked(state.members),
            reason=reason,
        )

    def readmitted_locked(self, key: Key) -> pb.Decision | None:
        """The REJOIN for a vote cast before this site was admitted back, else None."""
        rejoin = self.rejoin
        return rejoin if rejoin is not None and key[1] < rejoin.generation else None

    def decision_event_locked(self, key: Key) -> threading.Event:
        """Set once ``key`` is decided (or on news for every key): what a vote waits on."""
        return self.state.decision_news.event(key)

    def answer_locked(self, key: Key, sites_known: bool) -> pb.Decision | None:
        """The decision on ``key`` as a voter of ``key``'s generation gets it: without the
        sites when it says it has them and the decision keeps its generation (a COMMIT
        that admits no one): every site's lanes in every rank's answer made a step's
        answers O(sites x ranks²) bytes (docs/benchmarks/control-plane.md, "The control
        plane at scale")."""
        found = self.decisions.get(key)
        if found is None or not sites_known:
            return found
        if found.verdict != pb.VERDICT_COMMIT or found.generation != key[1]:
            return found
        lean = self._lean.get(key)
        if lean is None:
            lean = self._lean[key] = pb.Decision()
            lean.CopyFrom(found)
            lean.ClearField("sites")
        return lean

    def decide_locked(self, key: Key, decision: pb.Decision) -> None:
        """Record the decision on ``key`` (a COMMIT commits its step) and wake the voters."""
        self.decisions[key] = decision
        self._lean.pop(key, None)
        if decision.verdict == pb.VERDICT_COMMIT:
            self.state.commit_locked(key[0])
        for table in (self.decisions, self.rank_votes, self.site_votes, self._lean):
            for old in [k for k in table if k[0] < key[0] - _KEEP_STEPS]:
                del table[old]
        news = self.state.decision_news
        news.publish(key)
        # A vote on a key too old to be kept hears PENDING (as it did before it waited).
        news.publish_all(lambda k: k[0] < key[0] - _KEEP_STEPS)
        failover_log.info(
            "[%s] step %d generation %d: %s%s",
            self.state.site,
            key[0],
            key[1],
            pb.Verdict.Name(decision.verdict).removeprefix("VERDICT_"),
            f" -> generation {decision.generation}" if decision.generation != key[1] else "",
        )
        self.state.cond.notify_all()

    def adopt_locked(self, proposal: pb.ProposeRequest) -> Adoption:
        """:meth:`CoordinatorState.adopt_generation_locked` of ``proposal`` (a Propose's, or
        a decision's with the same news), then: the new members are no longer joiners,
        and a site admitted back hands its waiting ranks a REJOIN."""
        p, sites, start_step = proposal, proposal.sites, proposal.start_step
        outcome = self.state.adopt_generation_locked(
            p.generation, sites, start_step=start_step, state_source=p.state_source, leader=p.leader
        )
        if outcome is Adoption.STALE:
            return outcome
        for info in sites:
            self.joiners.pop(info.name, None)
        if outcome is Adoption.READMITTED:
            # Ranks waiting on a vote of an older generation pull the state instead.
            self.rejoin = pb.Decision(
                step=start_step,
                verdict=pb.VERDICT_REJOIN,
                generation=p.generation,
                sites=sites,
                state_source=p.state_source,
                state_step=max(0, start_step - 1),
                reason=f"admitted again by {p.leader} at step {start_step}",
            )
            self.state.decision_news.publish_all()
        return outcome
