"""The coordinator's thread that talks to peer sites: joining, then heartbeats.

Before the membership exists it joins every peer (with the job fingerprint) until
all are present and ready; a site joining a running job (restarted, or left out while
cut off) keeps asking until the leader admits it. Afterwards it sends heartbeats:
this site's step, latest digest and generation; a peer's answer tells a left-out
site that the job went on without it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import grpc

from isthmus.inter.control.admission import on_answer, site_problem
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from isthmus.inter.control.coordinator import Coordinator

__all__ = ["PeerLoop"]

log = logging.getLogger("isthmus.inter.control.coordinator")


class PeerLoop:
    """Joins and heartbeats the peers of ``coordinator`` (run on its own thread); what
    the peers answer moves the membership through ``coordinator.state``'s transitions."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.c = coordinator
        self.state = coordinator.state

    def run(self) -> None:
        c, st = self.c, self.state
        stubs = c.peer_stubs()
        while not st.stopped.is_set():
            self.join_round(stubs)
            if st.error is not None:
                return
            joining = st.generation == 0 or st.joining
            st.stopped.wait(0.2 if joining else c.heartbeat_s)
        if st.generation > 0:
            # A last word on the way out, so peers hear this site's final digest
            # even when it finished last and its next heartbeat would never come.
            self.heartbeat_round(stubs)

    def heartbeat_round(self, stubs: Mapping[str, pb_grpc.CoordinatorStub]) -> None:
        """Tell every peer this site's step, latest digest and whether it finished;
        settle what calls claiming to be that peer said, with its answer."""
        c, st = self.c, self.state
        with st.cond:
            digest_step, digest = c.digest
            beat = pb.HeartbeatRequest(
                site=c.site,
                step=c.step,
                digest=digest,
                digest_step=digest_step,
                finished=c.finished,
                generation=st.generation,
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
                with st.cond:
                    st.heard_from_locked(name)
                c.metrics.site_up.labels(c.site, name).set(1)
                self.check_left_out(name, reply)
                self.settle_claims(name, reply, doubted)
            except grpc.RpcError as exc:
                c.metrics.site_up.labels(c.site, name).set(0)
                # A peer leaving at the end is no news, nor is a dead site the job
                # already went on without (it is still asked, in case it comes back).
                members = st.members
                if not st.stopped.is_set() and (name in members or not members):
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
        with self.state.cond:
            on_answer(c, name, reply)

    def check_left_out(self, name: str, reply: pb.HeartbeatResponse) -> None:
        """A member of a newer generation that does not count this site: the job went on
        without it (it was cut off without quorum). Ask to be admitted again."""
        st = self.state
        if reply is None:  # an answer that did not parse (a corrupting link)
            return
        with st.cond:
            if (
                reply.generation > st.generation
                and not reply.member
                and st.generation > 0
                and not st.joining
                and not self.c.finished
            ):
                st.exclude_locked(
                    f"{name} is at generation {reply.generation} without this site "
                    f"(at {st.generation})"
                )

    def join_round(self, stubs: Mapping[str, pb_grpc.CoordinatorStub]) -> None:
        c, st = self.c, self.state
        if not stubs:  # a job of one site: nobody to join, and its ranks have no lanes
            return
        with st.cond:
            joined = st.running
            ready = st.local_ready_locked()
            info = st.own_info_locked()
            # A site joining a running job keeps asking every peer until a leader
            # admits it: a join is also how the leader knows it is still there.
            told = st.told_ready
            pending = [name for name in stubs if name not in told or st.joining]
        if joined and not pending:
            self.heartbeat_round(stubs)
            return
        if st.joining and c.finished_peers:
            # Admission happens at a step boundary; after the last step there is none.
            st.fail(
                f"the job finished ({', '.join(sorted(c.finished_peers))} ran its last "
                f"step) before {c.site} could be admitted"
            )
            return
        if st.excluded:
            self.heartbeat_round(stubs)  # digests and liveness still flow
        elif st.seconds_since_start() > c.join_timeout_s:
            with st.cond:
                absent = [n for n in c.peers if n not in st.ready_sites]
                local = sum(1 for lane in st.lanes if lane)
            st.fail(
                f"timed out after {c.join_timeout_s:.0f}s joining the job: "
                f"{local}/{c.ranks} local ranks registered; sites not ready: {absent or 'none'}"
            )
            return
        request = pb.JoinRequest(
            site=info,
            fingerprint=pb.JobFingerprint(fields=c.fingerprint),
            ready=ready,
            generation=st.generation,
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
                    st.fail(f"site {name} refused {c.site}'s join: {exc.details()}")
                    return
                log.debug("[%s] join %s: %s (will retry)", c.site, name, exc.code().name)
                continue
            problem = site_problem(c, response.site, response.ready, response.incarnation)
            if problem is not None or response.site.name != name:
                st.fail(f"site {name} answered the join with an invalid site: {problem}")
                return
            # Up from its first answer: the job may run steps before the first heartbeat.
            c.metrics.site_up.labels(c.site, name).set(1)
            with st.cond:
                st.heard_from_locked(name)
                # Who answered: a later join from another process is a restart.
                c.incarnations.learn(name, response.incarnation, replace=st.generation == 0)
                # Before admitting: a site that learns here that the job runs already
                # must not form generation 1 of its own with this peer.
                st.await_admission_locked(response.generation)
                if response.ready:
                    st.admit_locked(response.site)
                if ready:
                    st.mark_told_ready_locked(name)
