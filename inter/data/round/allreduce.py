"""The cross-site all-reduce over lanes (docs/design.md, "Cross-site algorithm").

Chunk ``c`` of a round is owned by site ``(c + step + group) % num_sites``; rotating
with step and group spreads the owners' extra work. Every other site sends the owner
its encoded chunk (CONTRIBUTION); the owner decodes all contributions, its own too,
sums them in site-index order, encodes the sum once and sends those same bytes
(RESULT) to every site; every site, the owner included, keeps ``decode(result)``.
So all sites hold bitwise-identical values whatever the codec. The round itself is
:class:`~isthmus.inter.data.round.pipeline.RoundPipeline`; this module owns the lane's settings,
its encode/decode pool, its codec state and the statistics. The membership it runs
under is the lane server's (:attr:`LaneServer.members`, the one copy on a rank).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent import futures

import torch

from isthmus.inter.data.codecs.chain import CodecChain
from isthmus.inter.data.lane.peer import LanePeer
from isthmus.inter.data.lane.server import LaneServer
from isthmus.inter.data.round.context import Members
from isthmus.inter.data.round.pipeline import (
    AbortSignal,
    CrossSiteError,
    RoundPipeline,
    RoundStats,
    RoundView,
)

__all__ = ["CrossSiteAllReduce", "CrossSiteError", "RoundStats", "default_workers"]

log = logging.getLogger("isthmus.round")


def default_workers() -> int:
    """Encode/decode threads per lane: a few, never more than the cores."""
    return max(1, min(4, os.cpu_count() or 1))


class CrossSiteAllReduce:
    """All-reduces flat fp32 buffers with the same rank of every other site (or the
    ranks a round names, between sites of different sizes).

    The membership its rounds run under is the lane server's. A rank's all-reduce is
    built without one and moved to each generation by
    :meth:`~isthmus.inter.data.sync.membership.SiteMembership.adopt` (through
    :meth:`reconfigure`; inter/data/sync/rank.py wires it); one used alone (tests, the
    lane benchmark) is given a fixed membership here.

    Args:
        server: this rank's lane server (receives from every peer); it keeps the
            membership (``site_index``, ``num_sites``, ``generation`` are set on it).
        codec: the job's codec; must match the server's and every peer's.
        chunk_bytes: chunk size in bytes (a multiple of 4, equal to the server's).
        timeout_s: limit on one whole round, from call to last acknowledgement.
        workers: encode/decode threads (default :func:`default_workers`).
        site_index, num_sites, peers, generation: a fixed membership, for an
            all-reduce used alone: this site's index, the live sites, the lane client
            of every other site by index and the generation stamped on every chunk.
            Without them the server's membership stands, with no peers, until
            :meth:`reconfigure`.
    """

    def __init__(
        self,
        *,
        server: LaneServer,
        codec: CodecChain,
        chunk_bytes: int = 1 << 20,
        timeout_s: float = 60.0,
        workers: int | None = None,
        site_index: int | None = None,
        num_sites: int | None = None,
        peers: dict[int, LanePeer] | None = None,
        generation: int = 0,
    ) -> None:
        members = None
        if site_index is not None or num_sites is not None or peers is not None:
            if site_index is None or num_sites is None or peers is None:
                raise ValueError("a fixed membership needs site_index, num_sites and peers")
            members = Members(generation, site_index, num_sites, server.members.site_names)
            expected = set(range(num_sites)) - {site_index}
            if set(peers) != expected:
                raise ValueError(f"peers must cover sites {sorted(expected)}, got {sorted(peers)}")
        if chunk_bytes != server.chunk_bytes:
            raise ValueError(f"chunk_bytes {chunk_bytes} != server's {server.chunk_bytes}")
        if codec.name != server.codec:
            raise ValueError(f"codec {codec.name!r} != server's {server.codec!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        workers = default_workers() if workers is None else workers
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.server = server
        if members is not None and members != server.members:
            server.set_members(members)  # moving clears the mailbox: only when it differs
        self.peers: dict[int, LanePeer] = peers if peers is not None else {}
        self.codec = codec
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.workers = workers
        self.pool = self._new_pool()
        self._pool_lock = threading.Lock()  # rounds of several groups fail at once
        self.abort = AbortSignal()
        """Set to fail the running rounds at once: a member site fell silent, so
        waiting for it until the deadline is pointless."""

    @property
    def members(self) -> Members:
        """The membership rounds run under (the lane server's)."""
        return self.server.members

    @property
    def site_index(self) -> int:
        return self.server.members.site_index

    @property
    def num_sites(self) -> int:
        return self.server.members.num_sites

    @property
    def generation(self) -> int:
        return self.server.members.generation

    def reconfigure(self, members: Members, peers: dict[int, LanePeer]) -> None:
        """Moves to a new membership (between rounds): the lane server and the codec
        state stay; the peers, this site's position and the generation change."""
        expected = set(range(members.num_sites)) - {members.site_index}
        if set(peers) != expected:
            raise ValueError(f"peers must cover sites {sorted(expected)}, got {sorted(peers)}")
        self.peers = peers
        self.server.set_members(members)
        self.abort.clear()

    def view(self) -> RoundView:
        """The membership and settings a round starting now runs under."""
        members = self.server.members
        return RoundView(
            site_index=members.site_index,
            num_sites=members.num_sites,
            generation=members.generation,
            codec=self.codec,
            chunk_bytes=self.chunk_bytes,
            timeout_s=self.timeout_s,
        )

    def allreduce(
        self,
        tensors: list[torch.Tensor],
        step: int,
        group: int,
        average: bool,
        peers: dict[int, LanePeer] | None = None,
    ) -> RoundStats:
        """Sums (or averages) ``tensors`` over all sites, in place.

        Args:
            tensors: tensors of any shape and dtype on one device (CPU or CUDA);
                every site passes the same shapes in the same order. Values travel
                as fp32, encoded on that device.
            step: training step; with ``group`` it names the round on the wire.
            group: FSDP group (bucket) index within the step.
            average: divide the sum by ``num_sites``.
            peers: the lane of each other site for this round, when it is not the
                same rank's (sites of different sizes pair ranks by the elements they
                hold: inter/data/sync/shard_map.py); default the configured peers.
        Returns:
            The round's statistics.
        Raises:
            CrossSiteError: a peer timed out, refused a chunk or sent an invalid one.
                A single contiguous fp32 tensor is reduced in place and may then be
                left partly reduced (LaneGradientSync hands in a copy of the shard);
                several tensors are left as they were.
        """
        start = time.perf_counter()
        stats = RoundStats()
        if not tensors:
            return stats
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise ValueError(f"tensors of one round must share a device, got {devices}")
        # One contiguous fp32 tensor (a gradient shard's buffer) is reduced where it
        # lies: two copies of it would cost more than the codec at 1 Gbit/s.
        single = (
            len(tensors) == 1 and tensors[0].dtype == torch.float32 and tensors[0].is_contiguous()
        )
        if single:
            flat = tensors[0].detach().view(-1)
        else:
            flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
        stats.tensor_bytes = flat.numel() * 4
        if self.num_sites > 1 and flat.numel() > 0:
            self.server.mailbox.discard_before(step)
            # A peer may still pull chunks of the previous step (its round can finish
            # after ours), so those stay; older ones go.
            self.server.outbox.discard_before(step - 1)
            pipeline = RoundPipeline(
                view=self.view(),
                mailbox=self.server.mailbox,
                outbox=self.server.outbox,
                check=self.server.check,
                peers=dict(self.peers if peers is None else peers),
                pool=self.pool,
                abort=self.abort,
                flat=flat,
                step=step,
                group=group,
                average=average,
                stats=stats,
            )
            stats.num_chunks = pipeline.num_chunks
            try:
                pipeline.run()
            except CrossSiteError as exc:
                exc.stats = stats  # what the failed round counted reaches the step's metrics
                self._renew_pool_if_lost(pipeline, exc)
                raise
        offset = 0
        for t in tensors if not single else ():
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n
        # A CUDA round's tasks synchronized their own streams as they ended: the
        # results are in place, and the training's stream was never waited for.
        stats.wall_s = time.perf_counter() - start
        return stats

    def _renew_pool_if_lost(self, pipeline: RoundPipeline, exc: CrossSiteError) -> None:
        """After a failed round: a new pool of codec threads when the old one is shut
        down or has threads that still hang in the round's tasks (a wait on a GPU that
        never returns, a blocked codec), so the step's retry does not queue behind
        them. The old threads are left to finish or hang on their own; what they write
        lands in the failed round's buffer, which nothing reads."""
        stuck = pipeline.stuck()
        if not pipeline.pool_lost and not stuck:
            return
        why = (
            "was shut down"
            if pipeline.pool_lost
            else f"has {len(stuck)} thread(s) stuck in the failed round ({'; '.join(stuck)})"
        )
        with self._pool_lock:
            if pipeline.pool is not self.pool:
                return  # another round of the step (its other groups) renewed it already
            log.warning("lane codec pool %s (%s); new threads take over", why, exc)
            old, self.pool = self.pool, self._new_pool()
        old.shutdown(wait=False, cancel_futures=True)

    def _new_pool(self) -> futures.ThreadPoolExecutor:
        return futures.ThreadPoolExecutor(self.workers, thread_name_prefix="lane-codec")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The codec's error-feedback residuals, by "g{group}/{c|r}{chunk}" key."""
        return self.codec.state_dict() if hasattr(self.codec, "state_dict") else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restores residuals saved by :meth:`state_dict` (e.g. from a live peer)."""
        if hasattr(self.codec, "load_state_dict"):
            self.codec.load_state_dict(state)
        elif state:
            raise ValueError(f"codec {self.codec.name!r} keeps no state")

    def close(self) -> None:
        """Stops the encode/decode threads (waits for running tasks)."""
        self.pool.shutdown(wait=True)
