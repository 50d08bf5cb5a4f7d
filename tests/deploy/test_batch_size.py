"""The adaptive global batch's pure parts (deploy/batch/size.py): the ramp against a
Megatron-style reference, the noise-scale estimator on synthetic gradients whose noise
scale is known, the controller's rules, and the learning rate that follows the batch."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest

from isthmus.deploy.batch.size import (
    NoiseScale,
    NoiseScaleController,
    RampSchedule,
    lr_for_units,
    noise_estimates,
    round_units,
)
from isthmus.intra.flops import scaled_lr

# --- the ramp ---------------------------------------------------------------------------


def megatron_style(start: int, increment: int, ramp: int, end: int, consumed: int) -> int:
    """Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator.update, written from its
    description, with steps in place of consumed samples: float stage length, int()."""
    if consumed > ramp:
        return end
    per_increment = ramp / ((end - start) // increment)
    return start + int(consumed / per_increment) * increment


def test_ramp_stage_boundaries_by_hand() -> None:
    # 4 -> 16 by 4 over 30 steps: three increments, 10 steps per stage.
    ramp = RampSchedule(start_units=4, end_units=16, increment_units=4, ramp_steps=30)
    expected = {0: 4, 9: 4, 10: 8, 19: 8, 20: 12, 29: 12, 30: 16, 31: 16, 10_000: 16}
    assert {step: ramp.units_at(step) for step in expected} == expected
    # 8 -> 32 by 8 over 10 steps: stages of 10/3 steps, boundaries at floor(3t/10).
    uneven = RampSchedule(start_units=8, end_units=32, increment_units=8, ramp_steps=10)
    assert [uneven.units_at(t) for t in range(12)] == [8, 8, 8, 8, 16, 16, 16, 24, 24, 24, 32, 32]


@pytest.mark.parametrize(
    ("start", "end", "increment", "ramp_steps"),
    [(4, 16, 4, 30), (8, 32, 8, 10), (1, 64, 3, 1000), (16, 256, 16, 7), (2, 10, 1, 1)],
)
def test_ramp_matches_megatron_but_at_its_float_boundaries(
    start: int, end: int, increment: int, ramp_steps: int
) -> None:
    ramp = RampSchedule(
        start_units=start, end_units=end, increment_units=increment, ramp_steps=ramp_steps
    )
    increments = (end - start) // increment
    for step in range(ramp_steps + 5):
        ours = ramp.units_at(step)
        reference = megatron_style(start, increment, ramp_steps, end, step)
        if step <= ramp_steps and step * increments % ramp_steps == 0:
            # An exact stage boundary: Megatron's float division may land just below
            # the integer there (10 / (10 / 3) = 2.9999999999999996); ours is exact.
            assert ours == start + step * increments // ramp_steps * increment
            assert reference in (ours, ours - increment)
        else:
            assert ours == reference, step
    assert ramp.units_at(ramp_steps) == end


def test_ramp_edges() -> None:
    flat = RampSchedule(start_units=8, end_units=8, increment_units=5, ramp_steps=100)
    assert {flat.units_at(t) for t in range(0, 200, 7)} == {8}
    instant = RampSchedule(start_units=2, end_units=8, increment_units=2, ramp_steps=0)
    assert instant.units_at(0) == 8
    # More increments than steps: some sizes are skipped, the ramp still ends on time.
    steep = RampSchedule(start_units=1, end_units=11, increment_units=1, ramp_steps=4)
    assert [steep.units_at(t) for t in range(6)] == [1, 3, 6, 8, 11, 11]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(start_units=0, end_units=8, increment_units=1, ramp_steps=10), "start_units"),
        (dict(start_units=8, end_units=4, increment_units=1, ramp_steps=10), "end_units"),
        (dict(start_units=4, end_units=8, increment_units=0, ramp_steps=10), "increment_units"),
        (dict(start_units=4, end_units=9, increment_units=2, ramp_steps=10), "does not divide"),
        (dict(start_units=4, end_units=8, increment_units=2, ramp_steps=-1), "ramp_steps"),
    ],
)
def test_ramp_refusals(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RampSchedule(**kwargs)


def test_ramp_refuses_negative_step() -> None:
    with pytest.raises(ValueError, match="step"):
        RampSchedule(start_units=1, end_units=2, increment_units=1, ramp_steps=3).units_at(-1)


def test_round_units() -> None:
    assert [round_units(u, 4) for u in (0, 1, 2, 3, 5, 6, 7, 9.9, 10, 100)] == [
        4,  # never below one multiple
        4,
        4,  # a tie rounds up
        4,
        4,
        8,
        8,
        8,
        12,
        100,
    ]
    assert round_units(37, 1) == 37
    for bad in ((-1, 4), (math.nan, 4), (math.inf, 4), (8, 0)):
        with pytest.raises(ValueError):
            round_units(*bad)


# --- the noise scale --------------------------------------------------------------------

GRAD_SQ = 1.0
"""|G|² of the synthetic true gradient."""
TRACE = 100.0
"""tr(Σ) of its per-example noise: the true B_simple is TRACE / GRAD_SQ = 100 examples,
above the global batch of 64, where training would want a larger batch."""


def synthetic_steps(
    sizes: tuple[int, ...], steps: int, seed: int, dim: int = 1000
) -> Iterator[tuple[list[tuple[float, float]], float, float]]:
    """Per step: each site's (examples, |site mean|²), the global batch, |global mean|².

    Per-example gradients are G + noise, the noise Gaussian with a diagonal covariance
    of unequal variances (not isotropic: the estimator must not rely on it) and trace
    TRACE. Sites take consecutive slices of the same draw, so the global mean is the
    mean over all of them, as the sync makes it.
    """
    rng = np.random.default_rng(seed)
    direction = rng.standard_normal(dim)
    grad = direction * math.sqrt(GRAD_SQ) / np.linalg.norm(direction)
    variance = rng.uniform(0.2, 1.8, dim)
    std = np.sqrt(variance * TRACE / variance.sum())
    total = sum(sizes)
    edges = np.cumsum([0, *sizes])
    for _ in range(steps):
        # float32 draws for speed; the noise is scaled and the means taken in float64.
        per_example = grad + rng.standard_normal((total, dim), dtype=np.float32) * std
        sites = [
            (float(b), float(np.square(per_example[lo:hi].mean(axis=0)).sum()))
            for b, lo, hi in zip(sizes, edges[:-1], edges[1:], strict=True)
        ]
        yield sites, float(total), float(np.square(per_example.mean(axis=0)).sum())


@pytest.mark.parametrize("sizes", [(32, 32), (16, 48), (8, 16, 40)])
def test_noise_scale_converges_to_the_truth(sizes: tuple[int, ...]) -> None:
    steps = 400
    scale = NoiseScale(decay=0.99, min_updates=20)
    per_step = []
    for i, (sites, big, big_sq) in enumerate(synthetic_steps(sizes, steps, seed=len(sizes))):
        assert scale.value is None or i >= 20
        assert scale.update(sites, big, big_sq)
        estimate = noise_estimates(sites, big, big_sq)
        assert estimate is not None
        per_step.append(estimate)
    # Unbiased: the plain mean of the per-step estimates is within 4 standard errors
    # of the truth (the steps are independent, so the sample spread gives the error).
    values = np.array(per_step)
    error = values.std(axis=0, ddof=1) / math.sqrt(steps)
    assert np.all(np.abs(values.mean(axis=0) - (GRAD_SQ, TRACE)) < 4 * error)
    # The per-step |G|² estimate scatters by ~14 % (of |G|² = 1), S by ~5 %; an average
    # with decay 0.99 cuts a scatter by sqrt((1 - 0.99) / (1 + 0.99)) ~ 1/14, so the
    # ratio's is ~1.2 % (measured over 10 seeds: 0.7 to 1.2 %). 5 % is four of those.
    value = scale.value
    assert value is not None
    assert value == pytest.approx(TRACE / GRAD_SQ, rel=0.05)
    assert scale.grad_sq == pytest.approx(GRAD_SQ, rel=0.05)
    assert scale.noise == pytest.approx(TRACE, rel=0.05)


@pytest.mark.parametrize(
    "sites",
    [
        [(8.0, 3.1), (24.0, 1.9), (32.0, 1.6)],
        # Not every site's norm known (one did not report): each known site's estimate is
        # still unbiased, the big mean being over all 64 examples.
        [(8.0, 3.1), (24.0, 1.9)],
    ],
)
def test_pooled_estimate_is_the_weighted_mean_of_the_textbook_per_site_ones(
    sites: list[tuple[float, float]],
) -> None:
    big, big_sq = 64.0, 1.45
    textbook = [
        (
            (big * big_sq - b * sq) / (big - b),  # |G|², McCandlish et al. A.1
            (sq - big_sq) / (1 / b - 1 / big),  # S
        )
        for b, sq in sites
    ]
    weights = [big - b for b, _ in sites]
    expected = [
        sum(w * t[k] for w, t in zip(weights, textbook, strict=True)) / sum(weights) for k in (0, 1)
    ]
    estimate = noise_estimates(sites, big, big_sq)
    assert estimate == pytest.approx(expected, rel=1e-12)


def test_estimates_do_not_depend_on_the_order_of_sites() -> None:
    # Every site must compute the same bits; fsum's exact rounding makes order moot.
    sites = [(8.0, 3.1000000000000005), (24.0, 1.9), (32.0, 1.6000000000000003), (3.0, 7.7)]
    big = sum(b for b, _ in sites)
    first = noise_estimates(sites, big, 1.45)
    for order in ([3, 2, 1, 0], [1, 3, 0, 2], [2, 0, 3, 1]):
        assert noise_estimates([sites[i] for i in order], big, 1.45) == first


def test_one_site_gives_no_estimate() -> None:
    scale = NoiseScale(min_updates=1)
    assert noise_estimates([(64.0, 2.0)], 64.0, 2.0) is None
    assert not scale.update([(64.0, 2.0)], 64.0, 2.0)
    assert (scale.updates, scale.skipped, scale.value, scale.grad_sq) == (0, 1, None, None)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_norms_skip_the_step_and_change_nothing(bad: float) -> None:
    scale = NoiseScale(min_updates=1)
    assert scale.update([(16.0, 2.5), (48.0, 1.5)], 64.0, 1.4)
    before = scale.state_dict()
    assert not scale.update([(16.0, bad), (48.0, 1.5)], 64.0, 1.4)
    assert not scale.update([(16.0, 2.5), (48.0, 1.5)], 64.0, bad)
    after = scale.state_dict()
    assert after.pop("skipped") == before.pop("skipped") + 2
    assert after == before


@pytest.mark.parametrize(
    ("sites", "big", "big_sq"),
    [
        ([], 64.0, 1.0),  # no sites
        ([(16.0, 2.0), (80.0, 1.0)], 64.0, 1.0),  # a site larger than the whole
        ([(0.0, 2.0), (64.0, 1.0)], 64.0, 1.0),  # an empty site
        ([(16.0, 2.0), (48.0, 1.0)], math.inf, 1.0),  # a batch that is no count
        ([(16.0, -2.0), (48.0, 1.0)], 64.0, 1.0),  # a negative squared norm
        ([(16.0, 2.0), (48.0, 1.0)], 64.0, -1.0),
    ],
)
def test_caller_bugs_are_refused(
    sites: list[tuple[float, float]], big: float, big_sq: float
) -> None:
    scale = NoiseScale()
    with pytest.raises(ValueError):
        scale.update(sites, big, big_sq)
    assert (scale.updates, scale.skipped) == (0, 0)


def test_negative_estimates_are_kept_and_a_negative_average_reports_none() -> None:
    scale = NoiseScale(decay=0.5, min_updates=1)
    # |G_big|² well below the sites': S = 92.8 > 0, |G|² = (64 - 80 + 64 - 76.8) / 64 < 0.
    sites, big, big_sq = [(16.0, 5.0), (48.0, 1.6)], 64.0, 1.0
    grad_sq, noise = noise_estimates(sites, big, big_sq) or (0.0, 0.0)
    assert grad_sq < 0 < noise
    assert scale.update(sites, big, big_sq)
    assert scale.grad_sq == pytest.approx(grad_sq) and scale.value is None
    # A positive step afterwards averages with the negative one (not replacing it).
    positive = [(16.0, 2.0), (48.0, 1.2)], 64.0, 1.0
    good, _ = noise_estimates(*positive) or (0.0, 0.0)
    assert scale.update(*positive)
    # Bias-corrected average of two steps with decay 0.5: weights 1/3 and 2/3.
    assert scale.grad_sq == pytest.approx(grad_sq / 3 + 2 * good / 3)


def test_value_waits_for_min_updates() -> None:
    scale = NoiseScale(min_updates=3)
    for _ in range(2):
        scale.update([(16.0, 2.0), (48.0, 1.2)], 64.0, 1.0)
        assert scale.value is None
    scale.update([(16.0, 2.0), (48.0, 1.2)], 64.0, 1.0)
    grad_sq, noise = noise_estimates([(16.0, 2.0), (48.0, 1.2)], 64.0, 1.0) or (0.0, 0.0)
    assert scale.value == pytest.approx(noise / grad_sq)


def test_state_dict_round_trip_continues_bit_for_bit() -> None:
    data = list(synthetic_steps((16, 48), 30, seed=7, dim=50))
    original = NoiseScale(min_updates=5)
    for step in data[:20]:
        original.update(*step)
    original.update([(16.0, math.nan), (48.0, 1.0)], 64.0, 1.0)
    state = original.state_dict()
    assert all(type(v) is float for v in state.values())
    restored = NoiseScale(min_updates=5)
    restored.load_state_dict(dict(state))
    assert restored.state_dict() == state
    for step in data[20:]:
        original.update(*step)
        restored.update(*step)
    assert restored.state_dict() == original.state_dict()
    assert original.value is not None
    assert restored.value == original.value


@pytest.mark.parametrize(
    "state",
    [
        {"grad_sq": 1.0, "noise": 2.0, "updates": 3.0},  # missing
        {"grad_sq": 1.0, "noise": 2.0, "updates": 3.0, "skipped": 0.0, "decay": 0.9},  # unknown
        {"grad_sq": 1.0, "noise": 2.0, "updates": 3.5, "skipped": 0.0},
        {"grad_sq": 1.0, "noise": 2.0, "updates": -1.0, "skipped": 0.0},
        {"grad_sq": math.nan, "noise": 2.0, "updates": 3.0, "skipped": 0.0},
    ],
)
def test_load_state_dict_refuses_bad_state_and_keeps_its_own(state: dict[str, float]) -> None:
    scale = NoiseScale()
    scale.update([(16.0, 2.0), (48.0, 1.2)], 64.0, 1.0)
    before = scale.state_dict()
    with pytest.raises(ValueError):
        scale.load_state_dict(state)
    assert scale.state_dict() == before


def test_noise_scale_refuses_bad_settings() -> None:
    for kwargs in (dict(decay=1.0), dict(decay=-0.1), dict(min_updates=0)):
        with pytest.raises(ValueError):
            NoiseScale(**kwargs)


# --- the controller ---------------------------------------------------------------------


def controller(**overrides: float) -> NoiseScaleController:
    settings: dict = dict(min_units=16, max_units=512, multiple=8, examples_per_unit=4.0)
    return NoiseScaleController(**{**settings, **overrides})


def test_controller_aims_at_b_simple_in_examples() -> None:
    # B_simple = 400 examples at 4 examples per unit: 100 units, rounded to 8s: 104.
    assert controller().units_for(400.0, 64) == 104
    assert controller(target_ratio=0.5).units_for(800.0, 64) == 104


def test_controller_never_shrinks_and_holds_without_an_estimate() -> None:
    c = controller()
    assert c.units_for(40.0, 128) == 128  # wants 10 units
    assert c.units_for(None, 128) == 128
    for bad in (math.nan, math.inf, 0.0, -5.0):
        assert c.units_for(bad, 128) == 128


def test_controller_dead_band() -> None:
    c = controller(multiple=4)
    # 100 units now; a wish of 109 units is within 10 %, 111 is not (rounded to 112).
    assert c.units_for(109 * 4.0, 100) == 100
    assert c.units_for(111 * 4.0, 100) == 112
    assert controller(multiple=4, dead_band=0.0).units_for(103 * 4.0, 100) == 104


def test_controller_growth_cap() -> None:
    huge = 1e9
    assert controller().units_for(huge, 64) == 128
    assert controller(max_growth=1.5).units_for(huge, 64) == 96
    # 1.3 x 64 = 83.2, down to a multiple of 8: 80.
    assert controller(max_growth=1.3).units_for(huge, 64) == 80
    # Less than one multiple of growth allowed: one multiple all the same, not a stall.
    assert controller(max_growth=1.05, multiple=8).units_for(huge, 64) == 72


def test_controller_clamps_and_keeps_the_multiple() -> None:
    c = controller(min_units=20, max_units=500)  # multiples of 8 in range: 24 .. 496
    assert (c.lowest, c.highest) == (24, 496)
    assert c.units_for(None, 8) == 24  # below the floor: raised to it
    assert c.units_for(1e9, 400) == 496  # the cap would allow 800
    assert c.units_for(None, 1000) == 496  # above the bounds (they changed): lowered
    assert c.units_for(None, 100) == 104  # not a multiple: rounded up, never down
    for current in range(1, 600, 7):
        for noise in (None, 10.0, 300.0, 1e4, 1e9):
            units = c.units_for(noise, current)
            assert units % 8 == 0 and 24 <= units <= 496
            assert units >= min(current, 496)


def test_controller_decisions_over_a_run_only_grow_within_the_cap() -> None:
    c = controller(max_units=8192)
    units, history = 16, []
    for noise in np.linspace(50.0, 20_000.0, 60):  # a noise scale growing as loss falls
        new = c.units_for(float(noise), units)
        assert units <= new <= max(2 * units, units + 8)
        history.append(new)
        units = new
    assert history == sorted(history)
    # It ends within the dead band below the last wish (5000 units), or on it.
    assert 5000 / 1.1 <= history[-1] <= round_units(5000, 8)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(min_units=0),
        dict(max_units=8),
        dict(multiple=0),
        dict(min_units=17, max_units=23),  # no multiple of 8 inside
        dict(examples_per_unit=0.0),
        dict(examples_per_unit=math.inf),
        dict(max_growth=1.0),
        dict(dead_band=-0.1),
        dict(target_ratio=0.0),
    ],
)
def test_controller_refusals(overrides: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        controller(**overrides)
    with pytest.raises(ValueError):
        controller().units_for(100.0, 0)


# --- the learning rate ------------------------------------------------------------------


def test_lr_follows_units_by_scaled_lrs_rules() -> None:
    assert lr_for_units(1e-3, 32, 8, "linear") == pytest.approx(4e-3)
    assert lr_for_units(1e-3, 32, 8, "sqrt") == pytest.approx(2e-3)
    assert lr_for_units(1e-3, 32, 8, "none") == 1e-3
    for rule in ("linear", "sqrt", "none"):
        assert lr_for_units(3e-4, 24, 6, rule) == scaled_lr(3e-4, 24, rule, 6)
    with pytest.raises(ValueError, match="rule"):
        lr_for_units(1e-3, 32, 8, "cubic")
    with pytest.raises(ValueError, match="units"):
        lr_for_units(1e-3, 0, 8, "sqrt")
