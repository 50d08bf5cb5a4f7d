"""The global batch over time: a linear ramp, the gradient noise scale, and a controller.

The global batch is ``U`` *units*, micro-batches of ``train.batch_size`` sequences
(deploy/batch/balance.py splits them between the sites). These pure functions choose
``U`` from one step to the next. Every site calls them with the same bits (the sums of a
sync are bitwise identical everywhere) and must get the same answer, so nothing here
reads a clock, a random number, a file or the network, and sums that mix sites go
through :func:`math.fsum`, whose correctly rounded result does not depend on the order
of its terms. The noise scale is McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training" (arXiv:1812.06162); the batch only grows, as in GPT-3's and
Megatron's ramps and in Smith et al. 2018, "Don't Decay the Learning Rate, Increase the
Batch Size": the noise scale grows as the loss falls.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from isthmus.intra.flops import scaled_lr

__all__ = [
    "NoiseScale",
    "NoiseScaleController",
    "RampSchedule",
    "lr_for_units",
    "noise_estimates",
    "round_units",
]


def round_units(units: float, multiple: int) -> int:
    """``units`` rounded to the nearest multiple of ``multiple`` (a tie rounds up), and at
    least one multiple. Plain IEEE double arithmetic, so every site gets the same answer
    from the same bits."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    if not math.isfinite(units) or units < 0:
        raise ValueError(f"units must be finite and >= 0, got {units}")
    return max(1, math.floor(units / multiple + 0.5)) * multiple


