"""What FSDP2 CPU offload (`parallel.offload`) costs and what it lets one site hold.

Runs benchmarks/site_step.py under torchrun for each case -- a model shape with and
without offload -- one after the other, each with its own time limit, and reports per
case: the parameters, whether it fit (a CUDA out-of-memory error is a result here, not
a failure), the median step time, tokens/s, the device's and the host's peak memory.
Prints a table and writes --json.

    python3 benchmarks/offload.py --gpus 1 --json runs/offload.json
    python3 benchmarks/offload.py --gpus 1 --case 1b:20 --case 1b:96   # preset:layers
    python3 benchmarks/offload.py --device cpu --gpus 2 --case tiny:2 --seq 64 --batch 2

A case is ``PRESET:LAYERS`` (the preset's shape with that many blocks: the 1b preset's
blocks are 51 M parameters each, so 1b:96 is 4.9 B); each runs without, then with,
offload. The default cases are the 1b preset itself (the cost on a model that fits
either way) and 1b:96, whose fp32 parameters, gradients and AdamW state (16 bytes a
parameter, 79 GB) do not fit an 80 GB GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import parser

SITE_STEP = Path(__file__).with_name("site_step.py")
DEFAULT_CASES = ["1b:20", "1b:96"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--case", action="append", default=[], help="PRESET:LAYERS (repeatable)")
    p.add_argument("--gpus", type=int, default=1, help="ranks of the site (devices)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq", type=int, default=2048, help="sequence length")
    p.add_argument("--steps", type=int, default=3, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per case")
    p.add_argument("--timeout", type=float, default=240, help="seconds one case may take")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    args.case = args.case or DEFAULT_CASES
    for case in args.case:
        preset, _, layers = case.partition(":")
        if not preset or not layers.isdigit() or int(layers) < 1:
            p.error(f"--case {case!r}: expected PRESET:LAYERS, e.g. 1b:96")
    return args


def run_case(args: argparse.Namespace, case: str, offload: bool) -> dict:
    preset, _, layers = case.partition(":")
    row: dict = {"case": case, "preset": preset, "layers": int(layers), "offload": offload}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            *("--nproc-per-node", str(args.gpus), str(SITE_STEP)),
            *("--preset", preset, "--layers", layers, "--device", args.device),
            *("--batch", str(args.batch), "--seq", str(args.seq), "--ac"),
            *("--warmup", str(args.warmup), "--steps", str(args.steps), "--profile-steps", "0"),
            *(["--offload"] if offload else []),
            *("--json", str(out)),
        ]
        started = time.monotonic()
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=args.timeout, check=False
            )
        except subprocess.TimeoutExpired:
            return row | {"fits": None, "error": f"timed out after {args.timeout:.0f}s"}
        row["wall_s"] = round(time.monotonic() - started, 1)
        if done.returncode == 0 and out.exists():
            result = json.loads(out.read_text())
            kept = ["params", "step_s", "tokens_per_s", "mfu", "loss_last"]
            kept += ["max_memory_gib", "host_peak_gib", "device"]
            return row | {"fits": True} | {k: result[k] for k in kept}
        oom = "out of memory" in done.stderr.lower() or "OutOfMemoryError" in done.stderr
        if not oom and args.json:
            # The whole of it beside the JSON: a worker that dies once in a while (a
            # SIGABRT 3 s in, once in 2026-11) must leave more than torchrun's summary.
            log = args.json.with_name(f"{args.json.stem}-{preset}-{layers}-offload-{offload}.log")
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(done.stdout + done.stderr)
        return row | {"fits": False if oom else None, "error": failure_of(done.stderr)}


WORKER_FAILURES = ("terminate called", "what():", "Traceback", "Error:", "Fatal Python error")
"""The first lines a dying worker writes, before torchrun's summary buries them."""


def failure_of(stderr: str) -> str:
    """The worker's own first error line (a C++ abort, a Python exception) and the last
    lines of stderr (torchrun's summary: which rank, which signal), at most 600 chars."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    first = next((line for line in lines if any(m in line for m in WORKER_FAILURES)), "")
    tail = " | ".join(lines[-3:])
    return (f"{first[:300]} || {tail}" if first else tail)[-600:]


def table(rows: list[dict]) -> str:
    head = (
        f"{'case':<8} {'offload':>7} {'params':>8} {'fits':>5} {'step s':>7} "
        f"{'tokens/s':>9} {'MFU':>6} {'device GiB':>10} {'host GiB':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if not r.get("fits"):
            why = "out of memory" if r.get("fits") is False else r.get("error", "")[:60]
            lines.append(f"{r['case']:<8} {str(r['offload']):>7} {'':>8} {'no':>5}  {why}")
            continue
        mem = r["max_memory_gib"]
        lines.append(
            f"{r['case']:<8} {str(r['offload']):>7} {r['params'] / 1e9:>7.2f}B {'yes':>5} "
            f"{r['step_s']:>7.2f} {r['tokens_per_s']:>9.0f} {r['mfu']:>6.1%} "
            f"{'-' if mem is None else f'{mem:.1f}':>10} {r['host_peak_gib']:>8.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    for case in args.case:
        for offload in (False, True):
            row = run_case(args, case, offload)
            print(f"[{case} offload={offload}] {json.dumps(row)}", file=sys.stderr, flush=True)
            rows.append(row)
    print(table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "command": " ".join(["offload.py", *(argv or sys.argv[1:])]),
                    "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
                    "date": time.strftime("%Y-%m-%d"),
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )
    # A case that neither fit nor ran out of memory is a broken run.
    return 0 if all(r.get("fits") is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
