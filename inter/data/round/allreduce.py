"""The cross-site all-reduce over lanes (docs/design.md, "Cross-site algorithm").

Chunk ``c`` of a round is owned by site ``(c + step + group) % num_sites``; rotating
with step and group spreads the owners' extra work. Every other site sends the owner
its encoded chunk (CONTRIBUTION); the owner decodes all contributions, its own too,
sums them in site-index order, encodes the sum once and sends those same bytes
(RESULT) to every site; every site, the owner included, keeps ``decode(result)``.
So all sites hold bitwise-identical values whatever the codec. The round itself is
:class:`~isthmus.inter.data.round.pipeline.RoundPipeline`; this module owns the lane's settings,
its encode/decode pool, its codec state and the statistics. The membership it runs
under is read from the rank's one owner of it (:class:`RankMembership`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from concurrent import futures
from typing import Protocol

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

__all__ = [
    "CrossSiteAllReduce",
    "CrossSiteError",
    "FixedMembership",
    "RankMembership",
    "RoundStats",
    "default_workers",
]

log = logging.getLogger("isthmus.round")


def default_workers() -> int:
    """Encode/decode threads per lane: a few, never more than the cores."""
    return max(1, min(4, os.cpu_count() or 1))


class RankMembership(Protocol):
    """What a rank's rounds read their membership from, its one owner on the rank:
    :class:`~isthmus.inter.data.sync.membership.SiteMembership` (which alone moves it to
    another generation) or, for an all-reduce used alone, a :class:`FixedMembership`."""

    @property
    def lane(self) -> LaneServer: ...
    @property
    def abort(self) -> AbortSignal: ...
    @property
    def members(self) -> Members: ...
    def peers(self) -> dict[int, LanePeer]:
        """The lane of the same rank of every other member site, by site index."""
        ...


@dataclasses.dataclass(eq=False)
class FixedMembership:
    """A membership that never moves, for an all-reduce used alone (tests, the lane
    benchmark): the one its lane was built with, and a lane client of every other site."""

    lane: LaneServer
    lanes: dict[int, LanePeer]
    abort: AbortSignal = dataclasses.field(default_factory=AbortSignal)

    @property
    def members(self) -> Members:
        return self.lane.members

    def peers(self) -> dict[int, LanePeer]:
        return self.lanes


class CrossSiteAllReduce:
    """All-reduces flat fp32 buffers with the same rank of every other site (or the
    ranks a round names, between sites of different sizes). Each round runs under the
    membership held when it starts; ``codec`` and ``chunk_bytes`` must match the lane's,
    and ``timeout_s`` bounds a whole round, from call to last acknowledgement.
    """

    def __init__(
        self,
        *,
        membership: RankMembership,
        codec: CodecChain,
        chunk_bytes: int = 1 << 20,
        timeout_s: float = 60.0,
        workers: int | None = None,
    ) -> None:
        server = membership.lane
        if chunk_bytes != server.chunk_bytes:
            raise ValueError(f"chunk_bytes {chunk_bytes} != server's {server.chunk_bytes}")
        if codec.name != server.codec:
            raise ValueError(f"codec {codec.name!r} != server's {server.codec!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        workers = default_workers() if workers is None else workers
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.membership = membership
        self.server = server
        self.codec = codec
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.workers = workers
        self.pool = self._new_pool()
        self._pool_lock = threading.Lock()  # rounds of several groups fail at once

    def view(self) -> RoundView:
        """The membership and settings a round starting now runs under."""
        m = self.membership.members
        return RoundView(
            m.site_index, m.num_sites, m.generation, self.codec, self.chunk_bytes, self.timeout_s
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

        ``tensors``, on one device, have the same shapes in the same order on every
        site; values travel as fp32, encoded on that device. (step, group) names the
        round on the wire. ``peers``: each other site's lane for this round when it is
        not the same rank's (sites of different sizes: inter/data/sync/shard_map.py).

        Raises CrossSiteError when a peer timed out, refused a chunk or sent an invalid
        one: a single contiguous fp32 tensor, reduced in place, may then be left partly
        reduced (LaneGradientSync hands in a copy of the shard); several tensors are
        left as they were.
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
        view = self.view()
        if view.num_sites > 1 and flat.numel() > 0:
            self.server.mailbox.discard_before(step)
            # A peer may still pull chunks of the previous step (its round can finish
            # after ours), so those stay; older ones go.
            self.server.outbox.discard_before(step - 1)
            pipeline = RoundPipeline(
                view=view,
                mailbox=self.server.mailbox,
                outbox=self.server.outbox,
                check=self.server.check,
                peers=dict(self.membership.peers() if peers is None else peers),
                pool=self.pool,
                abort=self.membership.abort,
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
        down or has threads that still hang in the round's tasks (a GPU wait that never
        returns, a blocked codec), so the step's retry does not queue behind them. What
        the old threads write lands in the failed round's buffer, which nothing reads."""
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
        self.pool.shutdown(wait=True)
