"""benchmarks/stalled_flow.py on a small case: its table and JSON, and the comparison
it exists for (a round across a stalled flow ends sooner with the deadlines, exact)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import stalled_flow  # noqa: E402 (the script's folder, put on sys.path above)

pytestmark = pytest.mark.timeout(120)


def test_the_stalled_flow_benchmark_compares_deadlines_with_none(
    tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("no_grpc_proxy", "none.invalid")  # the script sets it: put back after
    out = tmp_path / "stalled.json"
    argv = ["--mib", "2", "--stall-s", "3", "--floor-s", "0.3", "--json", str(out)]
    assert stalled_flow.main(argv) == 0
    table = capsys.readouterr().out
    assert "no deadlines" in table and f"wrote {out}" in table
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert all(r["exact"] and not r["failed"] for r in rows.values()), rows
    clean, left, waited = rows["clean"], rows["deadlines"], rows["no deadlines"]
    assert clean["link_stalled_flows"] == 0
    assert left["link_stalled_flows"] == waited["link_stalled_flows"] == 2  # one each way
    assert left["stalled_flows"] >= 1 and waited["stalled_flows"] == 0
    # Without deadlines the round waits the 3 s stall out; with them it leaves the flow
    # past the 0.3 s floor.
    assert waited["wall_s"] >= 3.0
    assert left["wall_s"] < waited["wall_s"] - 1.0, rows


def test_bad_arguments_are_refused_in_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        stalled_flow.main(["--connections", "0"])
    assert exc.value.code == 2
    assert "--connections must be >= 1" in capsys.readouterr().err
