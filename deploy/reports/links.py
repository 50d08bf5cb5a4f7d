"""The links watched live (issue 61, docs/measure.md "Links, live"): each step's links from
every site's metrics line, the run's figures per link, the straggler rule, links.png."""

from __future__ import annotations

import statistics
from typing import Any

STRAGGLER_SHARE = 0.8
"""A link is named a straggler when its achieved rate over the run is below this share of
the median of the other links' rates."""


def merge_links(rows: list[dict]) -> dict[str, dict]:
    """A step's links, named "sender->receiver": each site's line holds what its own
    lane sent (each direction is watched by its sender); the per-flow lists stay there."""
    return {
        f"{r['site']}->{peer}": {k: v for k, v in figures.items() if k != "per_flow"}
        for r in rows
        for peer, figures in r.get("links", {}).items()
    }


def link_totals(steps: list[dict], line_mbit: float) -> dict[str, dict]:
    """Each link over the run: bytes, seconds on the wire, achieved rate (bytes over the
    time on the wire), its share of ``line_mbit``, mean RTT, least RTT, retransmits;
    None where the lane had no sockets (gRPC)."""
    runs: dict[str, list[dict]] = {}
    for step in steps:
        for name, figures in step.get("links", {}).items():
            runs.setdefault(name, []).append(figures)
    totals = {}
    for name, seen in runs.items():
        bulk = [f for f in seen if f.get("bytes") is not None]
        moved, wire_s = sum(f["bytes"] for f in bulk), sum(f["wire_s"] for f in bulk)
        gbit = moved * 8 / wire_s / 1e9 if wire_s > 0 and moved else None
        rtts = [f["rtt_ms"] for f in bulk if f.get("rtt_ms") is not None]
        mins = [f["min_rtt_ms"] for f in bulk if f.get("min_rtt_ms") is not None]
        totals[name] = {
            "transport": seen[-1]["transport"],
            "bytes": moved if bulk else None,
            "wire_s": wire_s if bulk else None,
            "gbit_s": gbit,
            "line_share": gbit * 1e3 / line_mbit if gbit is not None and line_mbit else None,
            "rtt_ms": sum(rtts) / len(rtts) if rtts else None,
            "min_rtt_ms": min(mins, default=None),
            "retrans": sum(f.get("retrans") or 0 for f in bulk) if bulk else None,
        }
    return totals


def straggler(rates: dict[str, float]) -> tuple[str | None, str | None, float | None]:
    """(the straggling link or None, the slowest link, its rate over the median of the
    others'): the slowest is a straggler below :data:`STRAGGLER_SHARE`; with fewer than
    two links there is none to compare."""
    if len(rates) < 2:
        return None, None, None
    slowest = min(rates, key=rates.__getitem__)
    median = statistics.median(v for k, v in rates.items() if k != slowest)
    share = rates[slowest] / median if median > 0 else 1.0
    return (slowest if share < STRAGGLER_SHARE else None), slowest, share


def link_summary(steps: list[dict], line_mbit: float) -> dict:
    """summary.json's ``links`` (link_totals) and ``straggler``."""
    totals = link_totals(steps, line_mbit)
    rates = {n: t["gbit_s"] for n, t in totals.items() if t["gbit_s"] is not None}
    named, slowest, share = straggler(rates)
    rule = f"the slowest link, if under {STRAGGLER_SHARE:.0%} of the others' median rate"
    verdict = {"link": named, "slowest": slowest, "of_median": share, "rule": rule}
    return {"links": totals, "straggler": verdict} if totals else {}


def link_rows(summary: dict) -> list[tuple[str, str]]:
    """The summary's lines of each link and of the straggler (printed and report.txt)."""
    rows = []
    for name, t in summary.get("links", {}).items():
        if t["gbit_s"] is None:
            rows.append((f"link {name}", f"{t['transport']}: no socket figures"))
            continue
        share = f" ({t['line_share']:.0%} of line rate)" if t["line_share"] is not None else ""
        rtt = f", RTT {t['rtt_ms']:.2f} ms" if t["rtt_ms"] is not None else ""
        retrans = t["retrans"] if t["retrans"] is not None else "-"
        rows.append(
            (f"link {name}", f"{t['gbit_s']:.3f} Gbit/s{share}{rtt}, {retrans} retransmits")
        )
    verdict = summary.get("straggler", {})
    if verdict.get("slowest"):
        slowest = f"{verdict['slowest']} at {verdict['of_median']:.0%} of the others' median"
        named = verdict["link"]
        rows.append(("straggler", f"{named} ({slowest})" if named else f"none (slowest {slowest})"))
    return rows


def links_figure(steps: list[dict], line_mbit: float) -> Any:
    """links.png's figure: each link's achieved rate and RTT per step; None without
    socket figures."""
    names = sorted({n for s in steps for n, f in s.get("links", {}).items() if f.get("bytes")})
    if not names:
        return None
    import matplotlib.pyplot as plt

    fig, (rate, rtt) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for name in names:
        seen = [(s["step"] + 1, s["links"][name]) for s in steps if name in s.get("links", {})]
        for ax, key in ((rate, "gbit_s"), (rtt, "rtt_ms")):
            points = [(x, f[key]) for x, f in seen if f.get(key) is not None]
            ax.plot([x for x, _ in points], [v for _, v in points], marker="o", label=name)
    if line_mbit:
        rate.axhline(line_mbit / 1e3, color="black", linestyle="--", label="line rate")
    rate.set(ylabel="Gbit/s on the wire", title="Links, as their senders saw them", ylim=(0, None))
    rtt.set(xlabel="step", ylabel="smoothed RTT (ms)", ylim=(0, None))
    rate.legend()
    rtt.legend()
    return fig
