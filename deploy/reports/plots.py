"""`isthmus report RUN_DIR`: plots and a short text summary of a finished run, next to its
files (or in --out): loss.png, step_time.png, wan_goodput.png, loss_vs_cost.png,
goodput.png (committed tokens/s over time, time lost by cause: goodput.py),
links.png (each link's rate and RTT, links.py), batch.png (only for a run whose batch
changed) and report.txt. Several runs are
overlaid instead (compare.py).
"""

from __future__ import annotations

import json
import sys
from itertools import accumulate
from pathlib import Path
from typing import Any

from isthmus.deploy.config.job import SECTION_TYPES, ConfigError
from isthmus.deploy.reports.egress import egress_rows
from isthmus.deploy.reports.goodput import goodput_figure, goodput_rows
from isthmus.deploy.reports.links import link_rows, links_figure, merge_links
from isthmus.deploy.reports.summary import human_bytes, read_jsonl

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, packaged as tomli
    import tomli as tomllib


def load_run(run_dir: Path) -> tuple[list[dict], dict, float]:
    """The merged per-step records, the summary and the link capacity (bits/s)."""
    if not run_dir.is_dir():
        raise ConfigError(f"run directory not found: {run_dir}")
    steps = read_jsonl(run_dir / "metrics.jsonl")
    summary_path = run_dir / "summary.json"
    config_file = run_dir / "config.toml"
    if not steps:  # one site of an `isthmus site` run
        sites = sorted((run_dir / "sites").glob("*/summary.json"))
        if not sites:
            raise ConfigError(
                f"{run_dir} holds no metrics.jsonl: is it a finished run's --run-dir?"
            )
        site_dir = sites[0].parent
        steps = [
            {**r, "cross_site_s": r["sync_s"], "cross_site_bytes": r["bytes_sent"]}
            for r in read_jsonl(site_dir / "metrics.jsonl")
        ]
        for r in steps:
            r["site_bytes"], r["links"] = r["bytes_sent"], merge_links([r])
        summary_path = site_dir / "summary.json"
        config_file = run_dir / f"config-{site_dir.name}.toml"
    if not summary_path.exists():
        raise ConfigError(f"{summary_path} is missing: the run did not finish")
    summary = json.loads(summary_path.read_text())
    for r in steps:
        # What one site sent: each direction of a link carries one site's bytes.
        r.setdefault("site_bytes", r["cross_site_bytes"] / summary["sites"])
    config = read_run_config(config_file)
    capacity = run_setting(config, "wan", "bandwidth_mbit") * 1e6 if config else 0.0
    return steps, summary, capacity


def read_run_config(path: Path) -> dict[str, dict]:
    """The tables of a run's resolved config.toml; empty when there is none.

    Read as plain TOML, not with load_config: a run written by another version of
    isthmus may hold keys this one no longer knows (or lack new ones), and a report of
    it needs only a few settings (run_setting).
    """
    if not path.exists():
        return {}
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None


def run_setting(config: dict[str, dict], section: str, key: str) -> Any:
    """SECTION.KEY of a run's config (read_run_config), or today's default where the
    run's config lacks it."""
    value = config.get(section, {}).get(key)
    return getattr(SECTION_TYPES[section](), key) if value is None else value