@dataclass(frozen=True, kw_only=True, slots=True)
class RampSchedule:
    """A global batch that grows linearly, in equal stages, from ``start_units`` to ``end_units``.

    With ``n = (end_units - start_units) / increment_units`` increments, step ``t`` (0 is
    the first step) of the ramp uses ``start_units + floor(t * n / ramp_steps) *
    increment_units``: each of the ``n + 1`` sizes but the last holds for
    ``ramp_steps / n`` steps (rounded by the floor), and ``end_units`` holds from step
    ``ramp_steps`` on. Megatron-LM's ``--rampup-batch-size <start> <increment> <samples>``
    does the same over consumed samples, not steps, and in floating point: where
    ``ramp_samples / n`` is inexact its stage can change one sample late (e.g. 10
    samples, 3 increments: still ``start + 2 * increment`` at sample 10). Integer
    arithmetic here puts every boundary exactly at ``t * n / ramp_steps``.

    More increments than ramp steps is allowed (some sizes are skipped). The values are
    not rounded to a granularity: pass them through :func:`round_units`.
    """

    start_units: int
    """Global batch at step 0, in units (micro-batches), >= 1."""
    end_units: int
    """Global batch from ``ramp_steps`` on, in units, >= ``start_units``."""
    increment_units: int
    """Units added at each stage, >= 1, dividing ``end_units - start_units``."""
    ramp_steps: int
    """Steps the ramp lasts, >= 0 (0: ``end_units`` from step 0)."""

    def __post_init__(self) -> None:
        start, end, inc = self.start_units, self.end_units, self.increment_units
        if start < 1:
            raise ValueError(f"start_units must be >= 1, got {start}")
        if end < start:
            raise ValueError(f"end_units must be >= start_units, got {end} < {start}")
        if inc < 1:
            raise ValueError(f"increment_units must be >= 1, got {inc}")
        if (end - start) % inc:
            raise ValueError(f"increment_units {inc} does not divide end - start = {end - start}")
        if self.ramp_steps < 0:
            raise ValueError(f"ramp_steps must be >= 0, got {self.ramp_steps}")

    def units_at(self, step: int) -> int:
        """The global batch, in units, of step ``step`` (0-based, >= 0)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step >= self.ramp_steps:
            return self.end_units
        increments = (self.end_units - self.start_units) // self.increment_units
        return self.start_units + step * increments // self.ramp_steps * self.increment_units


def noise_estimates(
    sites: Sequence[tuple[float, float]], big_batch: float, big_sq_norm: float
) -> tuple[float, float] | None:
    """One step's unbiased estimates of ``|G|²`` and ``S = tr(Σ)``, pooled over sites.

    ``E|G_B|² = |G|² + tr(Σ)/B`` for the mean gradient of ``B`` independent examples.
    With a small batch ``b`` inside a big one ``B`` (McCandlish et al. 2018, A.1)::

        |G|² ≈ (B |G_B|² - b |G_b|²) / (B - b)
        S    ≈ (|G_b|² - |G_B|²) / (1/b - 1/B)

    Each site gives one such pair (its own mean is the small batch, the global mean the
    big one), each unbiased. They are averaged with weights ``B - b_s``, because:

    - that is the two-size estimator applied to the natural pooled statistic, the
      example-weighted mean of the sites' ``|G_b|²`` (expectation ``|G|² + n S / B``
      for ``n`` sites whose ``b_s`` add up to ``B``);
    - equal sites count equally;
    - a site holding most of the batch counts little, rightly: its ``|G_b|²`` barely
      differs from ``|G_B|²``, and that difference, divided by ``1/b - 1/B`` near 0,
      is mostly noise. A site with ``b = B`` (the only site) has weight 0.

    Weighted so, the sums are::

        S    = B Σ_s b_s (|G_s|² - |G_B|²) / Σ_s (B - b_s)
        |G|² = Σ_s (B |G_B|² - b_s |G_s|²) / Σ_s (B - b_s)

    which avoids the cancellation in ``1/b - 1/B``.

    ``sites`` holds each site's ``(b_s, |G_s|²)`` in any order (the sums are correctly
    rounded). The example may be sequences or tokens: the estimators are homogeneous in
    the batch sizes, so use one unit throughout, the controller's ``examples_per_unit``
    too. ``big_batch`` exceeds the sum of the ``b_s`` when a site's norm is missing (its
    examples are still in the mean; the others' estimates stay unbiased). ``None`` when
    no site is smaller than ``B`` or a norm (or the result) is not finite.
    """
    if not sites:
        raise ValueError("need at least one site's (batch, squared norm)")
    small = [b for b, _ in sites]
    if not all(math.isfinite(b) and 0 < b <= big_batch for b in small) or not math.isfinite(
        big_batch
    ):
        raise ValueError(f"need finite batches 0 < b_s <= big_batch, got {small} and {big_batch}")
    norms = [big_sq_norm, *(sq for _, sq in sites)]
    if not all(math.isfinite(sq) for sq in norms):
        return None
    if min(norms) < 0:
        raise ValueError(f"squared norms must be >= 0, got {norms}")
    weight = math.fsum(big_batch - b for b, _ in sites)
    if weight <= 0:
        return None
    noise = big_batch * math.fsum(b * (sq - big_sq_norm) for b, sq in sites) / weight
    grad_sq = math.fsum(big_batch * big_sq_norm - b * sq for b, sq in sites) / weight
    if not (math.isfinite(noise) and math.isfinite(grad_sq)):
        return None
    return grad_sq, noise


class NoiseScale:
    """Exponential moving averages of ``|G|²`` and ``S``, and their ratio ``B_simple``.

    One step's estimates are very noisy (``|G|²``, the small difference of two large
    numbers, is often negative), so, as in McCandlish et al. 2018 (A.1), ``S`` and
    ``|G|²`` are averaged separately and divided afterwards; averaging the per-step
    ratios would be biased and blow up where ``|G|²`` passes through 0.

    What happens to awkward input:

    - a non-finite norm (an overflowed step) or one site (``b == B``, no estimate
      exists): the update changes nothing but :attr:`skipped`;
    - a batch that is not finite and > 0, or a site's larger than the global one, or
      a negative squared norm: ``ValueError``, since these are the caller's bugs;
    - a negative per-step ``|G|²`` or ``S``: averaged in like any other, since dropping
      or clipping them would bias the averages upward;
    - a non-positive *averaged* ``|G|²`` or ``S`` (noise still dominates):
      :attr:`value` is ``None``, as it is before ``min_updates`` updates.

    ``decay`` 0.99 remembers about the last 100 steps, enough to average out the per-step
    noise while the noise scale drifts slowly; ``min_updates`` keeps an early, still noisy
    average from growing the batch irreversibly.
    """

    def __init__(self, *, decay: float = 0.99, min_updates: int = 20) -> None:
        if not 0 <= decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        if min_updates < 1:
            raise ValueError(f"min_updates must be >= 1, got {min_updates}")
        self.decay, self.min_updates = decay, min_updates
        self.updates = 0
        """Steps that contributed to the averages."""
        self.skipped = 0
        """Steps that gave no estimate (non-finite norms, or one site)."""
        # Averages started at 0, not bias-corrected: the correction 1 - decay**n is the
        # same for both and cancels in their ratio (the properties apply it).
        self._grad_sq = 0.0
        self._noise = 0.0

    def update(
        self, sites: Sequence[tuple[float, float]], big_batch: float, big_sq_norm: float
    ) -> bool:
        """Adds one step (arguments as :func:`noise_estimates`); False, counted in
        :attr:`skipped`, when it gives no estimate."""
        estimates = noise_estimates(sites, big_batch, big_sq_norm)
        if estimates is None:
            self.skipped += 1
            return False
        grad_sq, noise = estimates
        keep = self.decay
        self._grad_sq = keep * self._grad_sq + (1 - keep) * grad_sq
        self._noise = keep * self._noise + (1 - keep) * noise
        self.updates += 1
        return True

    @property
    def grad_sq(self) -> float | None:
        """The averaged ``|G|²`` (bias-corrected), ``None`` before any update."""
        return self._grad_sq / (1 - self.decay**self.updates) if self.updates else None

    @property
    def noise(self) -> float | None:
        """The averaged ``S = tr(Σ)`` (bias-corrected), ``None`` before any update."""
        return self._noise / (1 - self.decay**self.updates) if self.updates else None

    @property
    def value(self) -> float | None:
        """``B_simple = S / |G|²`` in the caller's example, or ``None`` until it is sane
        (``min_updates`` updates and both averages > 0)."""
        if self.updates < self.min_updates or self._grad_sq <= 0 or self._noise <= 0:
            return None
        return self._noise / self._grad_sq

    def state_dict(self) -> dict[str, float]:
        """The averages and counters, as plain floats (for checkpoints; the settings
        ``decay`` and ``min_updates`` come from the configuration, not from here)."""
        return {
            "grad_sq": self._grad_sq,
            "noise": self._noise,
            "updates": float(self.updates),
            "skipped": float(self.skipped),
        }

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Restores :meth:`state_dict`'s output; refuses missing or unknown keys."""
        expected = {"grad_sq", "noise", "updates", "skipped"}
        if set(state) != expected:
            raise ValueError(
                f"noise-scale state needs keys {sorted(expected)}, got {sorted(state)}"
            )
        counts = (state["updates"], state["skipped"])
        if any(not float(c).is_integer() or c < 0 for c in counts):
            raise ValueError(f"noise-scale counters must be whole numbers >= 0, got {counts}")
        if not (math.isfinite(state["grad_sq"]) and math.isfinite(state["noise"])):
            raise ValueError(
                f"noise-scale averages must be finite, got {state['grad_sq']}, {state['noise']}"
            )
        self._grad_sq, self._noise = float(state["grad_sq"]), float(state["noise"])
        self.updates, self.skipped = int(counts[0]), int(counts[1])


