"""benchmarks/moe_step.py's CPU smoke mode: dense and both MoE paths in one run, and
two CPU ranks timing expert parallelism's static slots against the host-split path."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from helpers import load_benchmark

from isthmus.intra.model_config import preset

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_step.py"


def _bench():
    return load_benchmark("moe_step")


@pytest.mark.timeout(120)
def test_the_smoke_run_times_dense_and_both_moe_paths(tmp_path, capsys):
    out = tmp_path / "moe_step.json"
    _bench().main(
        [
            *("--device", "cpu", "--preset", "tiny,moe-tiny", "--impl", "loop,grouped"),
            *("--steps", "2", "--warmup", "1", "--json", str(out)),
        ]
    )
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [(r["preset"], r["impl"]) for r in rows] == [
        ("tiny", None),
        ("moe-tiny", "loop"),
        ("moe-tiny", "grouped"),
    ]
    assert all(r["step_s"] > 0 and 0 < r["mfu"] < 1 for r in rows)
    dense, loop, grouped = rows
    assert dense["moe_load_ratio"] is None and loop["moe_load_ratio"] >= 1.0
    # On CPU both paths run the same matmuls in the same order: the same loss bit for bit.
    assert loop["loss_last"] == grouped["loss_last"]
    assert "moe-tiny   grouped" in capsys.readouterr().out


def test_an_unknown_preset_path_or_capacity_is_refused_in_one_line(capsys):
    bench = _bench()
    for argv, needle in [
        (["--preset", "moe-huge"], "unknown model preset 'moe-huge'"),
        (["--impl", "loop,fast"], "--impl fast: choose from"),
        (["--capacity-factor", "0,-1"], "--capacity-factor 0,-1: comma-separated numbers"),
        (["--capacity-factor", "x"], "--capacity-factor x: comma-separated numbers"),
    ]:
        with pytest.raises(SystemExit) as e:
            bench.parse_args(argv)
        assert e.value.code == 2
        assert needle in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_two_cpu_ranks_time_static_slots_against_host_splits(tmp_path, monkeypatch):
    """ep 2 with a capacity: ``grouped`` exchanges static slots, one host read fewer a
    layer than ``host-splits``. Imported by name, not from its path: mp.spawn's ranks
    find ``run_rank`` by its module's name."""
    monkeypatch.syspath_prepend(str(BENCH.parent))
    bench = importlib.import_module("moe_step")
    out = tmp_path / "moe_step.json"
    bench.main(
        [
            *("--device", "cpu", "--nproc", "2", "--preset", "moe-tiny"),
            *("--impl", "host-splits,grouped", "--capacity-factor", "1.0"),
            *("--steps", "1", "--warmup", "1", "--json", str(out)),
        ]
    )
    counted, static = json.loads(out.read_text())["results"]
    assert (counted["impl"], static["impl"]) == ("host-splits", "grouped")
    assert counted["ep"] == 2 and static["capacity_factor"] == 1.0
    layers = preset("moe-tiny").n_layers
    assert counted["host_reads_per_step"] - static["host_reads_per_step"] == layers
    # The same copies through the same experts; the weights' gradients may differ in
    # their last bits (tests/intra/test_moe_parallel.py), so after the two updates
    # before the last step its loss by a few fp32 ulps at most.
    assert static["loss_last"] == pytest.approx(counted["loss_last"], rel=1e-5)
