"""The planning model's arithmetic and its CLI (the emulated-run check is benchmarks/plan_check.py)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from helpers import assert_one_line_error, run_cli

from isthmus.deploy.config.job import load_config
from isthmus.deploy.config.planning import preset_input
from isthmus.sim.plan import (
    PlanInput,
    bandwidth_for_efficiency,
    nemotron_340b,
    predict,
    scaling_curve,
)

BASE = PlanInput(
    params=1e9,
    tokens_per_step=1e6,
    sites=2,
    devices_per_site=8,
    peak_flops=1e15,
    mfu=0.5,
    bandwidth_bps=100e9,
    rtt_s=0.01,
)


def test_compute_time_is_six_n_flops_per_token_over_site_throughput():
    plan = predict(BASE)
    # Each site trains half the tokens on 8 devices at half of 1 PFLOP/s.
    assert plan.compute_s == pytest.approx(6 * 1e9 * 0.5e6 / (8 * 1e15 * 0.5))


def test_wire_time_is_the_ring_optimum_over_the_link():
    plan = predict(BASE)
    assert plan.wire_bytes_per_site == pytest.approx(2 * (1 / 2) * 4e9)
    assert plan.wire_s == pytest.approx(4e9 * 8 / 100e9)
    # Plus one RTT and one chunk of pipeline fill for the one round.
    assert plan.sync_s == pytest.approx(plan.wire_s + (1 << 20) * 8 / 100e9 + 0.01)
    three = predict(replace(BASE, sites=3))
    assert three.wire_bytes_per_site == pytest.approx(2 * (2 / 3) * 4e9)


def test_rounds_pay_a_latency_and_a_chunk_of_fill_each():
    one = predict(BASE)
    many = predict(replace(BASE, rounds=10))
    assert many.sync_s - one.sync_s == pytest.approx(9 * (0.01 + (1 << 20) * 8 / 100e9))
    # A group smaller than a chunk is carried twice: contribution, then result.
    small = replace(BASE, params=1e5, rounds=4, chunk_bytes=1 << 20)
    group = 1e5 * 4 / 4
    assert predict(small).sync_s == pytest.approx(
        predict(small).wire_s + 4 * group * 8 / 100e9 + 4 * 0.01
    )


def test_one_site_is_perfectly_efficient():
    plan = predict(replace(BASE, sites=1))
    assert plan.sync_s == 0 and plan.scaling_efficiency == 1.0
    assert bandwidth_for_efficiency(replace(BASE, sites=1), 0.99) == 0.0


def test_codec_ratio_and_overlap_shrink_the_exposed_time():
    plain = predict(BASE)
    assert predict(replace(BASE, codec_ratio=4)).wire_s == pytest.approx(plain.wire_s / 4)
    # One round starts when backward ends: nothing hides, whatever the overlap.
    assert predict(replace(BASE, overlap=1.0)).exposed_sync_s == pytest.approx(plain.sync_s)
    grouped = replace(BASE, rounds=4)
    hidden = predict(replace(grouped, overlap=1.0))
    expected = max(hidden.sync_s / 4, hidden.sync_s - 2 / 3 * hidden.compute_s)
    assert hidden.exposed_sync_s == pytest.approx(expected)
    assert hidden.scaling_efficiency > predict(grouped).scaling_efficiency


def test_limit_names_what_bounds_the_sync():
    assert predict(BASE).limit == "link"
    assert predict(replace(BASE, codec_bytes_per_s=1e8)).limit == "cpu"
    assert predict(replace(BASE, bandwidth_bps=1e15, rtt_s=1.0)).limit == "latency"


@pytest.mark.parametrize("target", [0.5, 0.9, 0.96])
def test_bandwidth_for_efficiency_reaches_exactly_the_target(target):
    needed = bandwidth_for_efficiency(BASE, target)
    assert predict(replace(BASE, bandwidth_bps=needed)).scaling_efficiency == pytest.approx(target)
    assert predict(replace(BASE, bandwidth_bps=needed * 0.9)).scaling_efficiency < target


def test_unreachable_targets_say_so():
    # An RTT longer than the whole allowed exposure: no bandwidth is enough.
    assert math.isinf(bandwidth_for_efficiency(replace(BASE, rtt_s=10.0), 0.96))
    with pytest.raises(ValueError, match="efficiency"):
        bandwidth_for_efficiency(BASE, 1.5)


@pytest.mark.parametrize(
    "field, value", [("mfu", 0.0), ("mfu", 1.5), ("sites", 0), ("overlap", -0.1), ("rtt_s", -1)]
)
def test_invalid_inputs_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        replace(BASE, **{field: value})


def test_nemotron_scenario_is_self_consistent():
    p = nemotron_340b()
    # 2304 x 4096 tokens at 6 x 340B FLOPs each over 3072 H100s at 41%: ~15 s,
    # about what Nemotron-4's report shows for its 6144-GPU stage (8 s) scaled by 2.
    assert predict(p).compute_s == pytest.approx(15.45, rel=0.01)
    assert 100e9 < bandwidth_for_efficiency(p, 0.96) < 2e12


@pytest.mark.timeout(180)  # a deadline: the CLI imports torch, 20-60 s at a load of 10
def test_plan_cli_prints_the_340b_prediction_next_to_nemo():
    result = run_cli("plan", timeout=150)
    assert result.returncode == 0, result.stderr
    assert "340.0B parameters" in result.stdout
    assert "bandwidth for 96%" in result.stdout and "NVIDIA NeMo, published" in result.stdout
    as_json = run_cli("plan", "--json", "--bandwidth-gbit", "800", timeout=150)
    data = json.loads(as_json.stdout)
    assert data["inputs"]["bandwidth_bps"] == 800e9
    assert data["prediction"]["scaling_efficiency"] > 0.9


@pytest.mark.timeout(180)  # a deadline: the CLI imports torch, 20-60 s at a load of 10
def test_plan_cli_bad_input_is_one_line():
    assert_one_line_error(run_cli("plan", "--mfu", "2", timeout=150), "mfu must be in (0, 1]")


def test_on_a_shared_cpu_nothing_hides_and_cpu_work_overlaps_the_link():
    p = replace(BASE, rounds=4, overlap=1.0, round_overhead_s=0.05)
    apart, shared = predict(p), predict(replace(p, shared_cpu=True))
    link_s = shared.sync_s - 4 * 0.05
    assert shared.exposed_sync_s == pytest.approx(max(0.2, link_s))
    assert shared.exposed_sync_s > apart.exposed_sync_s


def test_rounds_in_flight_hide_each_others_latency_but_not_the_last_ones():
    many = replace(BASE, rounds=8, overlap=7 / 8)
    one_by_one, windowed = predict(many), predict(replace(many, window=4))
    per_round = (1 << 20) * 8 / 100e9 + 0.01
    assert one_by_one.sync_s - windowed.sync_s == pytest.approx((8 - 2) * per_round)
    # The last round starts after backward: its bytes and one RTT are always exposed.
    assert windowed.exposed_sync_s >= windowed.wire_s / 8 + per_round - 1e-12
    assert predict(replace(many, window=100)).sync_s == pytest.approx(one_by_one.wire_s + per_round)


def test_overlap_is_a_queue_of_groups_arriving_over_backward():
    # Groups arrive evenly over backward and the link serves them in order: the wait
    # after backward is the larger of the last round alone and what did not fit.
    p = replace(BASE, rounds=10, overlap=0.9, rtt_s=0.0, bandwidth_bps=10e9)
    plan = predict(p)
    backward = 2 / 3 * plan.compute_s
    tail = plan.sync_s / 10
    assert plan.exposed_sync_s == pytest.approx(max(tail, plan.sync_s - 0.9 * backward))
    assert plan.overlap == pytest.approx(1 - plan.exposed_sync_s / plan.sync_s)
    # Recomputing the forward in backward (activation checkpointing) lengthens what hides.
    longer = predict(replace(p, backward_share=0.75))
    assert longer.exposed_sync_s <= plan.exposed_sync_s


def test_the_curve_hides_more_sync_at_larger_batches_and_a_lone_site_is_the_reference():
    curve = scaling_curve(replace(BASE, rounds=20, overlap=0.95), [1, 4, 16, 64], 2048)
    assert [c.sync_s for c in curve] == pytest.approx([curve[0].sync_s] * 4)
    efficiency = [c.scaling_efficiency for c in curve]
    assert efficiency == sorted(efficiency) and efficiency[-1] > 0.9 > efficiency[0]
    for c in curve:
        assert c.tokens_per_s == pytest.approx(2 * c.one_site_tokens_per_s * c.scaling_efficiency)
    with pytest.raises(ValueError, match="batches"):
        scaling_curve(BASE, [0], 2048)


@pytest.mark.timeout(180)  # a deadline: the CLI imports torch, 20-60 s at a load of 10
def test_plan_cli_gives_the_curve_of_a_preset_against_the_per_gpu_batch():
    args = ("plan", "--preset", "1b", "--gbit", "10", "--rtt-ms", "10", "--codec", "int8")
    args += ("--devices-per-site", "2", "--mfu", "0.45", "--batch", "4,16,64")
    result = run_cli(*args, timeout=150)
    assert result.returncode == 0, result.stderr
    assert "1.03B parameters, 21 rounds" in result.stdout
    assert "16 x 2048" in result.stdout and "efficiency" in result.stdout
    data = json.loads(run_cli(*args, "--json", timeout=150).stdout)
    assert data["inputs"]["codec_ratio"] == 4.0 and data["inputs"]["rounds"] == 21
    # The chunk isthmus local picks for a 10 Gbit/s, 10 ms link.
    assert data["inputs"]["chunk_bytes"] == 8 << 20  # its 12.5 MB BDP, on the bulk port
    curve = data["curve"]
    assert [row["batch"] for row in curve] == [4, 16, 64]
    assert curve[0]["scaling_efficiency"] < curve[-1]["scaling_efficiency"]
    # 1.03B fp32 gradients as int8 cross at 10 Gbit/s in ~0.82 s, whatever the batch.
    assert curve[0]["wire_s"] == pytest.approx(1.03e9 * 8 / 10e9, rel=0.01)
    assert run_cli("plan", "--preset", "tiny", "--batch", "2,x", timeout=150).returncode == 2


@pytest.mark.timeout(180)  # a deadline: the CLI imports torch, 20-60 s at a load of 10
def test_plan_cli_models_a_mixture_of_experts_at_the_batch_isthmus_local_trains():
    """Issue 36: compute by the parameters a token passes through, bytes by all of them
    (every expert's gradient crosses); without --batch, the preset's own batch
    (train.batch_size sequences a device), not one sequence for the whole job."""
    result = run_cli("plan", "--preset", "moe-125m", "--gbit", "10", "--sites", "2", timeout=150)
    assert result.returncode == 0, result.stderr
    assert "0.37B parameters (0.11B active a token)" in result.stdout
    moe = preset_input("moe-125m", seq_len=2048, bandwidth_bps=10e9, rtt_s=0.01, sites=2)
    batch = load_config(overrides=["model.preset=moe-125m"]).train.batch_size
    assert moe.tokens_per_step == batch * 2048 * 1 * 2  # x seq x devices x sites
    assert 6 * moe.active_params < moe.flops_per_token < 6 * moe.params
    assert moe.params > 3 * moe.active_params
    dense = preset_input("125m", seq_len=2048, bandwidth_bps=10e9, rtt_s=0.01)
    assert dense.active_params == dense.params


@pytest.mark.timeout(180)  # a deadline: the CLI imports torch, 20-60 s at a load of 10
def test_plan_cli_refuses_an_unknown_codec_in_one_line():
    assert_one_line_error(run_cli("plan", "--codec", "lz4", timeout=150), "--codec")


def test_diloco_pays_one_round_every_h_steps_and_a_delay_hides_it():
    step = replace(BASE, bandwidth_bps=1e9)  # a 4 GB gradient: 32 s of link, 3 s of compute
    per_step = predict(step)
    h = 50
    diloco = predict(replace(step, inner_steps=h))
    # One round of the same bytes (the fp32 outer gradient) per H steps, nothing hidden.
    assert diloco.wire_bytes_per_site == pytest.approx(per_step.wire_bytes_per_site / h)
    assert diloco.sync_s == pytest.approx(per_step.sync_s / h)
    assert diloco.exposed_sync_s == pytest.approx(per_step.sync_s / h)
    assert diloco.compute_s == per_step.compute_s
    # Behind d steps the round is exposed only beyond d steps of compute...
    d = 5
    delayed = predict(replace(step, inner_steps=h, outer_delay=d))
    expected = (per_step.sync_s - d * per_step.compute_s) / h
    assert delayed.exposed_sync_s == pytest.approx(expected)
    # ...and not at all once they cover it.
    hidden = predict(replace(step, inner_steps=h, outer_delay=h - 1))
    assert hidden.exposed_sync_s == 0 and hidden.scaling_efficiency == 1.0
    assert per_step.scaling_efficiency < diloco.scaling_efficiency < 1.0
    with pytest.raises(ValueError, match="outer_delay"):
        replace(step, inner_steps=h, outer_delay=h)


def test_streaming_sends_a_fragment_every_h_over_p_steps():
    step = replace(BASE, bandwidth_bps=1e9)
    h, p = 100, 4
    diloco = predict(replace(step, inner_steps=h))
    streaming = predict(replace(step, inner_steps=h, fragments=p))
    # The same bytes per step (the whole outer gradient once per H steps)...
    assert streaming.wire_bytes_per_site == pytest.approx(diloco.wire_bytes_per_site)
    # ...in rounds of a quarter of it, every 25 steps: each hides behind fewer steps.
    fragment_round_s = streaming.sync_s * (h // p)
    assert fragment_round_s < diloco.sync_s * h / 2
    d = 3
    delayed = predict(replace(step, inner_steps=h, fragments=p, outer_delay=d))
    assert delayed.exposed_sync_s == pytest.approx(
        max(0.0, fragment_round_s - d * streaming.compute_s) / (h // p)
    )
    with pytest.raises(ValueError, match=r"inner_steps/fragments=25"):
        replace(step, inner_steps=h, fragments=p, outer_delay=25)
    with pytest.raises(ValueError, match="fragments must divide"):
        replace(step, inner_steps=h, fragments=3)


@pytest.mark.timeout(180)  # a deadline: the CLI imports torch, 20-60 s at a load of 10
def test_plan_cli_plans_diloco():
    args = ("plan", "--preset", "125m", "--batch", "16", "--devices-per-site", "2")
    args += ("--gbit", "1", "--codec", "int8", "--mfu", "0.4", "--json")
    result = run_cli(*args, "--inner-steps", "100", "--outer-delay", "99", timeout=150)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["inputs"]["inner_steps"] == 100 and data["inputs"]["outer_delay"] == 99
    # int8 125m at 1 Gbit/s: ~1 s per round, hidden behind 99 steps of compute.
    assert data["prediction"]["scaling_efficiency"] == 1.0
    # A site sends its fp32 outer gradient as int8 once per 100 steps: params / 100 bytes.
    params = data["inputs"]["params"]
    assert data["prediction"]["wire_bytes_per_site"] == pytest.approx(params / 100)
    stream = run_cli(*args, "--inner-steps", "100", "--fragments", "4", timeout=150)
    assert stream.returncode == 0, stream.stderr
    assert json.loads(stream.stdout)["inputs"]["fragments"] == 4
    bad = run_cli(*args[:-1], "--inner-steps", "10", "--outer-delay", "10", timeout=150)
    assert_one_line_error(bad, "outer_delay must be an integer in [0, inner_steps=10), got 10")
