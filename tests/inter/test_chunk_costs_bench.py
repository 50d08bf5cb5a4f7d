"""`benchmarks/chunk_costs.py`: every step of a chunk's life timed, a table and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_benchmark


@pytest.mark.timeout(120)
def test_every_step_is_timed_from_each_thread_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "costs.json"
    code = load_benchmark("chunk_costs").main(
        ["--mib", "0.25", "--threads", "1,2", "--seconds", "0.05", "--retain", "3",
         "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    data = json.loads(out.read_text())
    steps = {r["step"] for r in data["rows"]}
    assert steps == {
        "encode+host copy", "crc32c", "socket (loopback)", "to device+decode",
        "sum+encode result", "decode+sum+encode",
    }  # fmt: skip
    assert len(data["rows"]) == 2 * len(steps) and data["retain"] == 3
    for row in data["rows"]:
        assert row["calls"] > 0 and row["ms_per_call"] > 0 and row["gb_s_fp32"] > 0, row
    table = capsys.readouterr().out
    assert "socket (loopback)" in table and "GB/s fp32" in table
