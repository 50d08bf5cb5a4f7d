"""Who is admitted to a running job, and with which lanes: the rule in one place.

A join can come from anyone who reaches a coordinator's port, so a job takes nothing from
it on its word. A member that joins from generation 0 in another process (another
incarnation) *claims* to have restarted; the same process joining from generation 0 is a
late copy of an earlier join and changes nothing. A claimed restart, a site asking to join
a running job, and a *first* join before the job runs are all settled by the site itself:
this site asks it at the address the job configured (the peer loop's heartbeat or join,
through the link's proxy), and admits it with the incarnation, lanes and readiness of that
answer (issue 14, row 2: a forged join once dropped the live site and admitted the caller's
lanes; issue 33, row 2: a join in site1's name before site1 started once formed generation
1 with fake lanes). The join's handler calls nobody, so two sites that start at once never
wait on each other. What a join claimed is kept (:class:`JoinClaims`) until the site
answers; a claim its answer contradicts is logged once per caller with a count. Call
``on_join`` and ``on_answer`` with ``state.cond`` held.

A new generation is believed the same way: a ``Propose`` is adopted only if its leader,
asked at its own address, says it proposes that generation with those members (a forged
Propose in the leader's name once stopped a job).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from isthmus.inter.bounds import RefusalLog
from isthmus.inter.control.fingerprint import fingerprint_problem
from isthmus.inter.control.incarnations import Incarnations
from isthmus.inter.control.settings import CoordinatorSettings
from isthmus.inter.control.state import CoordinatorState
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

__all__ = ["Admission", "malformed_proposal", "site_problem", "unconfirmed_proposal"]

log = logging.getLogger("isthmus.inter.control.coordinator")

MAX_FIELD_CHARS = 1024  # longest lane address (host:port) a site may name


def site_problem(
    settings: CoordinatorSettings, info: pb.SiteInfo, ready: bool, incarnation: str = ""
) -> str | None:
    """Why ``info`` (a peer's join, or its answer to one) cannot be a site of this job,
    or None; a ready site must name one lane per rank."""
    names = list(settings.site_names)
    if info.name not in settings.peers:
        return f"unknown site {info.name[:64]!r}; this job's sites are {names}"
    expected = names.index(info.name)
    if info.index != expected:
        return f"site {info.name} claims index {info.index}, expected {expected}"
    ranks = settings.site_ranks[expected]
    if ready and (
        len(info.lane_addresses) != ranks
        or not all(0 < len(a) <= MAX_FIELD_CHARS for a in info.lane_addresses)
    ):
        return f"site {info.name} sent {len(info.lane_addresses)} lane addresses, expected {ranks}"
    return Incarnations.problem(info.name, incarnation)


@dataclass(eq=False, kw_only=True)
class Admission:
    """Who of the joins and answers a site's coordinator hears is admitted, and how."""

    settings: CoordinatorSettings
    state: CoordinatorState
    refusals: RefusalLog
    """Where a join its site belies is reported, once per caller."""
    add_joiner: Callable[[pb.SiteInfo], None]
    """Admits a site at the next commit (called with ``state.cond`` held)."""
    tell_values: bool
    """A refused join is told the job's values of the keys that differ; without the job
    token or TLS anyone can call: only the keys (the log has both)."""

    def site_problem(self, info: pb.SiteInfo, ready: bool, incarnation: str = "") -> str | None:
        """:func:`site_problem` with this coordinator's settings."""
        return site_problem(self.settings, info, ready, incarnation)

    def answer_join(
        self, request: pb.JoinRequest, context: grpc.ServicerContext
    ) -> pb.JoinResponse:
        """A peer's ``Join``: refused when the site or its fingerprint is not this job's,
        else noted (``on_join``) and answered with this site's own SiteInfo."""
        s, st, who = self.settings, self.state, request.site.name[:64] or "a peer"
        problem = answer = self.site_problem(request.site, request.ready, request.incarnation)
        theirs = dict(request.fingerprint.fields)
        if problem is None and (problem := fingerprint_problem(s.fingerprint, theirs, s.site, who)):
            answer = fingerprint_problem(
                s.fingerprint, theirs, s.site, who, values=self.tell_values
            )
        if problem is not None:
            log.warning("[%s] refused join from %s: %s", s.site, context.peer(), problem)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, answer or problem)
        with st.cond:
            # Not even "heard from": anyone can send a join in a site's name; the
            # site's answers to this site's own calls say whether it is alive.
            news = self.on_join(request, context.peer())
            return pb.JoinResponse(
                site=st.own_info_locked(),
                ready=st.local_ready_locked(),
                generation=st.generation if news else 0,
                incarnation=st.incarnations.mine,
                aborted=st.abort.answer_for(request.site.name),
            )

    def _settle_claims_locked(self, name: str, info: pb.SiteInfo, incarnation: str) -> None:
        """``name``'s own answer: every claim it contradicts is a forged join."""
        for caller in self.state.join_claims.settle(name, info, incarnation):
            self.refusals.note(
                caller,
                f"Join in {name}'s name that {name}, asked at its own address, does not "
                "confirm (other lanes or another process); nothing taken from it",
            )

    def on_join(self, request: pb.JoinRequest, caller: str) -> bool:
        """Notes what a join from ``caller`` asks; returns whether it is news to a running
        job (the joiner then waits to be admitted). Nothing is taken from the join itself:
        not the lanes, nor that the site is alive, nor an incarnation other than a first."""
        st = self.state
        incarnations = st.incarnations
        name = request.site.name
        running = st.running
        members = st.members
        restarted = (
            running
            and name in members
            and request.generation == 0
            and incarnations.is_new(name, request.incarnation)
        )
        news = running and (name not in members or restarted)
        # Only an id never heard before: a site is admitted from its own answers, which
        # replace this one (the peer loop's join, on_answer), and a join never replaces one.
        incarnations.learn(name, request.incarnation, replace=False)
        if not request.ready:
            return news
        st.join_claims.claim(name, caller, request.site, request.incarnation)
        if news:
            st.ask_to_join_locked(name)  # settled by its own answer (on_answer)
        elif not running and name in st.ready_sites:
            # Admitted already, from its own answer: a join that differs is not its own.
            known = incarnations.get(name) or ""
            self._settle_claims_locked(name, st.ready_sites[name], known)
        elif not running:
            st.doubt_locked(name)  # asked at its own address; admitted with that answer
        return news

    def on_answer(self, name: str, reply: pb.HeartbeatResponse) -> None:
        """What ``name`` answered at its own address: a restart (a new incarnation) is
        taken for one, and a site that asked to join is admitted with the lanes it names."""
        st = self.state
        incarnations = st.incarnations
        if reply.ready and reply.site.name == name:
            self._settle_claims_locked(name, reply.site, reply.incarnation)
        if not st.running or not reply.incarnation:
            return
        members = st.members
        if name in members and incarnations.is_new(name, reply.incarnation):
            # Its earlier incarnation is gone: suspect it now, not after the failure
            # timeout, and admit it like any site outside the membership.
            log.warning("[%s] %s restarted: admitting it again", st.site, name)
            incarnations.learn(name, reply.incarnation, replace=True)
            st.ask_to_join_locked(name)
            st.suspect_locked(name)
        if (
            name in st.asked_to_join
            and reply.ready
            and reply.site.name == name
            and self.site_problem(reply.site, reply.ready, reply.incarnation) is None
            and (name not in members or name in st.restarted)
        ):
            st.settle_join_locked(name)
            incarnations.learn(name, reply.incarnation, replace=True)
            self.add_joiner(reply.site)


