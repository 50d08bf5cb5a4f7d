"""The table of benchmarks/lanes_side_by_side.sh: old against new, from its JSON files.

    python3 benchmarks/lanes_summary.py OUT_DIR [--json summary.json]

For each device, lane count and codec: the median over repeats of GB/s of fp32 tensor
per site (``goodput_mb_s``) and of process CPU seconds per GB, old and new.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

_NAME = re.compile(r"(old|new)-(\w+)-lanes(\d+)-r\d+\.json")


def summarize(folder: Path) -> list[dict]:
    runs: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(folder.glob("*.json")):
        match = _NAME.fullmatch(path.name)
        if not match:
            continue
        which, device, lanes = match.group(1), match.group(2), int(match.group(3))
        for case in json.loads(path.read_text())["cases"]:
            runs[(device, lanes, case["codec"])][which].append(case)
    rows = []
    for (device, lanes, codec), by in sorted(runs.items()):
        row: dict = {"device": device, "lanes": lanes, "codec": codec}
        for which in ("old", "new"):
            cases = by.get(which, [])
            row[f"{which}_gb_s"] = (
                statistics.median(c["goodput_mb_s"] / 1000 for c in cases) if cases else None
            )
            row[f"{which}_cpu_s_per_gb"] = (
                statistics.median(c["cpu_s_per_gb"] for c in cases) if cases else None
            )
            row[f"{which}_runs"] = len(cases)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = summarize(args.folder)
    if not rows:
        print(f"no results in {args.folder}", file=sys.stderr)
        return 1

    def cell(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    print("| device | lanes/site | codec | old GB/s | new GB/s | new/old | CPU s/GB old -> new |")
    print("| --- | ---: | --- | ---: | ---: | ---: | --- |")
    for r in rows:
        ratio = r["new_gb_s"] / r["old_gb_s"] if r["old_gb_s"] and r["new_gb_s"] else None
        print(
            f"| {r['device']} | {r['lanes']} | {r['codec']} | {cell(r['old_gb_s'], '.2f')} | "
            f"{cell(r['new_gb_s'], '.2f')} | {cell(ratio, '.2f')} | "
            f"{cell(r['old_cpu_s_per_gb'], '.2f')} -> {cell(r['new_cpu_s_per_gb'], '.2f')} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
