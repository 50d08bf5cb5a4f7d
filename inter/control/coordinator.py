"""The control plane of one site: rank registration, joining peer sites, membership.

One `Coordinator` runs per site. The site's ranks register their lane addresses with it;
it joins every peer site's coordinator with the job fingerprint (a peer whose fingerprint
differs is refused with a message naming every differing key, and both sides report it).
Once every site is present and ready, the membership gets generation 1, which ranks learn
from a long-polling `GetMembership`. Everything the coordinator knows lives in
`self.state` (inter/control/state.py), changed only by its named transitions; each helper
(failover, peer loop, admission) is handed the few things it uses, never the coordinator.
Every RPC carries a deadline and every wait a timeout (docs/design.md invariant 5).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from operator import attrgetter
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from isthmus.inter.bounds import BoundedHealth, RefusalLog, RePolls, WaitSlots, pool_size
from isthmus.inter.control import channels
from isthmus.inter.control import rank_keys as handouts
from isthmus.inter.control.abort import abort_problem
from isthmus.inter.control.admission import MAX_FIELD_CHARS, Admission
from isthmus.inter.control.failover import Failover
from isthmus.inter.control.fingerprint import fingerprint_problem
from isthmus.inter.control.peer_loop import PeerLoop
from isthmus.inter.control.rank_keys import RankKeys
from isthmus.inter.control.rank_liveness import RankLiveness, beating_ranks
from isthmus.inter.control.settings import CoordinatorSettings
from isthmus.inter.control.state import CoordinatorState
from isthmus.inter.control.witness import WitnessLink
from isthmus.inter.malformed import MalformedRequests
from isthmus.inter.metrics import SiteMetrics, report_problem
from isthmus.inter.security import INSECURE, SiteSecurity, refuse_unless_named
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

__all__ = ["Coordinator", "CoordinatorError", "CoordinatorSettings"]

log = logging.getLogger(__name__)

MAX_WAIT_MS = 30_000


class CoordinatorError(RuntimeError):
    """The job cannot go on: a refused join, a timeout, an invalid peer."""


def _view(name: str, doc: str) -> Any:
    """A read-only attribute of the coordinator that reads ``state.<name>``."""
    return property(lambda self: attrgetter(name)(self.state), doc=doc)


def _handled_by(method: str, who: str, helper: str, handle: str) -> Any:
    """The RPC handler ``method``, for a caller named ``request.<who>``, answered by
    ``self.<helper>.<handle>``."""

    def handler(self: Coordinator, request: Any, context: grpc.ServicerContext) -> Any:
        refuse_unless_named(self.security, context, self.where, attrgetter(who)(request), method)
        return getattr(getattr(self, helper), handle)(request, context)

    return handler


class Coordinator(pb_grpc.CoordinatorServicer):
    """One site's coordinator: a gRPC server plus a thread that joins the peers.

    ``peers`` (site -> coordinator address) may come later by `set_peers`, before `start`
    (a server bound to port 0 knows its address late); ``proxies`` name each link's HTTP
    CONNECT proxy. ``rank_keys`` by default draws one random key per rank, which the
    site's launcher in this process hands its ranks. Every time is read from ``clock``.
    """

    def __init__(
        self,
        settings: CoordinatorSettings,
        *,
        peers: Mapping[str, str] | None = None,
        proxies: Mapping[str, str | None] | None = None,
        security: SiteSecurity | None = None,
        rank_keys: RankKeys | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = s = settings
        self.site, self.site_names, self.ranks = s.site, list(s.site_names), s.ranks
        self.state = st = CoordinatorState(s, clock)
        """Everything this site knows and its transitions, shared with its helpers."""
        self.peers: dict[str, str] = {}
        self.proxies: dict[str, str | None] = {}
        if peers is not None:
            self.set_peers(peers, proxies)
        self.rank_keys = rank_keys or RankKeys.draw(s.site, s.ranks)
        self.security = security or INSECURE
        self.where = s.where
        self.metrics = SiteMetrics(s.site)
        self.metrics_address: str | None = None
        # Long polls wait on a slot each, or answer at once; each caller holds its share
        # (two a rank, a peer site, a host), paced unless it proved a rank's key.
        self.refusals = RefusalLog(self.where)
        waiters = 2 * s.ranks + 2 * len(s.site_names) + 2
        self.repolls = RePolls()
        self.long_polls = WaitSlots(waiters, "long poll", self.refusals, self.repolls)
        # A host agent's HostSession holds a thread while open: one a rank at most.
        self.host_sessions = WaitSlots(s.ranks, "host session", self.refusals)
        # grpc.health.v1: SERVING while the site trains, NOT_SERVING once it drains.
        self.health = BoundedHealth(self.refusals)
        self._stubs: dict[str, pb_grpc.CoordinatorStub] = {}  # filled by start()
        self._channels: list[grpc.Channel] = []
        self.witness = (
            WitnessLink(s, self.security, on_answer=st.wake, clock=clock) if s.witness else None
        )
        # A rank silent as long as a suspected peer site is dead (rank_liveness.py).
        self.rank_liveness = RankLiveness(s.ranks, s.failure_timeout_s, clock)
        self.failover = Failover(
            s,
            st,
            stubs=self._stubs,
            rank_keys=self.rank_keys,
            refusals=self.refusals,
            long_polls=self.long_polls,
            witness=self.witness,
            rank_liveness=self.rank_liveness,
        )
        self.admission = Admission(
            settings=s,
            state=st,
            refusals=self.refusals,
            add_joiner=self.failover.ballots.add_joiner_locked,
            tell_values=self.security.require_token or self.security.require_tls,
        )
        self.peer_loop = PeerLoop(
            settings=s,
            state=st,
            stubs=self._stubs,
            admission=self.admission,
            metrics=self.metrics,
            refusals=self.refusals,
            proposing=self.failover.leader.proposing,
        )
        self._server = self._bind(waiters + s.ranks + self.repolls.holds)
        self._joiner = threading.Thread(
            target=self.peer_loop.run, name=f"join-{s.site}", daemon=True
        )

    def _bind(self, workers: int) -> grpc.Server:
        """The gRPC server, bound where the settings say (`address` tells where)."""
        s = self.settings
        interceptors = self.security.server_interceptors(self.where, self.refusals)
        # MalformedRequests: bytes that do not parse are INVALID_ARGUMENT.
        server = channels.control_server(
            pool_size(workers), f"coord-{s.site}", [*interceptors, MalformedRequests()]
        )
        pb_grpc.add_CoordinatorServicer_to_server(self, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        where = f"coordinator for {s.site}"
        bound = channels.add_port(server, self.security, f"{s.host}:{s.port}", where)
        self.address = self.state.address = f"{s.host}:{bound}"
        if self.rank_keys.bound:  # for the launcher of this site's ranks, in this process
            handouts.publish(self.address, self.rank_keys)
        return server

    def set_peers(
        self, peers: Mapping[str, str], proxies: Mapping[str, str | None] | None = None
    ) -> None:
        """Name every other site's coordinator address (and link proxy), before `start`."""
        missing = set(self.site_names) - {self.site} - set(peers)
        if missing:
            raise ValueError(f"no coordinator address for peer sites {sorted(missing)}")
        self.peers = {name: peers[name] for name in self.site_names if name != self.site}
        self.proxies = dict(proxies or {})

    def start(self) -> str:
        """Serve and start joining peers; returns the bound address."""
        if len(self.peers) != len(self.site_names) - 1:
            raise ValueError("set_peers() must name every peer site before start()")
        self._server.start()
        self.set_serving(True)
        host, metrics_port = self.settings.host, self.settings.metrics_port
        if metrics_port is not None:
            self.metrics_address = f"{host}:{self.metrics.serve(host, metrics_port)}"
        self.state.mark_started()
        for name, address in self.peers.items():
            channel = channels.peer_channel(address, self.proxies.get(name), self.security)
            self._channels.append(channel)
            self._stubs[name] = pb_grpc.CoordinatorStub(channel)
        self._joiner.start()
        self.failover.start()
        if self.witness is not None:
            self.witness.start()
        log.info("[%s] coordinator serving on %s", self.site, self.address)
        return self.address

    def set_serving(self, serving: bool) -> None:
        """Answer grpc.health.v1 checks (whole server and the Coordinator service)."""
        answer = health_pb2.HealthCheckResponse
        status = answer.SERVING if serving else answer.NOT_SERVING
        for service in ("", "isthmus.v1.Coordinator"):
            self.health.set(service, status)

    def drain(self) -> None:
        """Say NOT_SERVING (the site is leaving) while still answering peers."""
        self.set_serving(False)

    def leave(self) -> None:
        """Stop joining and heartbeating (after one last heartbeat); peers leaving
        from now on are expected, not news. `stop` does this too."""
        self.set_serving(False)
        self.state.stop()

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving and joining (idempotent)."""
        self.leave()
        self.repolls.release_all()
        self.metrics.close()
        if self._joiner.is_alive():
            self._joiner.join(timeout=self.settings.rpc_timeout_s + 1.0)
        self.failover.join(timeout=self.settings.rpc_timeout_s + 1.0)
        if self.witness is not None:
            self.witness.stop()
        self._server.stop(grace_s).wait(grace_s + 1.0)
        handouts.withdraw(self.address)
        for channel in self._channels:
            channel.close()

    def tell_peers_of_abort(self) -> list[str]:
        """After a local script's error, keeps answering until every peer heard from
        lately has heard of it, at most ``failure_timeout_s`` (a peer silent that long is
        taken for dead anyway); returns the peers that did not hear it."""
        st, s = self.state, self.settings
        with st.cond:
            now = st.clock()
            live = [p for p, seen in st.last_seen.items() if now - seen <= s.failure_timeout_s]
        return st.abort.wait_told(live, s.failure_timeout_s)

    def live_members(self) -> list[str]:
        """Members of the current generation (every site before the first)."""
        return self.state.members or list(self.site_names)

    def __enter__(self) -> Coordinator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what launchers and tests read, from `state` -------------------------------------

    error = _view("error", "Why the job cannot go on, or None.")
    generation = _view("generation", "The membership generation (0 until all are ready).")
    members = _view("members", "The member sites of the current generation.")
    start_step = _view("start_step", "For a site admitted to a running job: its first step.")
    state_source = _view("state_source", "For a site admitted: the member it pulls from.")
    last_seen = _view("last_seen", "When each peer was last heard from (on the clock).")
    joining = _view("joining", "True while this site asks a running job to admit it.")
    excluded = _view("excluded", "True when the job went on without this site.")
    step = _view("step", "The step this site's ranks last reported.")
    finished = _view("finished", "This site's ranks ran their last step.")
    digest = _view("digest", "This site's latest parameter digest and its step.")
    replicas = _view("replicas", "Every site's parameter digests (ReplicaDigests).")
    incarnations = _view("incarnations", "This process's id and the peers' (Incarnations).")
    aborted = _view("abort.line", '"SITE rank R: LINE" once a script raised here or at a peer.')
    aborted_here = _view("abort.here", "The job's abort came from a rank of this site.")

    def wait_ready(self, timeout_s: float) -> list[pb.SiteInfo]:
        """Block until the membership exists; returns the sites in index order
        (``CoordinatorError``: a refused join, or no membership within the timeout)."""
        st = self.state
        with st.cond:
            if not st.cond.wait_for(lambda: st.generation > 0 or st.error is not None, timeout_s):
                raise CoordinatorError(f"[{self.site}] no membership after {timeout_s:.0f}s")
            if st.error is not None:
                raise CoordinatorError(st.error)
            return st.infos_locked(st.members)

    def RegisterRank(self, request, context):  # noqa: N802 (gRPC method name)
        refuse_unless_named(self.security, context, self.where, request.site, "RegisterRank")
        theirs, who = dict(request.fingerprint.fields), f"rank {request.rank}"
        problem = fingerprint_problem(self.settings.fingerprint, theirs, self.site, who)
        if problem is None and request.site != self.site:
            problem = (
                f"rank registered for site {request.site[:64]!r} at the coordinator of {self.site}"
            )
        if problem is None and (request.world_size != self.ranks or request.rank >= self.ranks):
            size = f"rank {request.rank} of world size {request.world_size}"
            problem = f"{size} does not fit site {self.site} with {self.ranks} ranks"
        # The ranks of a job of one site run no lanes: they register only their keys.
        address = request.lane_address
        if problem is None and (len(address) > MAX_FIELD_CHARS or (self.peers and not address)):
            problem = "lane_address must be a non-empty host:port"
        if problem is not None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        refused = self.rank_keys.register(request.rank, request.rank_key)
        if refused is not None and refused.stranger:
            # Not the process the launcher started as this rank: nothing recorded.
            self.refusals.note(context.peer(), "RegisterRank from a stranger", refused.why)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{self.where}: {refused.why}")
        if refused is not None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, refused.why)
        self.rank_liveness.registered(request.rank)
        if address:
            with self.state.cond:
                self.state.register_lane_locked(request.rank, address)
                if self.state.local_ready_locked():
                    self.rank_liveness.left_for = None  # every rank is back
        return pb.RegisterRankResponse()

    def GetMembership(self, request, context):  # noqa: N802
        st = self.state
        # A registered rank's polls (with its key) wait in the ranks' share, unpaced;
        # anyone else's share the two slots of their host, and are paced.
        rank = self.rank_keys.rank_of(request.rank_key) if request.rank_key else None
        share = (
            (f"{self.site}'s ranks", 2 * self.ranks) if rank is not None else ("GetMembership", 2)
        )
        polls = self.long_polls.wait(context, *share, paced=rank is None)
        # A rank's watcher polls without pause: its beat (inter/control/rank_liveness.py);
        # a host agent's poll beats for every rank whose watch it holds.
        watcher = request.known_generation > 0
        try:
            beating = beating_ranks(rank, request.vouched_rank_keys, self.rank_keys.rank_of)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        beat = self.rank_liveness.polling(beating, watcher=watcher, ended_by=context.add_callback)
        with beat, polls as may_wait:
            wait_s = min(request.wait_ms, MAX_WAIT_MS) / 1000.0 if may_wait else 0.0
            if beating:
                # A poll is a beat only while its caller can be there: a frozen node leaves
                # its agent's poll open (issue 59). Held at most half the silence, a silent
                # caller is found within 1.5 x of it.
                wait_s = min(wait_s, self.rank_liveness.silence_s / 2)
            st.await_membership(request.known_generation, st.clock() + wait_s)
        with st.cond:
            if st.error is not None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, st.error)
            if not st.running:
                return pb.GetMembershipResponse(generation=0)
            # A caller that knows this generation has its sites: every site's lanes in each
            # watcher's answer made the polls O(ranks²) bytes a second.
            known = request.known_generation == st.generation
            return pb.GetMembershipResponse(
                generation=st.generation,
                sites=[] if known else st.infos_locked(st.members),
                start_step=st.start_step,
                state_source=st.state_source,
                suspects=st.suspects_locked(),
            )

    Join = _handled_by("Join", "site.name", "admission", "answer_join")
    Heartbeat = _handled_by("Heartbeat", "site", "peer_loop", "answer_heartbeat")
    CommitStep = _handled_by("CommitStep", "site", "failover", "commit_step")
    CommitHostStep = _handled_by("CommitHostStep", "site", "failover", "commit_host_step")
    SiteVote = _handled_by("SiteVote", "site", "failover", "site_vote")
    Propose = _handled_by("Propose", "leader", "failover", "propose")

    def HostSession(self, request_iterator, context):  # noqa: N802
        self.host_sessions.hold_for_stream(context)
        for request in request_iterator:  # each vote checked as CommitHostStep checks it
            refuse_unless_named(self.security, context, self.where, request.site, "HostSession")
            yield self.failover.commit_host_step(request, context, in_session=True)

    def AbortJob(self, request, context):  # noqa: N802
        refuse_unless_named(self.security, context, self.where, request.site, "AbortJob")
        problem = abort_problem(request.reason)
        if request.site != self.site or request.rank >= self.ranks:
            rank = f"rank {request.rank} of site {request.site[:64]!r}"
            problem = f"{rank} is not one of {self.site}'s {self.ranks} ranks"
        if problem is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if not self.rank_keys.speaks_for(request.rank, request.rank_key):
            why = f"an abort for rank {request.rank} without its key"
            self.refusals.note(context.peer(), why)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{self.where}: {why}")
        self.state.abort.raise_here(request.rank, request.reason)
        return pb.AbortJobResponse()

    def ReportProgress(self, request, context):  # noqa: N802
        refuse_unless_named(self.security, context, self.where, request.site, "ReportProgress")
        problem = report_problem(request, self.site)
        if problem is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if not self.rank_keys.is_any_rank(request.rank_key):
            why = "progress without the key of a registered rank"
            self.refusals.note(context.peer(), why)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{self.where}: {why}")
        self.metrics.record_step(request)
        st = self.state
        with st.cond:
            st.report_progress_locked(
                request.step, request.finished, request.digest_step, request.digest
            )
        replicas, digest = st.replicas, request.digest
        divergence = replicas.record(self.site, request.digest_step, digest, request.model_layout)
        if divergence:
            self.metrics.replicas_identical.labels(self.site).set(0)
        # A script's rank waits on this before step 0 (deploy/api.py): that every
        # member starts from these parameters, or the divergence naming why not.
        agreed = bool(request.digest) and request.digest_step == 0
        agreed = agreed and replicas.agree_at(0, st.members) is True
        return pb.ReportProgressResponse(divergence=divergence or "", agreed=agreed)
