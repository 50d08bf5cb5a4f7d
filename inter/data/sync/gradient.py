"""The gradient-sync seam that intra's training step calls (docs/design.md, "Between sites").

``start(step, group, shard)`` runs inside FSDP2's all-reduce hook, once per FSDP group
during backward; ``finish(step)`` runs before ``optimizer.step()``, waits for every
group's round, has the step voted on and returns its :class:`StepOutcome`: committed
(the shards hold the cross-site mean, after any retries among the sites still alive) or
rejoin (the job went on without this site; nothing applied). A stop raises
:class:`QuorumLost`. Rounds run on background threads in the order groups were started,
up to ``rounds_in_flight`` at once: a window of rounds hides the round trips of each
one's start and acknowledgements. Results are applied only after the step commits, all
groups together. A CUDA shard stays on its GPU: only the encoded bytes cross to the host.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent import futures

import torch

from isthmus.inter.control.coordinator_client import Verdict
from isthmus.inter.data.round.allreduce import CrossSiteAllReduce, CrossSiteError, RoundStats
from isthmus.inter.data.round.device import on_lane_stream
from isthmus.inter.data.round.pipeline import ModelMismatch, NonFiniteGradient
from isthmus.inter.data.sync import shard_map
from isthmus.inter.data.sync.buffers import GroupBuffers
from isthmus.inter.data.sync.membership import Generation, QuorumLost, SiteMembership
from isthmus.inter.data.sync.shard_map import MAX_PIECES, GroupShape, ShardPosition
from isthmus.inter.data.sync.stats import StepOutcome, SyncStats

__all__ = ["SHARE_GROUP", "LaneGradientSync", "QuorumLost", "StepOutcome", "SyncStats"]

log = logging.getLogger(__name__)

NOT_RETRIED = (NonFiniteGradient, ModelMismatch)
"""Round failures that running the step again cannot mend: raised, never voted on."""

SHARE_GROUP = (1 << 32) - 1
"""The wire group of a step's shared round (:meth:`LaneGradientSync.share`): past any
gradient group's pieces (``group * MAX_PIECES + piece``)."""


@dataclasses.dataclass(slots=True)
class _Pending:
    group: int
    shard: torch.Tensor
    buffer: torch.Tensor
    future: futures.Future
    shared: bool = False
    """A :meth:`LaneGradientSync.share` round: summed among the sites' first ranks."""


