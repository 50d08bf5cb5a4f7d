"""The coordinator's thread that talks to peer sites: joining, then heartbeats.

Before the membership exists it joins every peer (with the job fingerprint) until
all are present and ready; a site joining a running job (restarted, or left out while
cut off) keeps asking until the leader admits it. Afterwards it sends heartbeats:
this site's step, latest digest and generation; a peer's answer tells a left-out
site that the job went on without it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import grpc

from isthmus.inter.control.admission import on_answer
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from isthmus.inter.control.coordinator import Coordinator

__all__ = ["PeerLoop"]

log = logging.getLogger("isthmus.inter.control.coordinator")


class PeerLoop:
    """Joins and heartbeats the peers of ``coordinator`` (run on its own thread)."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.c = coordinator

    def run(self) -> None:
        c = self.c
        stubs = c._stubs
        while not c._stopped.is_set():
            self.join_round(stubs)
            if c._error is not None:
                return
            joining = c.generation == 0 or c.joining
            c._stopped.wait(0.2 if joining else c.heartbeat_s)
        if c.generation > 0:
            # A last word on the way out, so peers hear this site's final digest
            # even when it finished last and its next heartbeat would never come.
            self.heartbeat_round(stubs)

    def heartbeat_round(self, stubs: Mapping[str, pb_grpc.CoordinatorStub]) -> None:
        """Tell every peer this site's step, latest digest and whether it finished;
        settle what calls claiming to be that peer said, with its answer."""
        c = self.c
        with c._cond:
            digest_step, digest = c._digest
            beat = pb.HeartbeatRequest(
                site=c.site,
                step=c.step,
                digest=digest,
                digest_step=digest_step,
                finished=c.finished,
                generation=c._generation,
            )
        for name, stub in stubs.items():
            doubted = c.replicas.doubted(name)
            request = beat
            if doubted is not None:
                request = pb.HeartbeatRequest()
                request.CopyFrom(beat)
                request.confirm_digest, request.confirm_step = True, doubted
            try:
                reply = stub.Heartbeat(request, timeout=c.rpc_timeout_s)
                c.last_seen[name] = time.monotonic()
                c.metrics.site_up.labels(c.site, name).set(1)
                self.check_left_out(name, reply)
                self.settle_claims(name, reply, doubted)
            except grpc.RpcError as exc:
                c.metrics.site_up.labels(c.site, name).set(0)
                # A peer leaving at the end is no news, nor is a dead site the job
                # already went on without (it is still asked, in case it comes back).
                if not c._stopped.is_set() and (name in c.members or not c.members):
                    log.warning("[%s] heartbeat to %s failed: %s", c.site, name, exc.code().name)

    def settle_claims(self, name: str, reply: pb.HeartbeatResponse, doubted: int | None) -> None:
        """What ``name`` answered at its own address settles what calls claiming to be
        it said: a restart (a new incarnation), a join (admitted with the lanes it
        names here) and a digest that differed from this site's."""
        c = self.c
        if reply is None:
            return
        if doubted is not None and c.replicas.confirm(name, doubted, reply.confirmed_digest):
            c.metrics.replicas_identical.labels(c.site).set(0)
        with c._cond:
            on_answer(c, name, reply)

    def check_left_out(self, name: str, reply: pb.HeartbeatResponse) -> None:
        """A member of a newer generation that does not count this site: the job went on
        without it (it was cut off without quorum). Ask to be admitted again."""
        c = self.c
        if reply is None:  # an answer that did not parse (a corrupting link)
            return
        with c._cond:
            if (
                reply.generation > c._generation
                and not reply.member
                and c._generation > 0
                and not c.joining
                and not c.finished
            ):
                log.warning(
                    "[%s] %s is at generation %d without this site (at %d): joining again",
                    c.site,
                    name,
                    reply.generation,
                    c._generation,
                )
                c.excluded = c.joining = True

    def join_round(self, stubs: Mapping[str, pb_grpc.CoordinatorStub]) -> None:
        c = self.c
        if not stubs:  # a job of one site: nobody to join, and its ranks have no lanes
            return
        with c._cond:
            joined = c._generation > 0 and not c.joining
            ready = c._local_ready_locked()
            info = c._own_info_locked()
            # A site joining a running job keeps asking every peer until a leader
            # admits it: a join is also how the leader knows it is still there.
            pending = [name for name in stubs if name not in c._told_ready or c.joining]
        if joined and not pending:
            self.heartbeat_round(stubs)
            return
        if c.joining and c.finished_peers:
            # Admission happens at a step boundary; after the last step there is none.
            c._fail(
                f"the job finished ({', '.join(sorted(c.finished_peers))} ran its last "
                f"step) before {c.site} could be admitted"
            )
            return
        if c.excluded:
            self.heartbeat_round(stubs)  # digests and liveness still flow
        elif time.monotonic() - c._started_at > c.join_timeout_s:
            with c._cond:
                absent = [n for n in c.peers if n not in c._ready_sites]
                local = sum(1 for lane in c._lanes if lane)
            c._fail(
                f"timed out after {c.join_timeout_s:.0f}s joining the job: "
                f"{local}/{c.ranks} local ranks registered; sites not ready: {absent or 'none'}"
            )
            return
        request = pb.JoinRequest(
            site=info,
            fingerprint=pb.JobFingerprint(fields=c.fingerprint),
            ready=ready,
            generation=c.generation,
            incarnation=c.incarnations.mine,
        )
        for name in pending:
            try:
                response = stubs[name].Join(request, timeout=c.rpc_timeout_s)
            except grpc.RpcError as exc:
                if exc.code() in (
                    grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.UNAUTHENTICATED,  # a wrong job token stays wrong
                ):
                    c._fail(f"site {name} refused {c.site}'s join: {exc.details()}")
                    return
                log.debug("[%s] join %s: %s (will retry)", c.site, name, exc.code().name)
                continue
            problem = c._check_site_info(response.site, response.ready, response.incarnation)
            if problem is not None or response.site.name != name:
                c._fail(f"site {name} answered the join with an invalid site: {problem}")
                return
            with c._cond:
                c.last_seen[name] = time.monotonic()
                # Who answered: a later join from another process is a restart.
                c.incarnations.learn(name, response.incarnation, replace=c._generation == 0)
                if response.generation > 0 and c._generation == 0 and not c.joining:
                    # The job is already running: wait to be admitted by its leader.
                    log.info(
                        "[%s] the job is running (generation %d): asking to join",
                        c.site,
                        response.generation,
                    )
                    c.joining = True
                if response.ready and name not in c._ready_sites:
                    c._ready_sites[name] = response.site
                if ready:
                    c._told_ready.add(name)
                c._maybe_ready_locked()
