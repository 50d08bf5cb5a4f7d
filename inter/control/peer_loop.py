"""The coordinator's thread that talks to peer sites: joining, then heartbeats (and the
answer to theirs).

Before the membership exists it joins every peer (with the job fingerprint) until
all are present and ready; a site joining a running job (restarted, or left out while
cut off) keeps asking until the leader admits it. Afterwards it sends heartbeats:
this site's step, latest digest and generation; a peer's answer tells a left-out
site that the job went on without it, and any site that a script raised at the peer
(inter/control/abort.py).

What a peer's answer says of itself (its step, whether it ran its last step) is what
this site believes of it. A heartbeat *in* a peer's name says the same, but anyone with
the job token can send one: "site0 finished" once made a restarting site1 give up for
good while site0 trained on alone (issue 63). A joining site told so asks the named
site itself before it gives up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc

from isthmus.inter.bounds import RefusalLog
from isthmus.inter.control.admission import Admission
from isthmus.inter.control.settings import CoordinatorSettings
from isthmus.inter.control.state import CoordinatorState
from isthmus.inter.metrics import SiteMetrics
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

__all__ = ["PeerLoop"]

log = logging.getLogger("isthmus.inter.control.coordinator")

BEATS_IN_FLIGHT = 3
"""Heartbeats to one peer whose answers may be awaited at once: one held up by a lost
segment (a retransmission timeout) does not hold back the next, so the peer's gaps stay
the link's stall, not a stall plus a skipped period."""


