"""The host's busy cores while a benchmark case runs, read from /proc/stat.

    python3 benchmarks/host_cpu.py sample FILE          # until killed: "time busy" lines
    python3 benchmarks/host_cpu.py annotate CASE.json FILE START END

`annotate` adds ``host_busy_cores_rounds`` to the case of an `allreduce.py` JSON: the
mean busy cores over the case's last 5 rounds (2 warm-up and 3 timed, which end just
before its processes exit at END), and prints one line with the link figures. It tells a
case bound by the host (both sites, their lanes and the emulator on one machine) from
one bound by the lanes' code.
"""

from __future__ import annotations

import json
import os
import sys
import time

EXIT_S = 0.7  # the case's processes leave this long after its last round, or less


def _cpu_ticks() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    return sum(fields), fields[3] + fields[4]  # all, idle + iowait


def sample(path: str, every_s: float = 0.25) -> None:
    hz = os.sysconf("SC_CLK_TCK")
    with open(path, "w", buffering=1) as out:
        total0, idle0 = _cpu_ticks()
        t0 = time.time()
        while True:
            time.sleep(every_s)
            total, idle = _cpu_ticks()
            t = time.time()
            out.write(f"{t:.3f} {((total - total0) - (idle - idle0)) / hz / (t - t0):.2f}\n")
            total0, idle0, t0 = total, idle, t


def annotate(case_path: str, cpu_path: str, start: float, end: float) -> str:
    with open(case_path) as f:
        data = json.load(f)
    case = data["cases"][0]
    with open(cpu_path) as f:
        points = [tuple(map(float, line.split())) for line in f if line.strip()]
    lo = max(start, end - EXIT_S - (case["warmup"] + case["repeats"]) * case["wall_s"])
    busy = [b for t, b in points if lo <= t <= end - EXIT_S]
    case["host_busy_cores_rounds"] = sum(busy) / len(busy) if busy else None
    with open(case_path, "w") as f:
        json.dump(data, f, indent=2)
    # The share of the links is a site's bytes over what its links carry while the
    # rounds ran (inter/data/bench.py), so this is the rate a site sent at.
    sent_gbit = case["link_utilization"] * case["gbit"] * case["links"]
    host = case["host_busy_cores_rounds"]
    # Every lane's CPU time in the timed step over its wall time: how much of the host
    # the lanes of all sites took, apart from the emulator's pumps.
    lanes = case["cpu_s_per_gb"] * case["tensor_bytes"] / 1e9 * case["sites"] / case["wall_s"]
    return (
        f"   {case['lanes']} lanes, {case['links']} links, {case['connections']} connections: "
        f"a site sends {sent_gbit:.1f} Gbit/s "
        f"({case['link_utilization']:.0%} of its links), "
        f"{case['goodput_mb_s'] / 1e3:.2f} GB/s of tensor, {case['cpu_s_per_gb']:.2f} CPU-s/GB, "
        f"host busy {'?' if host is None else f'{host:.1f}'} cores (lanes {lanes:.1f}), "
        f"identical {case['identical']}"
    )


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "sample":
        sample(argv[1])
        return 0
    if len(argv) == 5 and argv[0] == "annotate":
        print(annotate(argv[1], argv[2], float(argv[3]), float(argv[4])))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
