"""benchmarks/tls_lanes.py on a small case: two sites' lanes under mutual TLS on
loopback, its table and JSON, every round identical at both sites."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


def test_the_tls_lanes_benchmark_prints_its_table_and_writes_json(tmp_path) -> None:
    out = tmp_path / "tls.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tls_lanes.py"), "--mib", "2",
         "--rounds", "1", "--codec", "raw,int8", "--plain", "--json", str(out)],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "GB/s" in done.stdout and "raw" in done.stdout and "int8" in done.stdout
    rows = json.loads(out.read_text())["results"]
    # Each codec on the default (the bulk port inside TLS), on gRPC, and without TLS.
    cases = [(r["codec"], r["transport"], r["tls"]) for r in rows]
    assert cases == [
        (codec, transport, tls)
        for codec in ("raw", "int8")
        for transport, tls in (("auto", True), ("grpc", True), ("bulk", False))
    ]
    assert all(r["identical"] and r["gb_s"] > 0 and r["cpu_s_per_gb"] > 0 for r in rows)


def test_the_tls_lanes_benchmark_refuses_a_bad_size(capsys: pytest.CaptureFixture[str]) -> None:
    # The script's main in this process: the size is refused before any work, and a
    # process of its own spent 3-4 s importing torch first.
    with pytest.raises(SystemExit) as exc:
        load_benchmark("tls_lanes").main(["--mib", "0"])
    assert exc.value.code == 2 and "--mib" in capsys.readouterr().err
