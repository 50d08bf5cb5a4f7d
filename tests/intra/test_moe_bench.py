"""benchmarks/moe_step.py's CPU smoke mode: dense and both MoE paths in one run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_step.py"


def _bench():
    spec = importlib.util.spec_from_file_location("moe_step_bench", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


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


def test_an_unknown_preset_or_path_is_refused_in_one_line(capsys):
    bench = _bench()
    for argv, needle in [
        (["--preset", "moe-huge"], "unknown model preset 'moe-huge'"),
        (["--impl", "loop,fast"], "--impl fast: choose from"),
    ]:
        with pytest.raises(SystemExit) as e:
            bench.parse_args(argv)
        assert e.value.code == 2
        assert needle in capsys.readouterr().err