@dataclass(eq=False, kw_only=True)
class PeerLoop:
    """Joins and heartbeats a site's peers (run on its own thread); what the peers
    answer moves the membership through ``state``'s transitions."""

    settings: CoordinatorSettings
    state: CoordinatorState
    stubs: Mapping[str, pb_grpc.CoordinatorStub]  # filled once the site starts
    admission: Admission
    metrics: SiteMetrics
    refusals: RefusalLog
    proposing: Mapping[int, list[str]]  # generation -> members, while the leader proposes it
    _asked: dict[str, float] = field(default_factory=dict, init=False)  # when a claim was asked
    _in_flight: list[tuple[str, grpc.Future, int | None]] = field(default_factory=list, init=False)

    def run(self) -> None:
        st, stubs = self.state, self.stubs
        while not st.stopped.is_set():
            self.join_round(stubs)
            if st.error is not None:
                return
            wait_s = 0.2 if st.generation == 0 or st.joining else self.settings.heartbeat_s
            with st.cond:  # how late this thread wakes is the host's lag (arrivals.py)
                st.arrivals.sleeping_until(st.clock() + wait_s)
            st.stopped.wait(wait_s)
            with st.cond:
                st.arrivals.woke()
        if st.generation > 0:
            # A last word on the way out, so peers hear this site's final digest
            # even when it finished last and its next heartbeat would never come.
            self.heartbeat_round(stubs, wait_s=self.settings.rpc_timeout_s)

    def heartbeat_round(
        self, stubs: Mapping[str, pb_grpc.CoordinatorStub], wait_s: float | None = None
    ) -> None:
        """Tell every peer this site's step, latest digest and whether it finished;
        settle what calls claiming to be that peer said, with its answer. The calls run
        at once, and the round waits for answers ``wait_s`` (a period by default): a
        silent peer's calls stay in flight (``BEATS_IN_FLIGHT`` at most, until their
        deadline) and never delays the heartbeats of the others, whose deadlines follow
        their arrivals (``arrivals.py``)."""
        st = self.state
        with st.cond:
            digest_step, digest = st.digest
            beat = pb.HeartbeatRequest(
                site=self.settings.site,
                step=st.step,
                digest=digest,
                digest_step=digest_step,
                finished=st.finished,
                generation=st.generation,
            )
        for name, stub in stubs.items():
            if sum(n == name for n, _, _ in self._in_flight) >= BEATS_IN_FLIGHT and wait_s is None:
                continue  # the last word (wait_s) goes out even so
            doubted = st.replicas.doubted(name)
            request = beat
            if doubted is not None:
                request = pb.HeartbeatRequest()
                request.CopyFrom(beat)
                request.confirm_digest, request.confirm_step = True, doubted
            call = stub.Heartbeat.future(request, timeout=self.settings.rpc_timeout_s)
            self._in_flight.append((name, call, doubted))
        until = time.monotonic() + (self.settings.heartbeat_s if wait_s is None else wait_s)
        for pending in list(self._in_flight):
            try:
                pending[1].exception(timeout=max(0.0, until - time.monotonic()))
            except grpc.FutureTimeoutError:
                continue  # still in flight: its answer is taken next round
            self._in_flight.remove(pending)
            self._answered(*pending)

    def _answered(self, name: str, call: grpc.Future, doubted: int | None) -> None:
        site, st, site_up = self.settings.site, self.state, self.metrics.site_up
        try:
            reply = call.result()
        except grpc.RpcError as exc:
            site_up.labels(site, name).set(0)
            # A peer leaving at the end is no news, nor is a dead site the job
            # already went on without (it is still asked, in case it comes back).
            members = st.members
            if not st.stopped.is_set() and (name in members or not members):
                log.warning("[%s] heartbeat to %s failed: %s", site, name, exc.code().name)
            return
        with st.cond:
            st.heard_from_locked(name)
        site_up.labels(site, name).set(1)
        if reply is not None:  # None: an answer that did not parse
            st.abort.learn(name, reply.aborted)
            self.learn_progress(name, reply)
        self.check_left_out(name, reply)
        self.settle_claims(name, reply, doubted)

    def answer_heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.HeartbeatResponse:
        """A peer's heartbeat: it counts as hearing from the peer; what it says of the
        peer's progress and digest is a claim."""
        st, site = self.state, request.site
        if site not in self.settings.peers:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown site {site[:64]!r}")
        if not st.replicas.valid(request.digest):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "digest must be 64 lowercase hex digits"
            )
        with st.cond:
            # "finished" is asked of the site itself before a joining site gives up (issue 63).
            st.heartbeat_locked(site, request.finished, context.peer())
        self.metrics.site_up.labels(st.site, site).set(1)
        refused = st.replicas.claim(site, request.digest_step, request.digest, live=st.step)
        if refused is not None:  # the heartbeat counts; its digest does not
            # The site's name is the caller's to choose: the detail, not the kind.
            said = f"in {site[:64]!r}'s name: {refused}"
            self.refusals.note(context.peer(), "Heartbeat digest refused", said)
        digest = st.replicas.own(request.confirm_step) if request.confirm_digest else ""
        start = request.confirm_digest and request.confirm_step == 0
        layout = st.replicas.own_layout() if start else ""
        with st.cond:
            return pb.HeartbeatResponse(
                model_layout=layout,
                generation=st.generation,
                member=site in st.members,
                incarnation=st.incarnations.mine,
                confirmed_digest=digest,
                site=st.own_info_locked(),
                ready=st.local_ready_locked(),
                proposed_members=self.proposing.get(request.confirm_generation, []),
                aborted=st.abort.answer_for(site),
                step=st.step,
                finished=st.finished,
            )

    def learn_progress(self, name: str, reply: pb.HeartbeatResponse) -> None:
        """``name``'s own step and whether it finished, as it answered at its address;
        a heartbeat in its name that said it finished, and it says not, was forged."""
        st = self.state
        with st.cond:
            belied = st.peer_progress_locked(name, reply.step, reply.finished)
        if belied is not None:
            log.warning(
                "[%s] a heartbeat from %s said %s ran its last step; %s itself says it runs "
                "step %d: the claim is dropped",
                st.site,
                belied,
                name,
                name,
                reply.step,
            )

    def check_finished(self, stubs: Mapping[str, pb_grpc.CoordinatorStub]) -> None:
        """Asks each peer that a heartbeat in its name said finished whether it did, at
        most once a heartbeat period while it does not answer."""
        now = self.state.clock()
        ask = {
            name: stubs[name]
            for name in sorted(self.state.finished_claims)
            if name in stubs and now - self._asked.get(name, -1e9) >= self.settings.heartbeat_s
        }
        for name in ask:
            self._asked[name] = now
        if ask:
            self.heartbeat_round(ask)

    def settle_claims(self, name: str, reply: pb.HeartbeatResponse, doubted: int | None) -> None:
        """What ``name`` answered at its own address settles what calls claiming to be
        it said: a restart (a new incarnation), a join (admitted with the lanes it
        names here) and a digest that differed from this site's."""
        st = self.state
        if reply is None:
            return
        confirmed = reply.confirmed_digest
        if doubted is not None and st.replicas.confirm(
            name, doubted, confirmed, reply.model_layout
        ):
            self.metrics.replicas_identical.labels(st.site).set(0)
        with st.cond:
            self.admission.on_answer(name, reply)

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
                and not st.finished
            ):
                st.exclude_locked(
                    f"{name} is at generation {reply.generation} without this site "
                    f"(at {st.generation})"
                )

    def _join_timed_out(self, stubs: Mapping[str, pb_grpc.CoordinatorStub]) -> None:
        s, st = self.settings, self.state
        with st.cond:
            absent = [n for n in stubs if n not in st.ready_sites]
            local = sum(1 for lane in st.lanes if lane)
        unsettled = sorted(st.finished_claims)
        said = (
            f"; heartbeats said {', '.join(unsettled)} ran the last step, which "
            "did not answer to confirm it"
            if unsettled
            else ""
        )
        st.fail(
            f"timed out after {s.join_timeout_s:.0f}s joining the job: "
            f"{local}/{s.ranks} local ranks registered; sites not ready: "
            f"{absent or 'none'}{said}"
        )

    def join_round(self, stubs: Mapping[str, pb_grpc.CoordinatorStub]) -> None:
        s, st = self.settings, self.state
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
        if st.joining:
            self.check_finished(stubs)
        if st.joining and st.finished_peers:
            # Admission happens at a step boundary; after the last step there is none.
            # Only a peer's own answer says it finished (check_finished asked it).
            st.fail(
                f"the job finished ({', '.join(sorted(st.finished_peers))} ran its last "
                f"step) before {s.site} could be admitted"
            )
            return
        if st.excluded:
            self.heartbeat_round(stubs)  # digests and liveness still flow
        elif st.seconds_since_start() > s.join_timeout_s:
            self._join_timed_out(stubs)
            return
        request = pb.JoinRequest(
            site=info,
            fingerprint=pb.JobFingerprint(fields=s.fingerprint),
            ready=ready,
            generation=st.generation,
            incarnation=st.incarnations.mine,
        )
        for name in pending:
            try:
                response = stubs[name].Join(request, timeout=s.rpc_timeout_s)
            except grpc.RpcError as exc:
                if exc.code() in (
                    grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.UNAUTHENTICATED,  # a wrong job token stays wrong
                ):
                    st.fail(f"site {name} refused {s.site}'s join: {exc.details()}")
                    return
                log.debug("[%s] join %s: %s (will retry)", s.site, name, exc.code().name)
                continue
            st.abort.learn(name, response.aborted)  # a script raised there: the job stops
            problem = self.admission.site_problem(
                response.site, response.ready, response.incarnation
            )
            if problem is not None or response.site.name != name:
                st.fail(f"site {name} answered the join with an invalid site: {problem}")
                return
            # Up from its first answer: the job may run steps before the first heartbeat.
            self.metrics.site_up.labels(s.site, name).set(1)
            with st.cond:
                st.heard_from_locked(name)
                # Who answered: a later join from another process is a restart.
                st.incarnations.learn(name, response.incarnation, replace=st.generation == 0)
                # Before admitting: a site that learns here that the job runs already
                # must not form generation 1 of its own with this peer.
                st.await_admission_locked(response.generation)
                if response.ready:
                    st.admit_locked(response.site)
                if ready:
                    st.mark_told_ready_locked(name)
