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
condition held.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from isthmus.proto import coordinator_pb2 as pb

if TYPE_CHECKING:
    from .coordinator import Coordinator

__all__ = ["on_answer", "on_join"]

log = logging.getLogger("isthmus.inter.coordinator")


def on_join(c: Coordinator, request: pb.JoinRequest) -> bool:
    """Notes what a join asks; returns whether it is news to a running job (the joiner
    then waits to be admitted)."""
    name = request.site.name
    running = c._generation > 0 and not c.joining
    restarted = (
        running
        and name in c.members
        and request.generation == 0
        and c.incarnations.is_new(name, request.incarnation)
    )
    news = running and (name not in c.members or restarted)
    c.incarnations.learn(name, request.incarnation, replace=not running)
    if news and request.ready:
        c.asked_to_join.add(name)  # settled by its own answer (on_answer)
    elif not running and request.ready and name not in c._ready_sites:
        c._ready_sites[name] = request.site
        c._maybe_ready_locked()
    return news


def on_answer(c: Coordinator, name: str, reply: pb.HeartbeatResponse) -> None:
    """What ``name`` answered at its own address: a restart (a new incarnation) is
    taken for one, and a site that asked to join is admitted with the lanes it names."""
    running = c._generation > 0 and not c.joining
    if not running or not reply.incarnation:
        return
    if name in c.members and c.incarnations.is_new(name, reply.incarnation):
        # Its earlier incarnation is gone: suspect it now, not after the failure
        # timeout, and admit it like any site outside the membership.
        log.warning("[%s] %s restarted: admitting it again", c.site, name)
        c.incarnations.learn(name, reply.incarnation, replace=True)
        c.failover.restarted.add(name)
        c.asked_to_join.add(name)
        c._cond.notify_all()
    if (
        name in c.asked_to_join
        and reply.ready
        and reply.site.name == name
        and c._check_site_info(reply.site, reply.ready, reply.incarnation) is None
        and (name not in c.members or name in c.failover.restarted)
    ):
        c.asked_to_join.discard(name)
        c.incarnations.learn(name, reply.incarnation, replace=True)
        c.failover.add_joiner(reply.site)