@dataclass(frozen=True, kw_only=True, slots=True)
class NoiseScaleController:
    """Picks the global batch ``U`` from the noise scale: about ``B_simple`` examples.

    A decision (:meth:`units_for`) follows these rules, in this order of precedence:

    1. ``U`` is a multiple of ``multiple`` within ``[min_units, max_units]`` (the
       bounds taken inward to multiples): the split between sites needs it;
    2. it never shrinks: a batch that only grows is what the paper's argument (the
       noise scale grows as the loss falls) and practice (ramps) support, and a batch
       that went back and forth would make the learning rate follow it back and forth;
    3. a wish within ``dead_band`` above the current ``U`` is ignored, so estimation
       noise does not move the batch by a few units every decision;
    4. it grows at most ``max_growth`` times per decision (rounded down to a multiple),
       but by at least one multiple when it grows at all, so a coarse granularity
       cannot stall growth for ever.

    Rule 1 overrides the others: a ``U`` outside the bounds (say, after they changed)
    is brought inside, down if it must, or up past the growth cap. Deterministic: IEEE
    double arithmetic, no state.
    """

    min_units: int
    """Smallest global batch, in units (>= 1)."""
    max_units: int
    """Largest global batch, in units (>= ``min_units``)."""
    multiple: int
    """``U`` is a multiple of this (>= 1), e.g. the sum of the sites' dp widths."""
    examples_per_unit: float
    """Examples per unit, in the example :class:`NoiseScale` was fed: ``train.batch_size``
    for sequences, ``train.batch_size * train.seq_len`` for tokens."""
    max_growth: float = 2.0
    """Largest factor (> 1) by which one decision may grow ``U``."""
    dead_band: float = 0.1
    """Relative excess (>= 0) of the wish over the current ``U`` below which ``U`` stays."""
    target_ratio: float = 1.0
    """Batch aimed at, as a multiple (> 0) of ``B_simple``; the paper finds the critical
    batch close to ``B_simple``, within a factor that depends on the task."""

    def __post_init__(self) -> None:
        if self.min_units < 1 or self.max_units < self.min_units:
            raise ValueError(
                f"need 1 <= min_units <= max_units, got {self.min_units}, {self.max_units}"
            )
        if self.multiple < 1:
            raise ValueError(f"multiple must be >= 1, got {self.multiple}")
        if self.lowest > self.highest:
            raise ValueError(
                f"no multiple of {self.multiple} in [{self.min_units}, {self.max_units}]"
            )
        if not (math.isfinite(self.examples_per_unit) and self.examples_per_unit > 0):
            raise ValueError(
                f"examples_per_unit must be finite and > 0, got {self.examples_per_unit}"
            )
        if not (math.isfinite(self.max_growth) and self.max_growth > 1):
            raise ValueError(f"max_growth must be finite and > 1, got {self.max_growth}")
        if not (math.isfinite(self.dead_band) and self.dead_band >= 0):
            raise ValueError(f"dead_band must be finite and >= 0, got {self.dead_band}")
        if not (math.isfinite(self.target_ratio) and self.target_ratio > 0):
            raise ValueError(f"target_ratio must be finite and > 0, got {self.target_ratio}")

    @property
    def lowest(self) -> int:
        """The smallest ``U`` allowed: ``min_units`` rounded up to a multiple."""
        return -(-self.min_units // self.multiple) * self.multiple

    @property
    def highest(self) -> int:
        """The largest ``U`` allowed: ``max_units`` rounded down to a multiple."""
        return self.max_units // self.multiple * self.multiple

    def _clamp(self, units: int) -> int:
        return min(self.highest, max(self.lowest, units))

    def units_for(self, noise_scale: float | None, current_units: int) -> int:
        """The global batch for the next steps: ``current_units`` (rounded up to a
        multiple, clamped) unless ``noise_scale`` (:attr:`NoiseScale.value`) asks for more."""
        if current_units < 1:
            raise ValueError(f"current_units must be >= 1, got {current_units}")
        m = self.multiple
        held = self._clamp(-(-current_units // m) * m)
        if noise_scale is None or not (math.isfinite(noise_scale) and noise_scale > 0):
            return held
        wish = self.target_ratio * noise_scale / self.examples_per_unit
        if wish < current_units * (1 + self.dead_band):
            return held
        wanted = round_units(wish, m)
        if wanted <= current_units:
            return held
        cap = max(math.floor(current_units * self.max_growth / m) * m, (current_units // m + 1) * m)
        return self._clamp(min(wanted, cap))


def lr_for_units(base_lr: float, units: int, reference_units: int, rule: str = "sqrt") -> float:
    """The learning rate for a global batch of ``units``, ``base_lr`` being tuned at
    ``reference_units``.

    The rules are :func:`isthmus.intra.flops.scaled_lr`'s (``"linear"``, ``"sqrt"``,
    ``"none"``), which scales with the data-parallel width at a fixed per-rank batch:
    units (micro-batches of ``train.batch_size``) are the same kind of count, and equal
    ``dp_total`` when every rank takes one micro-batch. So ``reference_units`` is
    ``train.lr_reference_dp`` for a run configured that way."""
    if units < 1 or reference_units < 1:
        raise ValueError(f"units and reference_units must be >= 1, got {units}, {reference_units}")
    return scaled_lr(base_lr, units, rule=rule, reference_dp=reference_units)
