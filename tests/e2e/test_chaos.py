"""The chaos suite's quick subset (`isthmus chaos --quick`): real `isthmus site`
processes over emulated links, with sites killed, restarted and cut off mid-run.

Each scenario passes only when every surviving site exits 0 with the same final
parameter digest, and the membership really changed (docs/reliability.md).
"""

from __future__ import annotations

import dataclasses

import pytest
from helpers import assert_one_line_error, run_cli

from isthmus.deploy.chaos.suite import (
    SCENARIOS,
    ScenarioResult,
    pass_counts,
    run_scenario,
    unfit_scenarios,
)
from isthmus.deploy.commands.certs import write_certs

QUICK = [s for s in SCENARIOS if s.quick]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("scenario", QUICK, ids=[s.name for s in QUICK])
def test_survivors_finish_with_identical_replicas(scenario, tmp_path):
    result = run_scenario(scenario, tmp_path)
    assert result.ok, result.why
    assert set(result.digests) == set(scenario.survivors)
    assert len(set(result.digests.values())) == 1
    if scenario.name == "kill":
        assert result.min_live_sites == 1  # site0 trained on alone
    if scenario.name in ("kill-restart", "forge-rejoin", "partition", "node-silent"):
        assert result.rejoined == ["site1"]  # it pulled site0's state and came back
        assert result.goodput["state_pulls"]["bytes"] > 0  # and its goodput says so
    if scenario.name == "node-silent":
        assert result.min_live_sites == 1  # found silent: site0 trained on without it


