"""Who is admitted to a running job, and with which lanes: the rule in one place.

A join can come from anyone who reaches a coordinator's port, so a running job takes
nothing from it on its word. A member that joins from generation 0 in another process
than the job knows (another incarnation) *claims* to have restarted; the same process
joining from generation 0 is a late copy of a join it sent before the job began (a
slow server, a retried call) and changes nothing. A claimed restart, and any site
asking to join a running job, is settled by the site itself: the peer loop's next
heartbeat to it, at the address the job configured, answers with its incarnation,
its lanes and whether its ranks are ready, and the site is admitted with those
(issue 14, row 2: a forged join once dropped the live site and admitted the caller's
lanes, which then pulled the training state). A *first* join, before the job runs, is
settled the same way (issue 33, row 2: a join in site1's name, sent before site1
started, once made site0 form generation 1 with fake lanes and push gradient chunks
to them): the join only makes this site join the named site at its configured address
(through the link's proxy, as every call to a peer), and the site is admitted with the
lanes and incarnation of *that* answer. The join's handler itself calls nobody, so two
sites that start at once and join each other never wait on each other. What a join
claimed is kept (:class:`JoinClaims`) until the site answers; a claim its answer
contradicts is logged once per caller with a count. Call ``on_join`` and ``on_answer``
with the coordinator's condition (``coordinator.state.cond``) held; what they change
goes through the state's transitions (inter/control/state.py).

A new membership generation is believed the same way: a ``Propose`` is adopted only
if the site it names as leader, asked at its own address, says it is proposing that
generation with those members (a forged Propose in the leader's name, in the job's
order, once stopped a job).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from isthmus.inter.bounds import RefusalLog
from isthmus.inter.control.incarnations import Incarnations
from isthmus.proto import coordinator_pb2 as pb

if TYPE_CHECKING:
    from isthmus.inter.control.coordinator import Coordinator

__all__ = [
    "JoinClaims",
    "malformed_proposal",
    "on_answer",
    "on_join",
    "site_problem",
    "unconfirmed_proposal",
]

log = logging.getLogger("isthmus.inter.control.coordinator")

MAX_FIELD_CHARS = 1024  # longest lane address (host:port) a site may name
MAX_CLAIMS_PER_SITE = 16  # unsettled joins kept per site name (the oldest go first)


class JoinClaims:
    """What joins in each site's name claimed (lanes, incarnation), by caller, until the
    site's own answer settles them; one it contradicts is a forged join, logged with the
    caller's address (``refusals``: once per caller per minute, with a count). A claim
    is only ever compared: nothing is admitted from it. Guarded by the state's condition.
    """

    def __init__(self, refusals: RefusalLog) -> None:
        self.refusals = refusals
        self._pending: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {}

    def claim(self, name: str, caller: str, info: pb.SiteInfo, incarnation: str) -> None:
        """A join from ``caller`` said ``name`` is ready with ``info``'s lanes."""
        claims = self._pending.setdefault(name, {})
        claims.pop(caller, None)
        claims[caller] = (tuple(info.lane_addresses), incarnation)
        while len(claims) > MAX_CLAIMS_PER_SITE:
            del claims[next(iter(claims))]

    def settle(self, name: str, info: pb.SiteInfo, incarnation: str) -> None:
        """``name`` answered at its own address with ``info``: claims that differ were
        not its own."""
        lanes = tuple(info.lane_addresses)
        for caller, (claimed, claimed_incarnation) in self._pending.pop(name, {}).items():
            if claimed != lanes or (incarnation and claimed_incarnation != incarnation):
                self.refusals.note(
                    caller,
                    f"Join in {name}'s name that {name}, asked at its own address, does not "
                    "confirm (other lanes or another process); nothing taken from it",
                )


def site_problem(
    c: Coordinator, info: pb.SiteInfo, ready: bool, incarnation: str = ""
) -> str | None:
    """Why ``info`` (a peer's join, or its answer to one) cannot be a site of this job,
    or None; a ready site must name one lane per rank."""
    if info.name not in c.peers:
        return f"unknown site {info.name[:64]!r}; this job's sites are {c.site_names}"
    expected = c.site_names.index(info.name)
    if info.index != expected:
        return f"site {info.name} claims index {info.index}, expected {expected}"
    ranks = c.site_ranks[expected]
    if ready and (
        len(info.lane_addresses) != ranks
        or not all(0 < len(a) <= MAX_FIELD_CHARS for a in info.lane_addresses)
    ):
        return f"site {info.name} sent {len(info.lane_addresses)} lane addresses, expected {ranks}"
    return Incarnations.problem(info.name, incarnation)


