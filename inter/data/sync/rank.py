"""One rank's cross-site sync, opened with one call: :func:`open_rank_sync`.

It builds the rank's data plane in the order each part needs the one before: the lane
(listening, so its address can be registered with the site's coordinator), the join
(the membership the job starts or goes on in), the membership (which opens the member
sites' lanes and moves the lane to the joined generation: one write, no placeholder),
the all-reduce and the gradient sync the trainer calls. From then on the rank moves
between generations by one call, :meth:`SiteMembership.adopt`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from isthmus.inter.control.coordinator_client import CoordinatorClient, Membership, SiteInfo
from isthmus.inter.data.codecs.chain import make_codec
from isthmus.inter.data.codecs.spec import parse_codec_spec
from isthmus.inter.data.lane.mailbox import MAX_STEPS_AHEAD
from isthmus.inter.data.lane.peer import TRANSPORTS, LanePeer
from isthmus.inter.data.lane.server import RESERVED_THREADS, LaneServer
from isthmus.inter.data.round.allreduce import CrossSiteAllReduce
from isthmus.inter.data.state.offers import Admitted
from isthmus.inter.data.state.transfer import ExpectedState, pull_state
from isthmus.inter.data.sync.gradient import LaneGradientSync
from isthmus.inter.data.sync.membership import Generation, SiteMembership
from isthmus.inter.data.transport.chunk_size import descriptors_needed, raise_descriptor_limit
from isthmus.inter.data.transport.link_watch import LinkWatch
from isthmus.inter.security import SiteSecurity
from isthmus.proto import lane_pb2

__all__ = ["RankSync", "RankSyncSettings", "open_rank_sync"]

log = logging.getLogger(__name__)

_REGISTER_TIMEOUT_S = 10.0
"""How long registering the lane may wait for the site's coordinator to come up."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSyncSettings:
    """What one rank's cross-site sync is opened with (deploy builds it from the job)."""

    site: str
    rank: int  # this rank in its site: it pairs with the same rank of every other site
    world_size: int  # the ranks of this site
    job_sites: tuple[str, ...]  # in the job's order (the lane's first generation)
    fingerprint: Mapping[str, str]
    """The job's fingerprint, which the coordinator checks when the lane registers."""
    codec: str  # a codec spec (inter/data/codecs/spec.py), e.g. "int8+zstd:1"
    chunk_bytes: int  # bytes of fp32 values per chunk, a multiple of 4
    timeout_s: float  # limit on one round, and on waiting for the job's membership at the start
    decision_timeout_s: float  # how long a step's vote may wait for the job's decision
    rounds_in_flight: int = 4
    workers: int | None = None  # codec threads; None: allreduce.default_workers
    steps_between_rounds: int = 1
    """Training steps from one round to the next (DiLoCo's inner steps): a lane holds
    chunks a few rounds ahead, not a few steps."""
    lane_host: str = "127.0.0.1"
    lane_port: int = 0  # 0: one the OS picks
    advertise_host: str = ""
    """The host the other sites reach the lane at; "": ``lane_host``."""
    lane_connections: int = 1  # TCP connections to each peer lane
    transport: str = "auto"  # inter/data/lane/peer.py's TRANSPORTS
    mailbox_bytes: int | None = None  # None: unbounded
    proxies: Mapping[str, str] = field(default_factory=dict)
    """The proxy to each other site's lanes, by site name (an emulated link)."""
    security: SiteSecurity | None = None  # mutual TLS and the job token; None: plaintext

    def __post_init__(self) -> None:
        # Refused here, before a lane listens or the coordinator hears of this rank.
        at_least_one = ("rounds_in_flight", "workers", "steps_between_rounds", "lane_connections")
        checks = (
            (self.site in self.job_sites, f"site {self.site!r} is not one of {self.job_sites}"),
            (0 <= self.rank < self.world_size, f"rank {self.rank} not in [0, {self.world_size})"),
            (
                self.chunk_bytes >= 4 and self.chunk_bytes % 4 == 0,
                f"chunk_bytes must be a positive multiple of 4, got {self.chunk_bytes}",
            ),
            *(
                (getattr(self, n) > 0, f"{n} must be > 0, got {getattr(self, n)}")
                for n in ("timeout_s", "decision_timeout_s")
            ),
            *(  # only workers may be None
                ((n == "workers" and v is None) or v >= 1, f"{n} must be >= 1, got {v}")
                for n, v in ((n, getattr(self, n)) for n in at_least_one)
            ),
            (
                self.transport in TRANSPORTS,
                f"transport must be one of {TRANSPORTS}, got {self.transport!r}",
            ),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        parse_codec_spec(self.codec)  # a ValueError that names the spec

    @property
    def handler_threads(self) -> int:
        """The lane's handler threads: a stream per connection per round in flight from
        every peer, twice over (a round's streams may outlive it briefly), and the
        reserved ones."""
        peers = len(self.job_sites) - 1
        return RESERVED_THREADS + max(24, 2 * peers * self.lane_connections * self.rounds_in_flight)


@dataclass(slots=True, eq=False)
class RankSync:
    """A rank's open cross-site sync (see the module docstring); :func:`open_rank_sync`
    builds it, :meth:`close` ends it."""

    settings: RankSyncSettings
    lane: LaneServer
    joined: Membership
    """The membership this rank first learned (a running job's names the state to pull)."""
    membership: SiteMembership
    sync: LaneGradientSync  # what the trainer calls (it votes and follows each step's decision)
    watch: LinkWatch  # the lane's link to each peer site, read once a step

    def links(self) -> dict[str, dict]:
        """Each member site's link from this lane since the last call (``Link.sample``)."""
        return self.watch.sample(
            [s for s in self.membership.member_names if s != self.settings.site]
        )

    def pull_state(
        self, source: SiteInfo, *, generation: int, step: int, rank: int, expected: ExpectedState
    ) -> dict[str, torch.Tensor]:
        """The training state after ``step`` that ``rank`` of site ``source`` offers,
        pulled over that rank's lane (``PullState``); that lane checks the pull with this
        rank's lane, which made its nonce (``ConfirmPull``). A piece that claims a
        tensor, dtype or shape not ``expected`` is refused before it is allocated
        (StateTransferError)."""
        peer = _open_peer(self.settings, source, rank)
        nonce = self.lane.handoff.expect_pull(generation, step, rank, source.name)
        try:
            return pull_state(
                peer.stub,
                generation=generation,
                step=step,
                rank=rank,
                site=self.settings.site,
                from_rank=self.settings.rank,
                nonce=nonce,
                timeout_s=self.settings.timeout_s,
                expected=expected,
            )
        finally:
            self.lane.handoff.forget(nonce)
            peer.close()

    def offer_state(
        self,
        generation: int,
        step: int,
        state: Mapping[str, torch.Tensor],
        *,
        sites: Sequence[SiteInfo],
        admitted: Sequence[str],
    ) -> None:
        """Offers the state after ``step`` to the ranks of the sites ``admitted`` in
        ``generation`` (whose lanes ``sites`` names), each once, for twice the sync
        timeout at most (a joining rank's pull gives up after one)."""
        infos = {info.name: info for info in sites}
        joiners = {name: len(infos[name].lane_addresses) for name in admitted if name in infos}
        me = self.settings
        if not joiners:
            log.warning(
                "[%s/%d] the commit after step %d names no admitted site: the state is "
                "offered to no one",
                *(me.site, me.rank, step),
            )

        def confirm(
            site: str, rank: int, request: lane_pb2.ConfirmPullRequest, timeout: float
        ) -> None:
            peer = _open_peer(self.settings, infos[site], rank)
            try:
                peer.stub.ConfirmPull(request, timeout=timeout)
            finally:
                peer.close()

        admitted_sites = Admitted(
            source=me.site, ranks=me.world_size, rank=me.rank, joiners=joiners, confirm=confirm
        )
        self.lane.offers.offer(generation, step, state, admitted_sites, ttl_s=2 * me.timeout_s)

    def close(self) -> None:
        """Stops the rounds, the membership's watcher, the peers' channels and the lane
        (the coordinator's client stays its owner's)."""
        self.sync.close()
        self.lane.stop(grace=5.0)


def open_rank_sync(settings: RankSyncSettings, client: CoordinatorClient) -> RankSync:
    """Opens the rank's cross-site sync (see the module docstring), in the generation
    the job starts or goes on in; ``client`` stays the caller's to close.

    Raises ValueError (bad settings: nothing is opened), OSError (the host's limit on
    open files is below what the job's lanes may hold) or TimeoutError (no membership
    within ``settings.timeout_s``: what was opened is closed again).
    """
    codec = make_codec(settings.codec)
    raise_descriptor_limit(
        descriptors_needed(len(settings.job_sites) - 1, settings.lane_connections)
    )
    watch = LinkWatch()
    with contextlib.ExitStack() as undo:
        lane = _open_lane(settings, codec.name)
        undo.callback(lane.stop, 0)
        joined = _join(settings, client, lane)
        membership = SiteMembership(
            client=client,
            site=settings.site,
            rank=settings.rank,
            lane=lane,
            make_peer=functools.partial(_open_peer, settings, watch=watch),
            joined=Generation.of(joined),
            decision_timeout_s=settings.decision_timeout_s,
        )
        undo.callback(membership.close)
        allreduce = CrossSiteAllReduce(
            membership=membership,
            codec=codec,
            chunk_bytes=settings.chunk_bytes,
            timeout_s=settings.timeout_s,
            workers=settings.workers,
        )
        undo.callback(allreduce.close)
        sync = LaneGradientSync(allreduce, rounds_in_flight=settings.rounds_in_flight)
        undo.pop_all()  # open: RankSync.close ends it from here
    return RankSync(settings, lane, joined, membership, sync, watch)


def _open_lane(settings: RankSyncSettings, codec: str) -> LaneServer:
    """The rank's lane server, listening."""
    lane = LaneServer(
        # A peer learns this lane's address only from membership generation 1, and may
        # start its first round before this rank has heard of the membership itself:
        # the lane is in generation 1, the job's sites in the job's order, until the
        # rank adopts the generation it joins (chunks of a later generation are held
        # until it does).
        site_index=settings.job_sites.index(settings.site),
        num_sites=len(settings.job_sites),
        generation=1,
        codec=codec,
        chunk_bytes=settings.chunk_bytes,
        host=settings.lane_host,
        port=settings.lane_port,
        security=settings.security,
        mailbox_bytes=settings.mailbox_bytes,
        steps_ahead=MAX_STEPS_AHEAD * settings.steps_between_rounds,
        max_workers=settings.handler_threads,
    )
    lane.rank = settings.rank
    return lane


def _join(settings: RankSyncSettings, client: CoordinatorClient, lane: LaneServer) -> Membership:
    """Registers the lane's address (where the other sites reach it) and waits for the
    job's membership."""
    port = lane.address.rsplit(":", 1)[1]
    client.register_rank(
        site=settings.site,
        rank=settings.rank,
        world_size=settings.world_size,
        lane_address=f"{settings.advertise_host or settings.lane_host}:{port}",
        fingerprint=settings.fingerprint,
        timeout_s=_REGISTER_TIMEOUT_S,
    )
    return client.wait_membership(settings.timeout_s)


def _open_peer(
    settings: RankSyncSettings, info: SiteInfo, rank: int, watch: LinkWatch | None = None
) -> LanePeer:
    """The lane client of ``rank`` at site ``info`` (through its proxy, if any), its
    connections watched by ``watch`` (the membership's peers)."""
    return LanePeer(
        info.lane_addresses[rank],
        proxy=settings.proxies.get(info.name),
        connections=settings.lane_connections,
        chunk_bytes=settings.chunk_bytes,
        security=settings.security,
        transport=settings.transport,
        link=watch.link(info.name) if watch is not None else None,
    )
