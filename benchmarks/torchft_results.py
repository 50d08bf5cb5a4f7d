"""Results of benchmarks/torchft_diloco.py: each side's figures from its runs, the
runs combined, and the printed table."""

from __future__ import annotations

import statistics


def outer_sync_times(result: dict) -> list[float]:
    """Seconds each outer step spent syncing (quorum + all-reduce + commit + outer step)."""
    ph = result["phases"]
    return [
        q + a + b for q, a, b in zip(ph["quorum_s"], ph["prepare_s"], ph["perform_s"], strict=True)
    ]


def summarize_side(per_site: dict, wall: float, crossed: int, args, extra: dict) -> dict:
    """Outer-step times, losses and digests of one side, from each site's per-step records."""
    h = args.inner_steps
    outer_walls: list[float] = []  # per outer step: the slower site's time for its H steps
    sync: list[float] = []  # the site that waited longest (includes waiting for the other)
    sync_last: list[float] = []  # the site that arrived last: the sync's own cost
    for k in range(args.steps // h):
        ends = []
        for s in per_site.values():
            el = {r["step"]: r["elapsed_s"] for r in s["steps"]}
            begin = el.get(k * h - 1, 0.0)
            ends.append(el[(k + 1) * h - 1] - begin)
        outer_walls.append(max(ends))
        times = [s["sync_s"][k] for s in per_site.values() if k < len(s["sync_s"])]
        sync.append(max(times))
        sync_last.append(min(times))
    steady = outer_walls[1:] or outer_walls
    steady_sync = sync[1:] or sync
    steady_last = sync_last[1:] or sync_last
    inner = [
        t for s in per_site.values() for i, t in enumerate(step_times(s["steps"])) if (i + 1) % h
    ]
    w = args.loss_window
    losses = [r["loss"] for s in per_site.values() for r in s["steps"][-w:]]
    digests = {name: s["digest"] for name, s in per_site.items()}
    return {
        "outer_steps": len(outer_walls),
        "outer_step_s": outer_walls,
        "outer_step_median_s": statistics.median(steady),
        "sync_s": sync,
        "sync_median_s": statistics.median(steady_sync),
        "sync_last_s": sync_last,
        "sync_last_median_s": statistics.median(steady_last),
        "inner_step_median_s": statistics.median(inner),
        "train_wall_s": max(s["steps"][-1]["elapsed_s"] for s in per_site.values()),
        "total_wall_s": wall,
        "final_loss": statistics.fmean(losses),
        "first_loss": statistics.fmean(s["steps"][0]["loss"] for s in per_site.values()),
        "loss_curve": {
            name: [round(r["loss"], 4) for r in s["steps"]] for name, s in per_site.items()
        },
        "step_s": {name: step_times(s["steps"]) for name, s in per_site.items()},
        "link_bytes": crossed,
        "digests": digests,
        "replicas_equal": len(set(digests.values())) == 1,
        "outer_steps_committed": min(s["committed"] for s in per_site.values()),
        **extra,
    }


def combine(runs: list[dict]) -> dict:
    """One side's repeated runs: medians over every run's outer steps after its first."""
    first = runs[0]
    steady = [t for r in runs for t in r["outer_step_s"][1:] or r["outer_step_s"]]
    sync = [t for r in runs for t in r["sync_s"][1:] or r["sync_s"]]
    last = [t for r in runs for t in r["sync_last_s"][1:] or r["sync_last_s"]]
    return {
        **first,
        "outer_step_median_s": statistics.median(steady),
        "sync_median_s": statistics.median(sync),
        "sync_last_median_s": statistics.median(last),
        "inner_step_median_s": statistics.median(r["inner_step_median_s"] for r in runs),
        "train_wall_s": statistics.median(r["train_wall_s"] for r in runs),
        "total_wall_s": statistics.median(r["total_wall_s"] for r in runs),
        "link_bytes": statistics.median(r["link_bytes"] for r in runs),
        "replicas_equal": all(r["replicas_equal"] for r in runs),
        "outer_steps_committed": min(r["outer_steps_committed"] for r in runs),
        "runs_identical": len({tuple(sorted(r["digests"].values())) for r in runs}) == 1,
        "runs": runs,
    }


def step_times(steps: list[dict]) -> list[float]:
    """Wall seconds of each step (sync included), from the cumulative elapsed times."""
    out, last = [], 0.0
    for r in steps:
        out.append(round(r["elapsed_s"] - last, 4))
        last = r["elapsed_s"]
    return out


def print_table(result: dict) -> None:
    t, i = result["torchft"], result["isthmus"]
    rows = [
        ("outer step, median s", "outer_step_median_s", "{:.2f}"),
        ("  sync, longest wait, median s", "sync_median_s", "{:.3f}"),
        ("  sync, last to arrive, median s", "sync_last_median_s", "{:.3f}"),
        ("inner step, median s", "inner_step_median_s", "{:.3f}"),
        ("training loop s", "train_wall_s", "{:.1f}"),
        ("total wall s (launch..exit)", "total_wall_s", "{:.1f}"),
        ("loss, first step", "first_loss", "{:.4f}"),
        (f"loss, last {result['loss_window']} steps", "final_loss", "{:.4f}"),
        ("bytes over the link, MB", "link_bytes", None),
        ("outer steps committed", "outer_steps_committed", "{}"),
        ("replicas equal at the end", "replicas_equal", None),
    ]
    print(
        f"2 replica groups x 1 rank, {result['distance_km']:g} km "
        f"({result['one_way_latency_s'] * 1e3:.2f} ms one way), {result['bandwidth_mbit']:g} Mbit/s, "
        f"{result['steps']} steps, H={result['inner_steps']}, model {result['preset']}, "
        f"{result['repeats']} run(s) per side"
    )
    print(f"{'':34} {'torchft 0.2':>14} {'isthmus':>14}")
    for label, key, fmt in rows:
        cells = []
        for side in (t, i):
            v = side[key]
            if key == "link_bytes":
                cells.append(f"{v / 1e6:.1f}")
            elif fmt is None:
                cells.append("yes" if v else "NO")
            else:
                cells.append(fmt.format(v))
        print(f"{label:34} {cells[0]:>14} {cells[1]:>14}")
    same = "yes" if result["same_parameters"] else "no"
    print(f"final parameters equal across the two sides (sha256): {same}")