def on_join(c: Coordinator, request: pb.JoinRequest, caller: str) -> bool:
    """Notes what a join from ``caller`` asks; returns whether it is news to a running
    job (the joiner then waits to be admitted). Nothing is taken from the join itself:
    not the lanes, nor that the site is alive, nor an incarnation other than a first."""
    st = c.state
    name = request.site.name
    running = st.running
    members = st.members
    restarted = (
        running
        and name in members
        and request.generation == 0
        and c.incarnations.is_new(name, request.incarnation)
    )
    news = running and (name not in members or restarted)
    # Only an id never heard before: a site is admitted from its own answers, which
    # replace this one (the peer loop's join, on_answer), and a join never replaces one.
    c.incarnations.learn(name, request.incarnation, replace=False)
    if not request.ready:
        return news
    c.join_claims.claim(name, caller, request.site, request.incarnation)
    if news:
        c.asked_to_join.add(name)  # settled by its own answer (on_answer)
    elif not running and name in st.ready_sites:
        # Admitted already, from its own answer: a join that differs is not its own.
        known = c.incarnations.get(name) or ""
        c.join_claims.settle(name, st.ready_sites[name], known)
    elif not running:
        st.doubt_locked(name)  # asked at its own address; admitted with that answer
    return news


def on_answer(c: Coordinator, name: str, reply: pb.HeartbeatResponse) -> None:
    """What ``name`` answered at its own address: a restart (a new incarnation) is
    taken for one, and a site that asked to join is admitted with the lanes it names."""
    st = c.state
    if reply.ready and reply.site.name == name:
        c.join_claims.settle(name, reply.site, reply.incarnation)
    if not st.running or not reply.incarnation:
        return
    members = st.members
    if name in members and c.incarnations.is_new(name, reply.incarnation):
        # Its earlier incarnation is gone: suspect it now, not after the failure
        # timeout, and admit it like any site outside the membership.
        log.warning("[%s] %s restarted: admitting it again", c.site, name)
        c.incarnations.learn(name, reply.incarnation, replace=True)
        c.asked_to_join.add(name)
        st.suspect_locked(name)
    if (
        name in c.asked_to_join
        and reply.ready
        and reply.site.name == name
        and site_problem(c, reply.site, reply.ready, reply.incarnation) is None
        and (name not in members or name in st.restarted)
    ):
        c.asked_to_join.discard(name)
        c.incarnations.learn(name, reply.incarnation, replace=True)
        c.failover.add_joiner_locked(reply.site)


def unconfirmed_proposal(c: Coordinator, request: pb.ProposeRequest) -> str | None:
    """Why ``request`` is not what its leader proposes, asked at the leader's own
    address (without the coordinator's condition held), or None."""
    members = [info.name for info in request.sites]
    ask = pb.HeartbeatRequest(
        site=c.site,
        step=c.step,
        generation=c.state.generation,
        confirm_generation=request.generation,
    )
    try:
        reply = c.peer_stub(request.leader).Heartbeat(ask, timeout=c.rpc_timeout_s / 2)
    except grpc.RpcError as exc:
        return f"{request.leader} could not be asked about its proposal: {exc.code().name}"
    if list(reply.proposed_members) != members:
        return f"{request.leader} does not propose generation {request.generation} with {members}"
    return None


def malformed_proposal(c: Coordinator, request: pb.ProposeRequest, max_step: int) -> str | None:
    """Why ``request`` cannot be a generation of this job, or None."""
    names = [info.name for info in request.sites]
    ordered = sorted(set(names) & set(c.site_names), key=c.site_names.index)
    problem = None
    if request.leader not in c.peers:
        problem = f"unknown leader {request.leader[:64]!r}"
    elif request.generation == 0 or request.start_step > max_step:
        problem = "generation must be > 0 and start_step in range"
    elif not names or len(set(names)) != len(names) or any(n not in c.site_names for n in names):
        problem = f"sites must be distinct sites of this job, got {[n[:64] for n in names[:8]]}"
    elif names != ordered:
        # Every site derives the leader and each chunk's owner from this order; one
        # reordered list froze the job for good (issue 14, row 4).
        problem = f"sites must be in the job's order {ordered}, got {names}"
    elif request.leader not in names:
        problem = "the leader must be a member of its generation"
    elif c.site not in names:
        problem = f"a generation is proposed to its members; {c.site} is not one"
    elif request.state_source and request.state_source not in names:
        problem = f"state_source {request.state_source[:64]!r} is not a member"
    else:
        for info in request.sites:
            index = c.site_names.index(info.name)
            if info.index != index or len(info.lane_addresses) != c.site_ranks[index]:
                problem = f"site {info.name} has index {info.index} or a wrong lane list"
                break
    return problem