class LaneGradientSync:
    """Averages each FSDP group's gradient shard over all sites.

    The membership is the all-reduce's. A :class:`SiteMembership` votes: ``finish``
    votes on the step and follows the decision (commit, run the rounds again without a
    failed site, rejoin, or stop). A fixed one does not: a failed round just raises.
    ``finish_timeout_s`` defaults to one round timeout per group plus slack, since each
    round already bounds itself.
    """

    def __init__(
        self,
        allreduce: CrossSiteAllReduce,
        *,
        finish_timeout_s: float | None = None,
        rounds_in_flight: int = 4,
    ):
        if rounds_in_flight < 1:
            raise ValueError(f"rounds_in_flight must be >= 1, got {rounds_in_flight}")
        self.allreduce = allreduce
        self.finish_timeout_s = finish_timeout_s
        self.membership = allreduce.membership  # the rank's one owner of it
        self._voter = self.membership if isinstance(self.membership, SiteMembership) else None
        self._step: int | None = None  # the step whose rounds are started, until finish
        self._pending: list[_Pending] = []
        # Rounds start in start() order on every site (the executor's queue is FIFO).
        self._worker = futures.ThreadPoolExecutor(rounds_in_flight, "lane-sync")
        self._position: ShardPosition | None = None
        self._shapes: dict[int, GroupShape] = {}
        self._buffers = GroupBuffers()
        self._site_units: dict[str, int] = {}
        self.measure_norms = False
        """Sum the squares of each round's input (``SyncStats.local_sq_norm``; one more
        pass over the shard)."""

    def set_site_units(self, units: dict[str, int]) -> None:
        """Each site's share of the global batch (micro-batches per step over its
        replicas), by name: a site's contribution is weighted by it, so the round's mean
        is over every token the live sites processed (unset or equal: alike)."""
        if self._pending:
            raise RuntimeError(f"set_site_units() during step {self._step}")
        if any(n < 1 for n in units.values()):
            raise ValueError(f"site units must be >= 1, got {units}")
        self._site_units = dict(units)

    @property
    def position(self) -> ShardPosition | None:
        return self._position

    def set_layout(self, position: ShardPosition, shapes: dict[int, GroupShape]) -> None:
        """Where this rank's shards sit, needed only when the sites differ in size: a
        round is then cut into pieces, each exchanged with the ranks that hold its
        elements (inter/data/sync/shard_map.py)."""
        if self._pending:
            raise RuntimeError(f"set_layout() during step {self._step}")
        self._position, self._shapes = position, dict(shapes)

    def started(self, step: int, group: int) -> bool:
        return step == self._step and any(p.group == group for p in self._pending)

    def start(self, step: int, group: int, shard: torch.Tensor) -> None:
        """Starts the cross-site round of one FSDP group. ``step`` names the round on every
        site; ``shard`` (site-averaged, flat) is updated in place by ``finish``."""
        if self._pending and step != self._step:
            raise RuntimeError(f"step {step} started while step {self._step} is unfinished")
        if self.started(step, group):
            raise ValueError(f"group {group} already started in step {step}")
        self._step = step
        self._pending.append(self._launch(step, group, shard))

    def share(self, step: int, values: torch.Tensor) -> None:
        """Adds a small round to ``step``'s sync: ``values`` (fp32, on the CPU) summed
        over the live sites, written back in place when the step commits, like the
        gradients. Only each site's rank 0 calls it, and all of them at the same steps;
        the round runs between those ranks, unweighted, with the job's codec, so every
        site holds the same bits of the sum (a site's caller spreads what it must not
        lose to rounding: deploy/batch/balance.py). A RETRY sums again over the sites still
        alive; a site that died adds nothing."""
        if values.dtype != torch.float32 or values.is_cuda:
            raise ValueError(
                f"share() takes a CPU fp32 tensor, got {values.dtype} on {values.device}"
            )
        if self._pending and step != self._step:
            raise RuntimeError(f"step {step} started while step {self._step} is unfinished")
        if any(p.shared for p in self._pending):
            raise ValueError(f"a round is already shared in step {step}")
        self._step = step
        self._pending.append(self._launch(step, SHARE_GROUP, values, shared=True))

    def _launch(self, step: int, group: int, shard: torch.Tensor, shared: bool = False) -> _Pending:
        """Submits ``group``'s round on a new copy of ``shard`` (a failed round's may still
        be written), made on the caller's stream after what wrote the shard; the event
        tells the round's thread when it is complete (issue 38). On CPU it is at once."""
        if shared:
            buffer = shard.detach().reshape(-1).to(torch.float32, copy=True)
        else:  # kept for reuse
            buffer = self._buffers.copy_of(step, group, shard)
        ready = None
        if buffer.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        future = self._worker.submit(self._run, step, group, buffer, ready, shared=shared)
        if not shared:
            self._buffers.started(step, group, buffer, future)
        return _Pending(group, shard, buffer, future, shared)

    def vote_ahead(self, step: int) -> None:
        """Votes "ok" on ``step``'s rounds once they all succeed, on the lane's worker,
        not waiting for the decision (:meth:`SiteMembership.vote_ahead`: for rounds whose
        :meth:`finish` comes steps later). A failed round is left to ``finish``."""
        if step != self._step or not self._pending:
            raise RuntimeError(f"vote_ahead({step}) without rounds of step {step} started")
        membership, rounds = self._voter, [p.future for p in self._pending]
        if membership is None:
            return
        generation = membership.generation  # not the next one, should finish be first

        def vote() -> None:  # queued after the rounds (FIFO): they all started
            done, _ = futures.wait(rounds)
            if self._step != step or any(f.exception() is not None for f in done):
                return  # finish took them, or a round failed: finish decides
            try:
                membership.vote_ahead(step, generation)
            except Exception:  # best effort (finish votes again); never lost unseen
                log.warning("early vote on step %d failed; voting at landing", step, exc_info=True)

        self._worker.submit(vote)

    def _run(
        self,
        step: int,
        group: int,
        buffer: torch.Tensor,
        ready: torch.cuda.Event | None,
        *,
        shared: bool = False,
    ) -> tuple[RoundStats, float, float, float]:
        """Runs one group's round; returns its stats, its start and end times and the
        squared norm of its input (0 unless measured)."""
        abort = self.membership.abort
        if abort.is_set():
            # A failed round leaves peers out of step; later rounds would only time out.
            raise CrossSiteError(f"step {step} group {group} skipped: {abort.reason}")
        try:
            if ready is not None:
                ready.synchronize()
            t0 = time.monotonic()
            if shared:
                voter = self._voter
                rs = self.allreduce.allreduce(
                    [buffer], step, group, False, voter.first_ranks() if voter else None
                )
                return rs, t0, time.monotonic(), 0.0
            sq_norm = 0.0
            if self.measure_norms:
                with on_lane_stream(buffer):
                    sq_norm = float(torch.linalg.vector_norm(buffer, dtype=torch.float64) ** 2)
            weight = self._voter.weight(self._site_units) if self._voter else None
            if weight is not None:
                # average=True divides by the live sites: w = units * sites / sum(units).
                with on_lane_stream(buffer):
                    buffer.mul_(weight)
            sizes = self._voter.site_ranks() if self._voter is not None else [1]
            if len(set(sizes)) == 1:
                rs = self.allreduce.allreduce([buffer], step=step, group=group, average=True)
            else:
                rs = self._run_pieces(step, group, buffer, sizes)
            return rs, t0, time.monotonic(), sq_norm
        except BaseException as exc:
            # The one abort signal of the rank: the step's other rounds fail at once.
            abort.set(f"step {step} group {group} failed: {exc}")
            raise

    def _run_pieces(
        self, step: int, group: int, buffer: torch.Tensor, sizes: list[int]
    ) -> RoundStats:
        """One group's round between sites of ``sizes`` ranks: each piece with the
        ranks that hold it (the buffer is already weighted by the site's tokens)."""
        position, membership = self._position, self._voter
        assert membership is not None
        if position is None:
            raise CrossSiteError(f"sites of {sizes} ranks, but no shard layout was set")
        shape = self._shapes.get(group)
        if shape is None:
            raise CrossSiteError(f"step {step}: group {group} has no shape in the shard layout")
        me, widths = membership.members.site_index, [position.width(n) for n in sizes]
        total = RoundStats()
        for piece in shard_map.pieces(shape, widths, me, position.shard_index):
            peers = {
                s: membership.peer(s, position.rank_of(sizes[s], piece.holders[s]))
                for s in range(len(sizes))
                if s != me
            }
            with on_lane_stream(buffer):
                part = shard_map.gather_piece(buffer, piece)
            rs = self.allreduce.allreduce(
                [part], step=step, group=group * MAX_PIECES + piece.key, average=True, peers=peers
            )
            with on_lane_stream(buffer):
                shard_map.scatter_piece(buffer, piece, part)
            _add(total, rs, (*_STEP_STATS, "tensor_bytes", "num_chunks"))
        return total

    def finish(self, step: int) -> StepOutcome:
        """Waits for every group started in ``step`` and writes the averages into the shards.

        With a SiteMembership, the step is voted on and the decision followed: a RETRY
        runs every group's round again, from the untouched shards, among the sites
        still alive; the shards change only on COMMIT (all or nothing).

        Raises CrossSiteError (a fixed membership: a round failed, no shard changed),
        NonFiniteGradient (NaN or Inf here; nothing was sent), ModelMismatch (a peer's
        gradient has another size) or QuorumLost (this site may not go on).
        """
        if self._pending and step != self._step:
            raise RuntimeError(f"finish({step}) while step {self._step}'s rounds run")
        pending, self._pending, self._step = self._pending, [], None
        stats = SyncStats(step=step, groups=len(pending))
        rejoin = offer = None
        t0 = time.perf_counter()
        try:
            while True:
                failure = self._collect(pending, step, stats)
                if isinstance(failure, NOT_RETRIED):
                    raise failure  # the same gradient again would fail again: stop here
                voter = self._voter
                if voter is None:
                    if failure is not None:
                        raise failure
                    break
                if failure is not None:
                    log.warning("[step %d] %s", step, failure)
                decision = voter.vote(step, failure is None)
                if decision.verdict == Verdict.COMMIT:
                    if failure is not None:
                        # Only possible if this rank's vote was lost: never apply a half round.
                        raise QuorumLost(f"step {step} committed while this rank's round failed")
                    # What the step was averaged over, before a commit admits a site.
                    now = self.membership.members
                    stats.generation, stats.sites = now.generation, now.num_sites
                    offer = voter.follow(decision, step)
                    break
                if decision.verdict == Verdict.RETRY:
                    voter.adopt(Generation.of(decision))
                    stats.retries += 1
                    # From the untouched shards; the new generation cleared the abort.
                    pending = [self._launch(step, p.group, p.shard, p.shared) for p in pending]
                    continue
                if decision.verdict == Verdict.REJOIN:
                    rejoin = decision
                    break
                raise QuorumLost(decision.reason or f"step {step}: the job stopped")
        finally:
            stats.wait_s = time.perf_counter() - t0
            if not stats.sites:  # not committed (or a fixed membership): where it stands now
                now = self.membership.members
                stats.generation, stats.sites = now.generation, now.num_sites
        if rejoin is not None:
            return StepOutcome(stats, rejoin=rejoin)
        # Copy back only once every group succeeded: all or nothing. The rounds
        # synchronized their device, so the buffers are complete.
        for p in pending:
            p.shard.copy_(p.buffer.view_as(p.shard))
            if p.buffer.is_cuda:
                # The buffer was made on the hook's stream and is dropped now, while
                # this stream's copy may still be queued: keep its memory until then.
                p.buffer.record_stream(torch.cuda.current_stream(p.buffer.device))
        here = self.membership.members.site_index
        log.debug(
            "[site %d step %d] synced %d groups, %d bytes sent, wait %.3fs",
            *(here, step, stats.groups, stats.bytes_sent, stats.wait_s),
        )
        return StepOutcome(stats, offer_state=offer)

    def _collect(
        self, pending: list[_Pending], step: int, stats: SyncStats
    ) -> CrossSiteError | None:
        """Waits for every group's round; returns the first failure (all are awaited)."""
        timeout = self.finish_timeout_s
        if timeout is None:
            timeout = self.allreduce.timeout_s * max(1, len(pending)) + 5.0
        deadline = time.monotonic() + timeout
        failure: CrossSiteError | None = None
        first, last = float("inf"), float("-inf")
        stats.local_sq_norm = 0.0  # this attempt's (a RETRY measures again)
        for p in pending:
            try:
                rs, began, ended, sq_norm = p.future.result(
                    timeout=max(0.0, deadline - time.monotonic())
                )
            except futures.TimeoutError:
                failure = failure or CrossSiteError(
                    f"step {step} group {p.group}: not finished within {timeout:.1f}s"
                )
                self.membership.abort.set("the step's time ran out")
                continue
            except CrossSiteError as exc:
                if failure is None or isinstance(exc, NOT_RETRIED):
                    failure = exc  # one that no retry mends wins over the others
                if exc.stats is not None:  # a failed round's refusals count too
                    _add(stats, exc.stats)
                continue
            first, last = min(first, began), max(last, ended)
            stats.sync_s = last - first
            stats.local_sq_norm += sq_norm
            _add(stats, rs)
        if failure is not None:
            # Let rounds that outlived the deadline end before anything is rerun.
            futures.wait([p.future for p in pending], timeout=self.allreduce.timeout_s)
            if self._voter is None:
                self.membership.abort.clear()
        return failure

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The lane's codec state (error-feedback residuals; empty for stateless codecs),
        to save with training state. Call between steps."""
        if self._pending:
            raise RuntimeError(f"state_dict() during step {self._step}; call it between steps")
        return self.allreduce.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restores what :meth:`state_dict` returned (resuming from a checkpoint)."""
        if self._pending:
            raise RuntimeError(f"load_state_dict() during step {self._step}")
        self.allreduce.load_state_dict(state)

    def close(self) -> None:
        """Stops the background worker (waits for a running round) and the codec pool."""
        self._worker.shutdown(wait=True)
        if self._voter is not None:
            self._voter.close()
        self.allreduce.close()


_STEP_STATS = (
    *("bytes_sent", "bytes_received", "raw_bytes"),
    *("corrupt_chunks", "nonfinite_chunks", "stalled_flows"),
)
"""The RoundStats of a step's rounds that add up to its SyncStats (with "tensor_bytes"
and "num_chunks", those of a group's pieces that add up to the group's)."""


def _add(into: object, rs: RoundStats, names: tuple[str, ...] = _STEP_STATS) -> None:
    for name in names:
        setattr(into, name, getattr(into, name) + getattr(rs, name))