def unconfirmed_proposal(
    settings: CoordinatorSettings,
    state: CoordinatorState,
    leader: pb_grpc.CoordinatorStub,
    request: pb.ProposeRequest,
) -> str | None:
    """Why ``request`` is not what its leader proposes, asked at the leader's own
    address (``leader``, its stub; without the state's condition held), or None."""
    members = [info.name for info in request.sites]
    ask = pb.HeartbeatRequest(
        site=settings.site,
        step=state.step,
        generation=state.generation,
        confirm_generation=request.generation,
    )
    try:
        reply = leader.Heartbeat(ask, timeout=settings.rpc_timeout_s / 2)
    except grpc.RpcError as exc:
        return f"{request.leader} could not be asked about its proposal: {exc.code().name}"
    if list(reply.proposed_members) != members:
        return f"{request.leader} does not propose generation {request.generation} with {members}"
    return None


def malformed_proposal(
    settings: CoordinatorSettings, request: pb.ProposeRequest, max_step: int
) -> str | None:
    """Why ``request`` cannot be a generation of this job, or None."""
    site_names = list(settings.site_names)
    names = [info.name for info in request.sites]
    ordered = sorted(set(names) & set(site_names), key=site_names.index)
    problem = None
    if request.leader not in settings.peers:
        problem = f"unknown leader {request.leader[:64]!r}"
    elif request.generation == 0 or request.start_step > max_step:
        problem = "generation must be > 0 and start_step in range"
    elif not names or len(set(names)) != len(names) or any(n not in site_names for n in names):
        problem = f"sites must be distinct sites of this job, got {[n[:64] for n in names[:8]]}"
    elif names != ordered:
        # Every site derives the leader and each chunk's owner from this order; one
        # reordered list froze the job for good (issue 14, row 4).
        problem = f"sites must be in the job's order {ordered}, got {names}"
    elif request.leader not in names:
        problem = "the leader must be a member of its generation"
    elif settings.site not in names:
        problem = f"a generation is proposed to its members; {settings.site} is not one"
    elif request.state_source and request.state_source not in names:
        problem = f"state_source {request.state_source[:64]!r} is not a member"
    else:
        for info in request.sites:
            index = site_names.index(info.name)
            if info.index != index or len(info.lane_addresses) != settings.site_ranks[index]:
                problem = f"site {info.name} has index {info.index} or a wrong lane list"
                break
    return problem
