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
lanes, which then pulled the training state). Call both with the coordinator's
condition (``coordinator.state.cond``) held; what they change goes through the
state's transitions (inter/control/state.py).

A new membership generation is believed the same way: a ``Propose`` is adopted only
if the site it names as leader, asked at its own address, says it is proposing that
generation with those members (a forged Propose in the leader's name, in the job's
order, once stopped a job).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from isthmus.inter.control.incarnations import Incarnations
from isthmus.proto import coordinator_pb2 as pb

if TYPE_CHECKING:
    from isthmus.inter.control.coordinator import Coordinator

__all__ = ["malformed_proposal", "on_answer", "on_join", "site_problem", "unconfirmed_proposal"]

log = logging.getLogger("isthmus.inter.control.coordinator")

MAX_FIELD_CHARS = 1024  # longest lane address (host:port) a site may name


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


def on_join(c: Coordinator, request: pb.JoinRequest) -> bool:
    """Notes what a join asks; returns whether it is news to a running job (the joiner
    then waits to be admitted)."""
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
    c.incarnations.learn(name, request.incarnation, replace=not running)
    if news and request.ready:
        c.asked_to_join.add(name)  # settled by its own answer (on_answer)
    elif not running and request.ready:
        st.admit_locked(request.site)  # the first SiteInfo stands
    return news


def on_answer(c: Coordinator, name: str, reply: pb.HeartbeatResponse) -> None:
    """What ``name`` answered at its own address: a restart (a new incarnation) is
    taken for one, and a site that asked to join is admitted with the lanes it names."""
    st = c.state
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
