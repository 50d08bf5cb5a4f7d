"""The rank's global batch over time: how large it is and how the sites split it.

Size (``train.batch_schedule``), in micro-batches of ``train.batch_size`` sequences:

- ``fixed``: the sum over sites of ``train.accumulate`` x dp, every step;
- ``ramp``: from ``train.batch_start`` up to that sum, linearly over
  ``train.batch_ramp_steps`` (Megatron's ``rampup_batch_size``, counted in steps); every
  rank computes it from the step number;
- ``noise``: from ``train.batch_start``, grown toward the gradient noise scale
  (McCandlish et al. 2018; deploy/batch/size.py) at each decision, up to that sum.

Split (``train.balance_every = N``): every N steps each site's rank 0 adds to that
step's sync one codec block per value (``LaneGradientSync.share``): its median seconds
per micro-batch since the last decision, and for ``noise`` the window's mean squared
norm of the site's own mean gradient, of the global mean gradient, and the site's
sequences per step. The sum exists only when the step commits and is the same bits at
every site; rank 0 hands it to its site's ranks, and every rank of every site derives
the same decisions from it: the split that finishes the sites together
(deploy/batch/balance.py), the noise scale and the batch size. A decision applies from the
next step; the learning rate follows the batch by ``train.lr_scaling``.

The split, the last timings and the noise scale's averages travel in checkpoints and
in the state a joining site pulls (:meth:`BatchPlan.state`).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from isthmus.deploy.batch.balance import BatchSplit, best_split, resized
from isthmus.deploy.batch.size import NoiseScale, NoiseScaleController, RampSchedule
from isthmus.inter.data import INT8_BLOCK as BLOCK
from isthmus.intra.flops import scaled_lr

if TYPE_CHECKING:
    from isthmus.deploy.config.sections import TopologySection, TrainSection
    from isthmus.inter.data import LaneGradientSync
    from isthmus.intra.corpus.batches import ShardedBatches
    from isthmus.intra.train import Trainer

__all__ = ["BatchPlan", "SPLIT_KEY"]

log = logging.getLogger("isthmus.batch")

SPLIT_KEY = "batch/accumulate"
"""The split's entry in a rank's extra state (checkpoints, and the state a joiner pulls)."""
_SECONDS_KEY = "batch/seconds"
_NOISE_KEY = "batch/noise"
_NOISE_FIELDS = ("grad_sq", "noise", "updates", "skipped")

_VALUES = 4
"""What a site shares per decision: seconds per micro-batch, its own mean gradient's
squared norm, the global one's, and its sequences per step."""
NOISE_DECAY = 0.8
"""The noise scale's moving averages, per decision (each already a window's mean)."""
NOISE_WARMUP = 3
"""Decisions before the noise scale counts."""
WARMUP_STEPS = 2
"""Steps after a start (or a rejoin) that are not measured: the first allocate and
compile, and on a 2-core machine the second was still seen 20 % off."""
MIN_SAMPLES = 3
"""Steps a site must have measured to report (fewer, and it keeps its micro-batches):
a decision on one or two steps once moved micro-batches between equal sites."""