OUTER_MODES = {
    # site1 dies before the job's first commit (after 5 steps).
    "diloco": ("sync.mode=diloco", "sync.inner_steps=5", "sync.outer_delay=2"),
    # A fragment's round every 2 steps: site1 dies between fragment rounds.
    "streaming": (
        "sync.mode=streaming",
        "sync.inner_steps=4",
        "sync.fragments=2",
        "sync.outer_delay=1",
    ),
}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", sorted(OUTER_MODES))
def test_a_restarted_site_rejoins_an_overlapped_outer_mode_job(tmp_path, mode):
    """kill-restart in DiLoCo and Streaming DiLoCo with a delay: site1's new
    incarnation is taken for dead at once, site0 goes on alone, then site1 pulls the
    state (anchors and outer momentum too) and rejoins."""
    scenario = next(s for s in SCENARIOS if s.name == "kill-restart")
    result = run_scenario(scenario, tmp_path, overrides=OUTER_MODES[mode])
    assert result.ok, result.why
    assert set(result.digests) == {"site0", "site1"}
    assert len(set(result.digests.values())) == 1
    assert result.rejoined == ["site1"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_forged_calls_are_found_out_in_streaming_mode(tmp_path):
    """forge in Streaming DiLoCo: its digests fall on the steps where rounds land, not
    per-step sync's; the forged digest claims must meet them and be checked with site1."""
    scenario = next(s for s in SCENARIOS if s.name == "forge")
    result = run_scenario(scenario, tmp_path, overrides=OUTER_MODES["streaming"])
    assert result.ok, result.why
    assert len(set(result.digests.values())) == 1


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("transport", ["bulk", "grpc"])
def test_under_mutual_tls_a_stalled_flow_costs_no_retry(tmp_path, transport):
    """stall-flow with mutual TLS, on the bulk port inside TLS (the default) and on
    ``PushChunks`` calls: each held connection's oldest frame or call misses its
    deadline and its chunks go on a new one; no step is retried and the replicas end
    equal (before, the tiny model's small rounds on gRPC streams never noticed the
    stall and every one failed at its timeout)."""
    certs = tmp_path / "certs"
    write_certs(certs, ["site0", "site1"])
    tls = (
        f"security.certs_dir={certs}",
        "security.require_tls=true",
        "security.require_token=true",
        f"sync.transport={transport}",
    )
    scenario = next(s for s in SCENARIOS if s.name == "stall-flow")
    result = run_scenario(scenario, tmp_path / "run", overrides=tls)
    assert result.ok, result.why
    assert result.stalled_flows >= 1 and result.retries == 0
    assert len(set(result.digests.values())) == 1


LAYOUTS = {
    # Two ranks per site: each rank's shard of the state is what the rejoining
    # site pulls (invariant 3), whatever axis the ranks split. The same with
    # topology.cp=2 hung once in 10 runs (site1's two ranks out of step in the cp
    # all-gather two steps before the end, after a clean rejoin). Since then it
    # passed 47 runs in a row (`isthmus chaos --only kill-restart --repeat N --set
    # topology.ranks_per_site=2 --set model.preset=tiny --set topology.cp=2`, 15 of
    # them beside the test suite; 2026-11-28), but its cause was never found, so it
    # stays out of this suite rather than risk a hang in CI.
    "ep2": ("topology.ranks_per_site=2", "model.preset=moe-tiny", "topology.ep=2"),
}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_restarted_site_rejoins_with_expert_parallel_ranks(tmp_path, layout):
    """kill-restart with the experts (ep) split over each site's two ranks: site1
    pulls every rank's shard from site0 and the replicas end equal."""
    scenario = next(s for s in SCENARIOS if s.name == "kill-restart")
    # Two ranks a site start slower than one: on a loaded 2-core machine site1 was not
    # back before site0's last step of 60 (with the old code too, 2026-11-29), so site0
    # runs 90 (~10 s more at the scenario's pace).
    scenario = dataclasses.replace(scenario, steps=90)
    result = run_scenario(scenario, tmp_path, overrides=LAYOUTS[layout])
    assert result.ok, result.why
    assert set(result.digests) == {"site0", "site1"}
    assert len(set(result.digests.values())) == 1
    assert result.rejoined == ["site1"]


def test_an_unknown_scenario_is_a_one_line_error(tmp_path):
    result = run_cli("chaos", "--only", "meteor", "--keep", str(tmp_path), timeout=60)
    assert_one_line_error(result, "unknown scenario(s) ['meteor']")


def test_a_scenario_the_sync_mode_cannot_run_is_skipped_or_refused_by_name(tmp_path):
    diloco = ("sync.mode=diloco", "sync.inner_steps=5")
    unfit = unfit_scenarios(list(SCENARIOS), diloco, named=False)
    assert list(unfit) == ["slow-balance"]
    assert "train.balance_every=4 needs sync.mode=step" in unfit["slow-balance"]
    assert unfit_scenarios(list(SCENARIOS), (), named=False) == {}
    # Asked for by name, it is a one-line refusal before anything runs.
    result = run_cli(
        "chaos", "--only", "slow-balance", "--keep", str(tmp_path),
        *("--set", diloco[0], "--set", diloco[1]), timeout=60,
    )  # fmt: skip
    assert_one_line_error(result, "scenario slow-balance: train.balance_every=4 needs")
    assert not any(tmp_path.iterdir())


def test_repeat_must_be_at_least_one(tmp_path):
    result = run_cli("chaos", "--repeat", "0", "--keep", str(tmp_path), timeout=60)
    assert_one_line_error(result, "--repeat must be >= 1, got 0")


def test_a_hung_survivor_fails_its_scenario_within_one_budget(tmp_path):
    """The injection's wait and the judge's share SITE_TIMEOUT_S from the scenario's
    start: a site that never exits fails the scenario, with its log's tail, once the
    budget is spent, before a test's own timeout (which would show only thread stacks)."""
    import sys
    import time

    from isthmus.deploy.chaos.judge import judge
    from isthmus.deploy.chaos.sites import SiteProcess

    scenario = next(s for s in SCENARIOS if s.name == "kill")
    hung = SiteProcess("site0", [sys.executable, "-c", "import time; print('stuck', flush=True); time.sleep(600)"],
                       {}, tmp_path / "site0")  # fmt: skip
    hung.start()
    try:
        deadline = time.monotonic() + 60
        while "stuck" not in hung.text():  # up and logging: its tail is in the reason
            assert time.monotonic() < deadline, "the stand-in site never started"
            time.sleep(0.05)
        spent = time.monotonic()  # as if the injection had spent the budget
        result = judge(scenario, {"site0": hung}, tmp_path / "run", spent, tls=False)
        waited = time.monotonic() - spent
    finally:
        hung.kill()
    assert not result.ok and result.why.startswith("site0 exited with None"), result.why
    assert "stuck" in result.why
    assert waited < 30, waited  # the judge's 1 s floor, not a budget of its own (360 s)


def test_repeated_runs_are_counted_per_scenario():
    runs = [
        ScenarioResult(name="partition", ok=True, wall_s=40.0),
        ScenarioResult(name="kill", ok=True, wall_s=30.0),
        ScenarioResult(name="partition", ok=False, wall_s=200.0, why="no decision"),
    ]
    assert pass_counts(runs) == "passed: partition 1/2, kill 1/1"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_soak_ends_identical_and_sets_its_goodput_and_loss_against_a_fault_free_run(
    tmp_path,
):
    """`isthmus chaos --only soak` as a user runs it: three streaming sites through a
    restart, a link gone dark and a site slowed 2x; every site ends identical, and the
    run is set against the same job without faults (issue 62: loss within 2 %)."""
    result = run_cli("chaos", "--only", "soak", "--keep", str(tmp_path), timeout=380)
    assert result.returncode == 0, result.stdout + result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith("soak "))
    assert row.split()[1] == "ok", result.stdout
    line = next(line for line in result.stdout.splitlines() if "of the fault-free run" in line)
    change = float(line.rsplit("(", 1)[1].rstrip("%)"))
    assert abs(change) < 2.0, line
