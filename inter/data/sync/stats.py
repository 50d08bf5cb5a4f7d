"""What a step's cross-site sync reports (:class:`SyncStats`) and how it ended
(:class:`StepOutcome`): the results of ``LaneGradientSync.finish``
(inter/data/sync/gradient.py), which the rank records (deploy/rank/program.py)."""

from __future__ import annotations

import dataclasses

from isthmus.inter.control.coordinator_client import Decision

__all__ = ["StepOutcome", "SyncStats"]


@dataclasses.dataclass(slots=True)
class SyncStats:
    """The cross-site sync of one training step, over all its groups (what crossed;
    ``intra.train.StepStats`` is the step's training side)."""

    step: int = 0
    groups: int = 0
    sync_s: float = 0.0
    """Seconds from the first round's start to the last round's end (rounds overlap
    each other and backward)."""
    wait_s: float = 0.0  # seconds ``finish`` blocked the training loop
    bytes_sent: int = 0
    bytes_received: int = 0
    raw_bytes: int = 0  # fp32 bytes of what was sent, before encoding
    corrupt_chunks: int = 0  # chunks that arrived failing their checksum and were pulled again
    nonfinite_chunks: int = 0
    """Chunks that decoded to NaN or Inf, refused before summing and pulled again."""
    stalled_flows: int = 0
    """Bulk connections given up past a frame's deadline, their frames sent again on
    new ones (``RoundStats.stalled_flows``)."""
    retries: int = 0
    """Times the step's rounds ran again in a new generation (a site failed or left)."""
    generation: int = 0  # the membership generation the step committed in
    sites: int = 0  # live sites the step was averaged over
    local_sq_norm: float = 0.0
    """The squared L2 norm of what this rank handed in, before the sites' mean (its
    shards of the site's own mean gradient); measured only when
    :attr:`LaneGradientSync.measure_norms` is set (the gradient noise scale)."""

    @property
    def compression_ratio(self) -> float:
        """raw_bytes / bytes_sent (1.0 when nothing was sent)."""
        return self.raw_bytes / self.bytes_sent if self.bytes_sent else 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class StepOutcome:
    """How a step's cross-site sync ended (``LaneGradientSync.finish``'s result)."""

    stats: SyncStats
    rejoin: Decision | None = None
    """The job went on without this site: pull the state this decision names. Nothing
    of the step was applied. None when the step committed."""
    offer_state: Decision | None = None
    """The commit admitted a site and named this one as the source of its state: offer
    the state after this step (``PullState`` serves it)."""

    @property
    def committed(self) -> bool:
        """The shards hold the cross-site mean; the optimizer may step."""
        return self.rejoin is None
