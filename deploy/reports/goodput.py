"""Goodput: committed tokens per second of the run, and where the rest of the time went.

A step's wall time is the slowest site's, on its own clock. The healthy
step is the median of the steps no fault touched (not the first, no retry, no site
admitted, checks left out); every step's time past it is lost, to one cause:

* start-up: the first step (compilation, connections, the first round's allocations);
* retries: a step whose rounds ran again (a site failed or fell silent: detection, the
  new generation, the rerun);
* rejoins: a step at which a site came back (admitted with a peer's state: its pull);
* stalls: any other step over ``STALL_FACTOR`` healthy steps (a stalled flow, a slow link,
  a paused host);
* checks: the digests and held-out evaluations, measured where they ran.

What is left over (small steps' noise over the median) is not attributed."""

from __future__ import annotations

import statistics

STALL_FACTOR = 1.5
"""A step slower than this many healthy steps, with no other cause, stalled."""
CAUSES = ("start-up", "retries", "rejoins", "stalls", "checks")


def step_walls(steps: list[dict]) -> list[float]:
    """Each merged step's wall time (seconds): the slowest site's own (``wall_s``; sites'
    clocks start apart, so the growth of the merged ``elapsed_s`` jumps where the
    slowest changes), else the growth of ``elapsed_s``."""
    ends = [r["elapsed_s"] for r in steps]
    grown = [end - start for start, end in zip([0.0, *ends], ends, strict=False)]
    return [r.get("wall_s", g) for r, g in zip(steps, grown, strict=True)]


def step_causes(steps: list[dict]) -> tuple[list[float], list[str | None], float]:
    """Each step's wall (``step_walls``), its cause of lost time (None: healthy), and the
    healthy step's seconds."""
    walls = step_walls(steps)
    work = [
        w - r.get("digest_s", 0.0) - r.get("eval_s", 0.0) for w, r in zip(walls, steps, strict=True)
    ]
    causes: list[str | None] = []
    for i, r in enumerate(steps):
        joined = i > 0 and r.get("live_sites", 1) > steps[i - 1].get("live_sites", 1)
        if i == 0:
            causes.append("start-up")
        elif r.get("retries"):
            causes.append("retries")
        elif joined or r.get("state_pull_s"):
            causes.append("rejoins")
        else:
            causes.append(None)
    plain = [w for w, cause in zip(work, causes, strict=True) if cause is None] or work
    healthy = statistics.median(plain) if plain else 0.0
    for i, cause in enumerate(causes):
        if cause is None and work[i] > STALL_FACTOR * healthy:
            causes[i] = "stalls"
    return walls, causes, healthy


def goodput(steps: list[dict]) -> dict:
    """summary.json's goodput: committed tokens per second of the whole run, the healthy
    step, the share of the run's time not lost, the seconds lost by cause, and the state
    pulled by sites that came back (seconds, bytes)."""
    if not steps:
        return {}
    walls, causes, healthy = step_causes(steps)
    lost = dict.fromkeys(CAUSES, 0.0)
    for wall, r, cause in zip(walls, steps, causes, strict=True):
        checks = r.get("digest_s", 0.0) + r.get("eval_s", 0.0)
        lost["checks"] += checks
        if cause is not None:
            lost[cause] += max(0.0, wall - checks - healthy)
    total = sum(walls)
    return {
        "goodput_tokens_per_s": sum(r["tokens"] for r in steps) / total if total else 0.0,
        "healthy_step_s": healthy,
        "goodput_share": 1 - sum(lost.values()) / total if total else 0.0,
        "lost_s": lost,
        "state_pulls": {
            "seconds": sum(r.get("state_pull_s", 0.0) for r in steps),
            "bytes": sum(r.get("state_pull_bytes", 0) for r in steps),
        },
    }


def goodput_rows(summary: dict) -> list[tuple[str, str]]:
    """The summary's lines of goodput (printed and report.txt)."""
    if "goodput_share" not in summary:
        return []
    lost = ", ".join(f"{c} {s:.1f} s" for c, s in summary["lost_s"].items() if s >= 0.05)
    pulls = summary["state_pulls"]
    return [
        (
            "goodput",
            f"{summary['goodput_tokens_per_s']:,.0f} committed tokens/s, "
            f"{summary['goodput_share']:.0%} of the run at the healthy step "
            f"({summary['healthy_step_s']:.3f} s)",
        ),
        ("time lost", lost or "none"),
        *(
            [("state pulled", f"{pulls['bytes'] / 1e6:,.1f} MB in {pulls['seconds']:.2f} s")]
            if pulls["bytes"]
            else []
        ),
    ]


def goodput_figure(steps: list[dict]):  # -> matplotlib Figure (imported by the caller)
    """goodput.png: each step's committed tokens per second over the run's time, the
    steps that lost time marked by their cause."""
    import matplotlib.pyplot as plt

    walls, causes, healthy = step_causes(steps)
    rate = [r["tokens"] / w if w > 0 else 0.0 for r, w in zip(steps, walls, strict=True)]
    at = [r["elapsed_s"] for r in steps]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(at, rate, color="#4477aa", linewidth=2, marker="o", label="committed tokens/s")
    for cause, color in zip(CAUSES[:-1], ("#999999", "#ee6677", "#228833", "#ccbb44"), strict=True):
        marked = [(t, v) for t, v, c in zip(at, rate, causes, strict=True) if c == cause]
        if marked:
            ax.scatter(*zip(*marked, strict=True), color=color, label=cause, zorder=3)
    if healthy > 0 and steps:
        pace = sum(r["tokens"] for r in steps) / len(steps) / healthy
        ax.axhline(pace, color="black", linestyle="--", label="healthy pace")
    ax.set(xlabel="seconds into the run", ylabel="tokens/s", title="Goodput", ylim=(0, None))
    ax.legend()
    return fig
