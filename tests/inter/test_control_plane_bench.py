"""The control-plane load benchmark (benchmarks/control_plane.py): `--quick` runs end to
end, real coordinators and simulated ranks (each rank voting itself, and agents voting
for hosts of 4 ranks; a call a vote and one HostSession stream a voter; real host agents,
a process each, that each rank votes and watches through), and writes its rows as JSON."""

from __future__ import annotations

import json

import pytest
from helpers import run_benchmark


@pytest.mark.timeout(90)
def test_quick_mode_commits_every_step_at_every_rank(tmp_path):
    out = tmp_path / "control_plane.json"
    result = run_benchmark(
        *("control_plane", "--quick", "--host-ranks", "1,4"),
        *("--calls", "call,stream,agent", "--json", str(out)),
        timeout=85,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    ways = [(row["host_ranks"], row["calls"]) for row in rows]
    # No agent for one rank: such a rank votes on its own stream.
    assert ways == [(1, "call"), (1, "stream"), (4, "call"), (4, "stream"), (4, "agent")]
    for row in rows:
        assert "failed" not in row, row
        # 2 sites x 16 ranks x 3 measured steps, every one a COMMIT; nothing resent.
        assert row["verdicts"] == {"COMMIT": 2 * 16 * 3} and row["vote_errors"] == {}
        assert 0 < row["decision_ms_p50"] <= row["decision_ms_p99"]
        assert len(row["coordinator_cpu_s_per_step"]) == 2
        assert row["declared_dead"] == 0
    agents = rows[-1]
    # 8 agent processes (2 sites x 4 hosts) carried every vote of the run, the warm-up's
    # included, a host's ballots in about one message a step; their CPU is their own.
    assert agents["agents"]["votes"] == 2 * 16 * 4, agents["agents"]
    assert 0 < agents["agent_messages_per_host_step"] < 2 and agents["agents_cpu_s_per_step"] > 0
    assert "decision p50" in result.stdout


@pytest.mark.parametrize("flags", [["--ranks", "x"], ["--calls", "carrier-pigeon"]])
def test_bad_flags_are_one_line_errors(flags):
    result = run_benchmark("control_plane", *flags, timeout=30)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert flags[0] in result.stderr.splitlines()[-1]
