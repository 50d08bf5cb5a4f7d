"""The noise-scale batch controller against fixed batches at equal tokens (issue 15).

Runs one job with `train.batch_schedule=noise` (the batch grown toward the gradient
noise scale, from --start micro-batches up to train.accumulate's total), then the same
job with the batch fixed at its smallest size, at its mean (about as many steps as the
adaptive run) and at its largest, each for as many steps as trains the tokens the
adaptive run trained. Prints each run's held-out loss
at the end and writes the batch the controller picked over time next to the losses
(OUT/adaptive_batch.png) and OUT/adaptive_batch.json (or --json).

    python3 benchmarks/adaptive_batch.py --out runs/adaptive --steps 300 \\
        --set model.preset=tiny --set train.seq_len=64

Two sites of one rank; a micro-batch is --batch-size sequences.
"""

from __future__ import annotations

import argparse
import json
import sys
from itertools import accumulate
from pathlib import Path

from _common import add_run_arguments, parser, stamped, write_json
from unequal_sites import run_once


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, "run directories and results")
    p.add_argument("--steps", type=int, default=300, help="steps of the adaptive run")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--accumulate", type=int, default=8, help="micro-batches per site at most")
    p.add_argument("--start", type=int, default=2, help="global micro-batches at step 0")
    p.add_argument("--every", type=int, default=5, help="steps between decisions")
    add_run_arguments(p, "adaptive_batch", 1800, "passed to every run (model, seq_len, lr, ...)")
    return p.parse_args(argv)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _run(args: argparse.Namespace, name: str, steps: int, settings: list[str]) -> dict:
    one = argparse.Namespace(**vars(args))
    one.steps, one.warmup = steps, 0
    one.overrides = [*args.overrides, f"train.batch_size={args.batch_size}", *settings]
    summary = run_once(one, name, "1,1", {})
    records = _records(args.out / name)
    return {
        "steps": steps,
        "tokens": sum(r["tokens"] for r in records),
        "val_loss": summary.get("val_loss"),
        "loss_last10": sum(r["loss"] for r in records[-10:]) / min(10, len(records)),
        "records": records,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not 2 <= args.start < 2 * args.accumulate:
        print(f"error: --start must lie in [2, {2 * args.accumulate})", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    noise = _run(args, "noise", args.steps, [
        f"train.accumulate={args.accumulate}", "train.batch_schedule=noise",
        f"train.batch_start={args.start}", f"train.balance_every={args.every}",
    ])  # fmt: skip
    tokens = noise["tokens"]
    per_unit = noise["records"][0]["tokens"] // (noise["records"][0]["global_batch"])
    runs = {"noise": noise}
    # The adaptive run's mean batch, fixed: as many steps and tokens, the batch constant.
    mean = max(2, round(tokens / (per_unit * args.batch_size * args.steps)))
    for name, units in (
        ("fixed-small", args.start),
        ("fixed-mean", mean),
        ("fixed-large", 2 * args.accumulate),
    ):
        steps = max(1, round(tokens / (per_unit * args.batch_size * units)))
        split = f"train.accumulate=[{-(-units // 2)}, {units // 2}]"
        runs[name] = _run(args, name, steps, [split])
    print(f"{'run':<12} {'steps':>6} {'tokens':>12} {'batch (sequences)':>18} {'held-out':>9}")
    for name, run in runs.items():
        batches = [r["global_batch"] for r in run["records"]]
        shown = f"{batches[0]} -> {batches[-1]}" if batches[0] != batches[-1] else str(batches[0])
        val = f"{run['val_loss']:.4f}" if run["val_loss"] is not None else "-"
        print(f"{name:<12} {run['steps']:>6} {run['tokens']:>12,} {shown:>18} {val:>9}")
    _plot(runs, args.out / "adaptive_batch.png")
    result = {
        "overrides": args.overrides,
        "batch_size": args.batch_size,
        "runs": {
            name: {
                **{k: v for k, v in run.items() if k != "records"},
                "global_batch": [r["global_batch"] for r in run["records"]],
                "noise_scale": [r.get("noise_scale") for r in run["records"]],
                "loss": [r["loss"] for r in run["records"]],
            }
            for name, run in runs.items()
        },
    }
    write_json(args.json or args.out / "adaptive_batch.json", stamped(result))
    return 0


def _plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss, batch) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for name, run in runs.items():
        x = [t / 1e6 for t in accumulate(r["tokens"] for r in run["records"])]
        smooth = [sum(w) / len(w) for w in _windows([r["loss"] for r in run["records"]], 10)]
        loss.plot(x, smooth, label=name)
        batch.step(x, [r["global_batch"] for r in run["records"]], where="post", label=name)
    noisy = [
        (t / 1e6, r["noise_scale"])
        for t, r in zip(accumulate(r["tokens"] for r in runs["noise"]["records"]),
                        runs["noise"]["records"], strict=True)
        if r.get("noise_scale")
    ]  # fmt: skip
    if noisy:
        batch.plot(*zip(*noisy, strict=True), linestyle="--", color="gray",
                   label="noise scale B_simple")  # fmt: skip
    loss.set(ylabel="training loss (mean of 10 steps)", title="Adaptive batch at equal tokens")
    loss.legend()
    batch.set(xlabel="million tokens trained", ylabel="global batch (sequences)", ylim=(0, None))
    batch.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _windows(values: list[float], n: int) -> list[list[float]]:
    return [values[max(0, i - n + 1) : i + 1] for i in range(len(values))]


if __name__ == "__main__":
    sys.exit(main())