class BatchPlan:
    """One rank's part in sizing and splitting the global batch (module docstring).

    Call :meth:`before_step` before reading a step's batch, :meth:`after_step` after a
    committed step (before its state is offered or saved). ``site`` is this site's
    index among the configured ones; the site's rank 0 shares and hands the sum on."""

    def __init__(
        self,
        *,
        train: TrainSection,
        topology: TopologySection,
        site: int,
        dp_index: int,
        rank: int,
        trainer: Trainer,
        batches: ShardedBatches,
        sync: LaneGradientSync | None,
    ) -> None:
        self.sites = topology.site_names
        self.site, self.dp_index, self.rank = site, dp_index, rank
        self.trainer, self.batches, self.sync = trainer, batches, sync
        self.split = BatchSplit(
            tuple(train.site_accumulate(topology.sites)), tuple(topology.site_dp())
        )
        self.configured = self.split.accumulate
        """train.accumulate: the sites' shares of a resized batch until they are measured."""
        self.full = self.split.total
        self.every = train.balance_every if sync is not None else 0
        self.schedule = train.batch_schedule
        self.active = self.every > 0 or self.schedule != "fixed"
        self.sequences = train.batch_size
        self._lr = (train.lr, train.lr_scaling, train.lr_reference_dp)
        start = train.batch_start or sum(self.split.dp)
        self.ramp = (
            RampSchedule(
                start_units=start,
                end_units=self.full,
                increment_units=1,
                ramp_steps=train.batch_ramp_steps,
            )
            if self.schedule == "ramp"
            else None
        )
        self.noise = (
            NoiseScale(decay=NOISE_DECAY, min_updates=NOISE_WARMUP)
            if self.schedule == "noise"
            else None
        )
        self.controller = (
            NoiseScaleController(
                min_units=start, max_units=self.full, multiple=1, examples_per_unit=self.sequences
            )
            if self.noise is not None
            else None
        )
        if self.noise is not None and sync is not None:
            sync.measure_norms = True
        self.seconds = [0.0] * len(self.sites)
        """The last committed timings (the same bits at every site); 0 for none."""
        self._ramp_units: int | None = None
        self._window: list[tuple[float, float, float]] = []
        self._unmeasured = WARMUP_STEPS
        self._shared: torch.Tensor | None = None
        if self.active:
            first = self.split if self.schedule == "fixed" else self._resized(start)
            self.apply(first)

    # -- applying ----------------------------------------------------------------------

    @property
    def micro_batches(self) -> int:
        """This site's micro-batches per rank per step."""
        return self.split.accumulate[self.site]

    def apply(self, split: BatchSplit) -> None:
        """Uses ``split`` (and its global batch) from the next batch read on."""
        if split.dp != self.split.dp or not sum(split.dp) <= split.total <= self.full:
            raise ValueError(f"split {split} does not fit the job's {self.split}")
        m = split.accumulate[self.site]
        self.batches.resplit(split.first_unit(self.site, self.dp_index), m, split.total)
        self.trainer.set_accumulate(m)
        # Per-step sync: the learning rate is that of the whole batch's width.
        self.trainer.config.lr = scaled_lr(self._lr[0], split.total, self._lr[1], self._lr[2])
        if self.sync is not None:
            self.sync.set_site_units(dict(zip(self.sites, split.units, strict=True)))
        self.split = split

    # -- the step loop -----------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether ``step``'s sync carries a decision."""
        return self.every > 0 and (step + 1) % self.every == 0

    def before_step(self, step: int) -> None:
        """A ramp's size for ``step``; at a due step, rank 0 shares the site's window."""
        if self.ramp is not None:
            units = self.ramp.units_at(step)
            if units != self._ramp_units:
                self._ramp_units = units
                self._change(self._resized(units), step)
        if self.rank != 0 or not self.due(step):
            return
        values = torch.zeros(len(self.sites) * _VALUES * BLOCK, dtype=torch.float32)
        if len(self._window) >= min(MIN_SAMPLES, self.every):
            seconds, site_sq, global_sq = zip(*self._window, strict=True)
            # The median step: one that stalls (a collection, a page fault, a
            # neighbour's burst) must not move micro-batches.
            mine = [
                statistics.median(seconds),
                math.fsum(site_sq) / len(site_sq),
                math.fsum(global_sq) / len(global_sq),
                float(self.split.units[self.site] * self.sequences),
            ]
            for k, value in enumerate(mine):
                values[(self.site * _VALUES + k) * BLOCK] = value
        self._shared = values
        assert self.sync is not None  # every > 0 only with a sync
        self.sync.share(step, values)

    def after_step(
        self, step: int, *, compute_s: float, site_sq_norm: float = 0.0, global_sq_norm: float = 0.0
    ) -> None:
        """Counts a committed step (its own work, slowdown and all, and for ``noise`` its
        site's and the global mean gradient's squared norms); at a due step, every rank
        of the site takes the shared sum from rank 0 (a collective of the site) and
        applies what it decides."""
        if not self.active:
            return
        sample = (compute_s / self.micro_batches, site_sq_norm, global_sq_norm)
        if not self.due(step):
            self._record(sample)
            return
        values = torch.zeros(len(self.sites) * _VALUES, dtype=torch.float64)
        if self.rank == 0:
            assert self._shared is not None, "after_step without before_step"
            values.copy_(self._shared[::BLOCK])
        dist.broadcast(values, src=0)
        self._window, self._shared = [], None
        before = self.split
        self._decide(step, values.view(len(self.sites), _VALUES).tolist())
        if self.split == before:
            # The next window starts with this step, unless it ran a split (a batch per
            # site, for the noise scale's estimators) that is gone.
            self._record(sample)

    def _record(self, sample: tuple[float, float, float]) -> None:
        if self._unmeasured:
            self._unmeasured -= 1
        else:
            self._window.append(sample)

    def _decide(self, step: int, rows: list[list[float]]) -> None:
        """What the shared sum decides: the split, then (``noise``) the batch size."""
        seconds = [row[0] for row in rows]
        split = best_split(seconds, self.split)
        if all(t > 0 for t in seconds):
            self.seconds = seconds
        if self.noise is not None and self.controller is not None:
            reported = [row for row in rows if row[3] > 0]
            if len(reported) >= 2:
                self.noise.update(
                    [(row[3], row[1]) for row in reported],
                    math.fsum(row[3] for row in reported),
                    math.fsum(row[2] for row in reported) / len(reported),
                )
            units = self.controller.units_for(self.noise.value, split.total)
            split = resized(split, units, self.seconds, self.configured)
        if split != self.split:
            self._change(split, step, seconds)

    def _resized(self, units: int) -> BatchSplit:
        return resized(self.split, units, self.seconds, self.configured)

    def _change(self, split: BatchSplit, step: int, seconds: list[float] | None = None) -> None:
        if split == self.split:
            return
        if self.rank == 0:
            size = self.split.total, split.total
            log.warning(
                "after step %d: %smicro-batches per rank %s -> %s%s",
                step,
                f"global batch {size[0]} -> {size[1]} micro-batches, "
                if size[0] != size[1]
                else "",
                list(self.split.accumulate),
                list(split.accumulate),
                f" (seconds per micro-batch {[round(t, 4) for t in seconds]})" if seconds else "",
            )
        self.apply(split)

    # -- what is logged and what travels -------------------------------------------------

    def record(self) -> dict[str, float]:
        """This step's entries of the metrics line."""
        out: dict[str, float] = {
            "micro_batches": self.micro_batches,
            "global_batch": self.split.total * self.sequences,
        }
        if self.noise is not None and self.noise.value is not None:
            out["noise_scale"] = self.noise.value
        return out

    def state(self) -> dict[str, torch.Tensor]:
        """The split, the last timings and the noise scale's averages."""
        if not self.active:
            return {}
        out = {
            SPLIT_KEY: torch.tensor(self.split.accumulate, dtype=torch.int64),
            _SECONDS_KEY: torch.tensor(self.seconds, dtype=torch.float64),
        }
        if self.noise is not None:
            noise = self.noise.state_dict()
            out[_NOISE_KEY] = torch.tensor([noise[k] for k in _NOISE_FIELDS], dtype=torch.float64)
        return out

    def load_state(self, extra: Mapping[str, torch.Tensor]) -> None:
        """Takes what :meth:`state` saved (a checkpoint, or a live site's); missing
        entries keep this rank's. The measurements start afresh."""
        self._window, self._shared, self._ramp_units = [], None, None
        self._unmeasured = WARMUP_STEPS
        if not self.active:
            return
        if _SECONDS_KEY in extra:
            self.seconds = extra[_SECONDS_KEY].tolist()
        if self.noise is not None and _NOISE_KEY in extra:
            values = extra[_NOISE_KEY].tolist()
            self.noise.load_state_dict(dict(zip(_NOISE_FIELDS, values, strict=True)))
        if SPLIT_KEY in extra:
            self.apply(BatchSplit(tuple(extra[SPLIT_KEY].tolist()), self.split.dp))
