"""The control plane of one site: rank registration, joining peer sites, membership.

One `Coordinator` runs per site. The site's ranks register their lane addresses
with it (site-local traffic). It joins every peer site's coordinator with the job
fingerprint; a peer whose fingerprint differs is refused with a message naming
every differing key, and both sides report it. Once every site is present and
ready, the membership gets generation 1 and ranks learn their peers' lanes from a
long-polling `GetMembership`. Heartbeats then record when each peer was last heard.
The membership itself lives in `self.state` (inter/control/state.py), changed only by
its named transitions; the handlers here, the failover loop and the peer loop call them.

Every RPC carries a deadline and every wait a timeout (docs/design.md invariant 5).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from isthmus.inter.bounds import BoundedHealth, RefusalLog, RePolls, WaitSlots, pool_size
from isthmus.inter.control import rank_keys as handouts
from isthmus.inter.control.admission import MAX_FIELD_CHARS, JoinClaims, on_join, site_problem
from isthmus.inter.control.channels import MESSAGE_LIMITS, peer_channel, server_options
from isthmus.inter.control.failover import Failover
from isthmus.inter.control.fingerprint import fingerprint_problem
from isthmus.inter.control.incarnations import Incarnations
from isthmus.inter.control.peer_loop import PeerLoop
from isthmus.inter.control.rank_keys import RankKeys
from isthmus.inter.control.replicas import ReplicaDigests
from isthmus.inter.control.state import CoordinatorState
from isthmus.inter.control.witness import WitnessLink
from isthmus.inter.malformed import MalformedRequests
from isthmus.inter.metrics import SiteMetrics, report_problem
from isthmus.inter.security import INSECURE, SiteSecurity, refuse_unless_named
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_WAIT_MS = 30_000


class CoordinatorError(RuntimeError):
    """The job cannot go on: a refused join, a timeout, an invalid peer."""


class Coordinator(pb_grpc.CoordinatorServicer):
    """One site's coordinator: a gRPC server plus a thread that joins the peers.

    Args:
        site: this site's name; must be in `site_names`.
        site_names: every site of the job, in index order (fixes summation order).
        ranks: ranks expected to register from this site.
        fingerprint: flattened job fingerprint every party must match.
        peers: peer site name -> coordinator address, for every other site; may
            instead be given by `set_peers` before `start` (the address of a server
            bound to port 0 is known only once it is constructed).
        proxies: peer site name -> HTTP CONNECT proxy URL of the link to it (optional).
        host: interface to bind; port 0 picks a free port (see `address`).
        join_timeout_s: how long to wait for every site to be present and ready.
        rpc_timeout_s: deadline of each RPC to a peer.
        heartbeat_s: period of heartbeats to peers once joined.
        metrics_port: serve Prometheus /metrics on this port (0 = any free port);
            None serves none. `metrics_address` tells where it is.
        security: mutual TLS and the job token for this server and the channels to
            peers (`isthmus.inter.security`); None = plaintext, no token.
        failure_timeout_s: a member not heard from for this long is suspected dead.
        min_sites: never go on with fewer live sites.
        quorum_wait_s: how long a site without quorum waits before it stops.
        vote_window: votes for steps further than this past the step the site runs
            are refused. first_step: a resumed job's first step.
        witness: host:port of the job's witness (inter/control/witness.py), if it has one.
        rank_keys: which key each local rank registers with; by default one random
            key per rank, which the site's launcher in this process hands its ranks
            (inter/control/rank_keys.py).
    """

    def __init__(
        self,
        *,
        site: str,
        site_names: list[str],
        ranks: int,
        fingerprint: Mapping[str, str],
        site_ranks: Sequence[int] | None = None,
        peers: Mapping[str, str] | None = None,
        proxies: Mapping[str, str | None] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        join_timeout_s: float = 120.0,
        rpc_timeout_s: float = 5.0,
        heartbeat_s: float = 1.0,
        metrics_port: int | None = None,
        security: SiteSecurity | None = None,
        failure_timeout_s: float = 10.0,
        min_sites: int = 1,
        quorum_wait_s: float = 60.0,
        vote_window: int = 64,
        first_step: int = 0,
        witness: str | None = None,
        rank_keys: RankKeys | None = None,
    ) -> None:
        # First: it checks the site, the ranks and the failure timeout.
        self.state = CoordinatorState(
            site=site, site_names=site_names, ranks=ranks, failure_timeout_s=failure_timeout_s
        )
        """The membership and its transitions, shared with failover and the peer loop."""
        self.site = site
        self.site_names = list(site_names)
        self.index = site_names.index(site)
        self.ranks = ranks
        self.site_ranks = list(site_ranks) if site_ranks is not None else [ranks] * len(site_names)
        """Each site's rank count, by index: sites may differ in size (one lane per rank)."""
        if len(self.site_ranks) != len(site_names) or self.site_ranks[self.index] != ranks:
            raise ValueError(
                f"site_ranks {self.site_ranks} must give each of {len(site_names)} sites its "
                f"ranks, {ranks} for {site}"
            )
        self.fingerprint = dict(fingerprint)
        self.peers: dict[str, str] = {}
        self.proxies: dict[str, str | None] = {}
        if peers is not None:
            self.set_peers(peers, proxies)
        self.join_timeout_s = join_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self.heartbeat_s = heartbeat_s
        self._digest: tuple[int, str] = (0, "")
        self.incarnations = Incarnations()  # this process's id and the peers'
        self.peer_steps: dict[str, int] = {}
        self.step = 0
        self.finished = False
        self.finished_peers: set[str] = set()
        self.replicas = ReplicaDigests(site)
        self.rank_keys = rank_keys or RankKeys.draw(site, ranks)
        """Which process speaks for each local rank (the key its launcher handed it)."""
        self.asked_to_join: set[str] = set()
        """Sites whose join of the running job awaits their answer at their own address."""
        self._stubs: dict[str, pb_grpc.CoordinatorStub] = {}
        self._channels: list[grpc.Channel] = []
        self.security = security or INSECURE
        self.where = f"coordinator of {site}"
        self.witness = WitnessLink.of(self, witness) if witness else None
        self.failover = Failover(
            self,
            min_sites=min_sites,
            quorum_wait_s=quorum_wait_s,
            vote_window=vote_window,
            first_step=first_step,
        )
        self.metrics = SiteMetrics(site)
        self.metrics_address: str | None = None
        self._metrics_port = metrics_port
        self._host = host
        # Long polls (GetMembership, CommitStep, SiteVote) wait on a slot each; a call
        # without one answers at once (inter/bounds.py): the legitimate waiters are this
        # site's ranks and the other sites' coordinators, a few calls each.
        self.refusals = RefusalLog(self.where)
        self.join_claims = JoinClaims(self.refusals)
        """What joins in each peer's name claimed, until the peer's own answer settles it."""
        # Each caller holds its share only (a rank two, a peer site's votes two, the
        # site's ranks' membership polls two a rank, anyone else's two a host), and one
        # answered at once too often is paced unless it proved a rank's key
        # (inter/bounds.py, issue 33 row 9).
        waiters = 2 * ranks + 2 * len(self.site_names) + 2
        self.repolls = RePolls()
        self.long_polls = WaitSlots(waiters, "long poll", self.refusals, self.repolls)
        # grpc.health.v1: SERVING while the site trains, NOT_SERVING once it drains.
        self.health = BoundedHealth(self.refusals)

        self._server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=pool_size(waiters + self.repolls.holds),
                thread_name_prefix=f"coord-{site}",
            ),
            options=server_options(MESSAGE_LIMITS),
            interceptors=[
                *self.security.server_interceptors(self.where),
                MalformedRequests(),  # bytes that do not parse: INVALID_ARGUMENT
            ],
        )
        pb_grpc.add_CoordinatorServicer_to_server(self, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        bound = self.security.add_port(self._server, f"{host}:{port}")
        if bound == 0:
            raise OSError(f"coordinator for {site} could not bind {host}:{port}")
        self.address = f"{host}:{bound}"
        self.state.address = self.address
        if self.rank_keys.bound:  # for the launcher of this site's ranks, in this process
            handouts.publish(self.address, self.rank_keys)
        self._peer_loop = PeerLoop(self)
        self._joiner = threading.Thread(
            target=self._peer_loop.run, name=f"join-{site}", daemon=True
        )

    # -- lifecycle ---------------------------------------------------------------

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
        if self._metrics_port is not None:
            port = self.metrics.serve(self._host, self._metrics_port)
            self.metrics_address = f"{self._host}:{port}"
        self.state.mark_started()
        for name, address in self.peers.items():
            channel = peer_channel(address, self.proxies.get(name), self.security)
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
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
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
            self._joiner.join(timeout=self.rpc_timeout_s + 1.0)
        self.failover.join(timeout=self.rpc_timeout_s + 1.0)
        if self.witness is not None:
            self.witness.stop()
        self._server.stop(grace_s).wait(grace_s + 1.0)
        handouts.withdraw(self.address)
        for channel in self._channels:
            channel.close()

    def peer_stub(self, name: str) -> pb_grpc.CoordinatorStub:
        """The stub of peer site `name`'s coordinator (one channel per peer)."""
        return self._stubs[name]

    def peer_stubs(self) -> Mapping[str, pb_grpc.CoordinatorStub]:
        """Every peer's stub, by site name (filled by `start`)."""
        return self._stubs

    def live_members(self) -> list[str]:
        """Members of the current generation (every site before the first)."""
        return self.state.members or list(self.site_names)

    def __enter__(self) -> Coordinator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the membership, read from `state` (what launchers and tests read) --------------

    @property
    def error(self) -> str | None:
        """Why the job cannot go on, or None."""
        return self.state.error

    @property
    def generation(self) -> int:
        """The membership generation (0 until every site is present and ready)."""
        return self.state.generation

    @property
    def members(self) -> list[str]:
        """The member sites of the current generation."""
        return self.state.members

    @property
    def start_step(self) -> int:
        """For a site admitted to a running job: the step it starts at."""
        return self.state.start_step

    @property
    def state_source(self) -> str:
        """For a site admitted to a running job: the member it pulls the state from."""
        return self.state.state_source

    @property
    def last_seen(self) -> Mapping[str, float]:
        """When each peer was last heard from (time.monotonic)."""
        return self.state.last_seen

    @property
    def digest(self) -> tuple[int, str]:
        """This site's latest parameter digest and its step, as its rank 0 reported it."""
        return self._digest

    @property
    def joining(self) -> bool:
        """True while this site asks a running job to admit it (restarted or left out)."""
        return self.state.joining

    @property
    def excluded(self) -> bool:
        """True when the job went on without this site (it was cut off without quorum)."""
        return self.state.excluded

    def wait_ready(self, timeout_s: float) -> list[pb.SiteInfo]:
        """Block until the membership exists; returns the sites in index order.

        Raises:
            CoordinatorError: a refused join, or no membership within the timeout.
        """
        st = self.state
        with st.cond:
            if not st.cond.wait_for(lambda: st.generation > 0 or st.error is not None, timeout_s):
                raise CoordinatorError(f"[{self.site}] no membership after {timeout_s:.0f}s")
            if st.error is not None:
                raise CoordinatorError(st.error)
            return st.infos_locked(st.members)

    def _check_fingerprint(
        self, theirs: pb.JobFingerprint, who: str, *, to_caller: bool = False
    ) -> str | None:
        # Without the job token or TLS anyone can call: what goes back to the caller
        # names the keys that differ, not this job's values (the log here has them).
        values = not to_caller or self.security.require_token or self.security.require_tls
        return fingerprint_problem(
            self.fingerprint, dict(theirs.fields), self.site, who, values=values
        )

    # -- RPC handlers ---------------------------------------------------------------

    def RegisterRank(self, request, context):  # noqa: N802 (gRPC method name)
        refuse_unless_named(self.security, context, self.where, request.site, "RegisterRank")
        problem = self._check_fingerprint(request.fingerprint, f"rank {request.rank}")
        if problem is None and request.site != self.site:
            problem = (
                f"rank registered for site {request.site[:64]!r} at the coordinator of {self.site}"
            )
        if problem is None and (request.world_size != self.ranks or request.rank >= self.ranks):
            problem = (
                f"rank {request.rank} of world size {request.world_size} does not fit "
                f"site {self.site} with {self.ranks} ranks"
            )
        # The ranks of a job of one site run no lanes: they register only their keys.
        address = request.lane_address
        if problem is None and (len(address) > MAX_FIELD_CHARS or (self.peers and not address)):
            problem = "lane_address must be a non-empty host:port"
        if problem is not None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        refused = self.rank_keys.register(request.rank, request.rank_key)
        if refused is not None and refused.stranger:
            # Not the process the launcher started as this rank: nothing recorded.
            self.refusals.note(context.peer(), f"RegisterRank: {refused.why}")
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{self.where}: {refused.why}")
        if refused is not None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, refused.why)
        if address:
            with self.state.cond:
                self.state.register_lane_locked(request.rank, address)
        return pb.RegisterRankResponse()

    def Join(self, request, context):  # noqa: N802
        refuse_unless_named(self.security, context, self.where, request.site.name, "Join")
        who = request.site.name[:64] or "a peer"
        problem = answer = site_problem(self, request.site, request.ready, request.incarnation)
        if problem is None and (problem := self._check_fingerprint(request.fingerprint, who)):
            answer = self._check_fingerprint(request.fingerprint, who, to_caller=True)
        if problem is not None:
            log.warning("[%s] refused join from %s: %s", self.site, context.peer(), problem)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, answer or problem)
        st = self.state
        with st.cond:
            # Not even "heard from": anyone can send a join in a site's name; the
            # site's answers to this site's own calls say whether it is alive.
            news = on_join(self, request, context.peer())
            return pb.JoinResponse(
                site=st.own_info_locked(),
                ready=st.local_ready_locked(),
                generation=st.generation if news else 0,
                incarnation=self.incarnations.mine,
            )

    def GetMembership(self, request, context):  # noqa: N802
        st = self.state
        # A registered rank's polls (with its key) wait in the ranks' share, unpaced;
        # anyone else's share the two slots of their host, and are paced.
        if request.rank_key and self.rank_keys.is_any_rank(request.rank_key):
            polls = self.long_polls.wait(
                context, f"{self.site}'s ranks", 2 * self.ranks, paced=False
            )
        else:
            polls = self.long_polls.wait(context, "GetMembership", 2)
        with polls as may_wait:
            wait_s = min(request.wait_ms, MAX_WAIT_MS) / 1000.0 if may_wait else 0.0
            st.await_membership(request.known_generation, time.monotonic() + wait_s)
        with st.cond:
            if st.error is not None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, st.error)
            if not st.running:
                return pb.GetMembershipResponse(generation=0)
            # A caller that knows this generation has its sites: each rank's watcher asks
            # once a second, and every site's lanes in each answer made the site's polls
            # O(ranks²) bytes a second (docs/benchmarks.md, "The control plane at scale").
            known = request.known_generation == st.generation
            return pb.GetMembershipResponse(
                generation=st.generation,
                sites=[] if known else st.infos_locked(st.members),
                start_step=st.start_step,
                state_source=st.state_source,
                suspects=st.suspects_locked(),
            )

    def Heartbeat(self, request, context):  # noqa: N802
        refuse_unless_named(self.security, context, self.where, request.site, "Heartbeat")
        if request.site not in self.peers:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown site {request.site[:64]!r}")
        if not self.replicas.valid(request.digest):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "digest must be 64 lowercase hex digits"
            )
        st = self.state
        with st.cond:
            st.heard_from_locked(request.site)
            self.peer_steps[request.site] = request.step
            if request.finished:
                self.finished_peers.add(request.site)
            st.cond.notify_all()  # a peer's progress: waiters re-check
        self.metrics.site_up.labels(self.site, request.site).set(1)
        refused = self.replicas.claim(
            request.site, request.digest_step, request.digest, live=self.step
        )
        if refused is not None:  # the heartbeat counts; its digest does not
            self.refusals.note(context.peer(), f"Heartbeat in {request.site}'s name: {refused}")
        digest = self.replicas.own(request.confirm_step) if request.confirm_digest else ""
        with st.cond:
            return pb.HeartbeatResponse(
                generation=st.generation,
                member=request.site in st.members,
                incarnation=self.incarnations.mine,
                confirmed_digest=digest,
                site=st.own_info_locked(),
                ready=st.local_ready_locked(),
                proposed_members=self.failover.leader.proposing.get(request.confirm_generation, []),
            )

    def CommitStep(self, request, context):  # noqa: N802
        refuse_unless_named(self.security, context, self.where, request.site, "CommitStep")
        return self.failover.commit_step(request, context)

    def CommitHostStep(self, request, context):  # noqa: N802
        refuse_unless_named(self.security, context, self.where, request.site, "CommitHostStep")
        return self.failover.commit_host_step(request, context)

    def SiteVote(self, request, context):  # noqa: N802
        refuse_unless_named(self.security, context, self.where, request.site, "SiteVote")
        return self.failover.site_vote(request, context)

    def Propose(self, request, context):  # noqa: N802
        refuse_unless_named(self.security, context, self.where, request.leader, "Propose")
        return self.failover.propose(request, context)

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
        with self.state.cond:
            self.step = request.step
            self.finished = self.finished or request.finished
            if request.digest:
                self._digest = (request.digest_step, request.digest)
        divergence = self.replicas.record(self.site, request.digest_step, request.digest)
        if divergence:
            self.metrics.replicas_identical.labels(self.site).set(0)
        return pb.ReportProgressResponse(divergence=divergence or "")