def write_report(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Draw the plots and write report.txt; returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    steps, summary, capacity = load_run(run_dir)
    out = out_dir or run_dir
    out.mkdir(parents=True, exist_ok=True)
    x = [s["step"] + 1 for s in steps]
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [s["loss"] for s in steps], label="mean over sites", linewidth=2)
    for site in sorted(steps[0].get("loss_by_site", {})):
        ax.plot(x, [s["loss_by_site"][site] for s in steps], label=site, alpha=0.5)
    ax.set(xlabel="step", ylabel="loss (nats per byte)", title="Training loss")
    ax.legend()
    written.append(save_figure(fig, out / "loss.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    compute = [s["compute_s"] - s.get("intra_site_s", 0.0) for s in steps]
    intra = [s.get("intra_site_s", 0.0) for s in steps]
    cross = [s["cross_site_s"] for s in steps]
    ax.bar(x, compute, label="compute", color="#4477aa")
    ax.bar(x, intra, bottom=compute, label="intra-site communication", color="#66ccee")
    ax.bar(
        x, cross, bottom=[a + b for a, b in zip(compute, intra, strict=True)],
        label="cross-site wait", color="#ee6677",
    )  # fmt: skip
    ax.set(xlabel="step", ylabel="seconds", title="Step time")
    ax.legend()
    written.append(save_figure(fig, out / "step_time.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    goodput = [
        s["site_bytes"] * 8 / s["sync_busy_s"] / 1e6 if s.get("sync_busy_s") else 0.0 for s in steps
    ]
    ax.plot(x, goodput, marker="o", label="one site's wire bits per second of sync")
    if capacity:
        ax.axhline(capacity / 1e6, color="black", linestyle="--", label="link capacity")
    ax.set(xlabel="step", ylabel="Mbit/s", title="WAN goodput", ylim=(0, None))
    ax.legend()
    written.append(save_figure(fig, out / "wan_goodput.png"))

    fig, (by_tokens, by_bytes) = plt.subplots(1, 2, figsize=(7, 4), sharey=True)
    losses = [s["loss"] for s in steps]
    by_tokens.plot(list(accumulate(s["tokens"] for s in steps)), losses, linewidth=2)
    by_tokens.set(xlabel="tokens trained", ylabel="loss (nats per byte)")
    by_bytes.plot(
        [b / 1e6 for b in accumulate(s["cross_site_bytes"] for s in steps)], losses, linewidth=2
    )
    by_bytes.set(xlabel="MB sent across sites")
    fig.suptitle("Training loss against what it cost")
    written.append(save_figure(fig, out / "loss_vs_cost.png"))

    if steps:
        written.append(save_figure(goodput_figure(steps), out / "goodput.png"))
    if (links := links_figure(steps, capacity / 1e6)) is not None:
        written.append(save_figure(links, out / "links.png"))
    if _batch_changed(steps):
        written.append(batch_figure(steps, out / "batch.png"))

    text = out / "report.txt"
    text.write_text(summary_text(steps, summary, capacity) + "\n")
    written.append(text)
    return written


def _batch_changed(steps: list[dict]) -> bool:
    """Whether the run's global batch or its split between sites ever changed."""
    seen = {
        (s.get("global_batch"), tuple(sorted(s.get("micro_batches_by_site", {}).items())))
        for s in steps
    }
    return len(seen) > 1 or any("noise_scale" in s for s in steps)


def batch_figure(steps: list[dict], path: Path) -> Path:
    """batch.png: the global batch (sequences), the noise scale where estimated, and
    the loss, per step; below, each site's micro-batches per rank."""
    import matplotlib.pyplot as plt

    x = [s["step"] + 1 for s in steps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.step(x, [s.get("global_batch", 0) for s in steps], where="post", linewidth=2,
             label="global batch", color="#4477aa")  # fmt: skip
    noisy = [(xi, s["noise_scale"]) for xi, s in zip(x, steps, strict=True) if "noise_scale" in s]
    if noisy:
        top.plot(*zip(*noisy, strict=True), linestyle="--", color="#228833",
                 label="gradient noise scale B_simple")  # fmt: skip
    top.set(ylabel="sequences", title="Global batch and loss", ylim=(0, None))
    top.legend(loc="upper left")
    loss = top.twinx()
    loss.plot(x, [s["loss"] for s in steps], color="#ee6677", alpha=0.6, label="loss")
    loss.set(ylabel="loss (nats per byte)")
    loss.legend(loc="upper right")
    for site in sorted(steps[0].get("micro_batches_by_site", {})):
        counts = [s.get("micro_batches_by_site", {}).get(site, 0) for s in steps]
        bottom.step(x, counts, where="post", label=site)
    bottom.set(xlabel="step", ylabel="micro-batches per rank", ylim=(0, None))
    bottom.legend()
    return save_figure(fig, path)


def save_figure(fig: Any, path: Path) -> Path:
    """Write a matplotlib figure as PNG and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def summary_text(steps: list[dict], summary: dict, capacity: float) -> str:
    """report.txt: the run in a few lines."""
    wall = sum(s["compute_s"] + s["cross_site_s"] for s in steps) or 1.0
    cross = sum(s["cross_site_s"] for s in steps)
    busy = [s for s in steps if s.get("sync_busy_s")]
    goodput = (
        sum(s["site_bytes"] for s in busy) * 8 / sum(s["sync_busy_s"] for s in busy)
        if busy
        else 0.0
    )
    lines = [
        f"{summary['steps']} steps, loss {summary['loss_first']:.4f} -> {summary['loss_last']:.4f}, "
        f"{summary['tokens_per_s']:,.0f} tokens/s",
        f"cross-site wait: {cross:.2f} s of {wall:.2f} s of steps ({cross / wall:.0%})",
    ]
    if summary.get("val_loss") is not None:
        lines.insert(1, f"held-out loss {summary['val_loss']:.4f} after the last step")
    if busy:
        ran = sum(s["sync_busy_s"] for s in busy)
        hidden = max(0.0, 1 - sum(s["cross_site_s"] for s in busy) / ran)
        lines.append(f"cross-site rounds ran {ran:.2f} s, {hidden:.0%} of it behind compute")
    tokens = sum(s["tokens"] for s in steps)
    per_token = f", {summary['cross_site_bytes'] / tokens:,.1f} per token" if tokens else ""
    lines += [
        f"bytes across sites: {human_bytes(summary['cross_site_bytes'])}{per_token}, "
        f"compression {summary['compression_ratio']:.3f}",
    ]
    outer = max((s.get("outer_steps", 0) for s in steps), default=0)
    if outer and summary.get("sync_mode") == "streaming":
        lines.append(f"Streaming DiLoCo: {outer} fragment rounds (the sites synced {outer} times)")
    elif outer:
        lines.append(f"DiLoCo outer steps: {outer} (the sites synced {outer} times)")
    if goodput:
        share = (
            f" = {goodput / capacity:.0%} of the {capacity / 1e6:,.0f} Mbit/s link"
            if capacity
            else ""
        )
        lines.append(f"WAN goodput while syncing: {goodput / 1e6:,.1f} Mbit/s{share}")
    more = link_rows(summary) + goodput_rows(summary) + egress_rows(summary)
    lines += [f"{name}: {value}" for name, value in more]
    identical = len(set(summary["digests"].values())) == 1
    lines.append(
        f"replicas: {'identical' if identical else 'DIFFERENT'} ({', '.join(summary['digests'])})"
    )
    return "\n".join(lines)
