"""`isthmus report RUN_A RUN_B ...`: several finished runs overlaid, and a table.

Writes to --out (default ./isthmus-compare):
    compare_loss_tokens.png  held-out loss (markers) and training loss (thin lines)
                             against tokens trained
    compare_loss_time.png    the same against wall seconds of training
    compare_bytes.png        bytes sent across sites, cumulative, against tokens
    compare.txt              one row per run; held-out loss relative to the first run

The first run is the baseline: what sync modes, codecs and layouts cost or save is read
against it. Every run is read (and every error raised) before anything is written.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

from isthmus.deploy.config.job import ConfigError
from isthmus.deploy.reports.plots import load_run, read_run_config, run_setting, save_figure
from isthmus.deploy.reports.summary import merge_steps, read_jsonl

DEFAULT_OUT = Path("isthmus-compare")
FINAL_WINDOW = 5
"""Steps whose training loss is averaged for the table's final training loss: one step's
loss is one batch's, noisy enough to reorder runs that train equally well."""
NO_HELD_OUT = "no held-out loss"


@dataclass(frozen=True, slots=True)
class ComparedRun:
    """One finished run as the comparison reads it."""

    run_dir: Path
    steps: list[dict]
    """Merged per-step records of every site the folder holds (summary.merge_steps)."""
    summary: dict
    config: dict[str, dict]
    """The tables of its resolved config.toml (report.read_run_config)."""
    held_out: list[tuple[int, float]]
    """(step, held-out loss) wherever it was measured; empty for runs from before it."""
    train_s: float
    """Wall seconds of training (summary.json's train_s; the slowest site's)."""
    only_site: str | None = None
    """An `isthmus site` folder holding fewer than all sites: the sites it holds."""

    def setting(self, section: str, key: str) -> Any:
        """SECTION.KEY of the run's config (today's default where it predates the key)."""
        return run_setting(self.config, section, key)

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.steps)

    @property
    def final_train_loss(self) -> float:
        window = self.steps[-FINAL_WINDOW:]
        return sum(s["loss"] for s in window) / len(window)

    @property
    def final_held_out(self) -> float | None:
        if self.held_out:
            return self.held_out[-1][1]
        return self.summary.get("val_loss")


def load_compared(run_dir: Path) -> ComparedRun:
    """Read one finished run (a `isthmus local` or `isthmus site` --run-dir)."""
    steps, summary, _ = load_run(run_dir)  # its errors are the one-run report's
    config_file = run_dir / "config.toml"
    train_s = summary.get("train_s", 0.0)
    only_site = None
    if not (run_dir / "metrics.jsonl").exists():
        # `isthmus site` writes sites/SITE/ only; merge every site that finished here,
        # so that tokens and bytes are the job's as in an `isthmus local` run.
        site_dirs = [p.parent for p in sorted((run_dir / "sites").glob("*/summary.json"))]
        steps = merge_steps({d.name: read_jsonl(d / "metrics.jsonl") for d in site_dirs})
        config_file = run_dir / f"config-{site_dirs[0].name}.toml"
        train_s = max(
            json.loads((d / "summary.json").read_text()).get("train_s", 0.0) for d in site_dirs
        )
        if len(site_dirs) < summary["sites"]:
            only_site = ", ".join(d.name for d in site_dirs)
    if not steps:
        raise ConfigError(f"{run_dir} recorded no steps")
    return ComparedRun(
        run_dir=run_dir,
        steps=steps,
        summary=summary,
        config=read_run_config(config_file),
        held_out=[(s["step"], s["val_loss"]) for s in steps if s.get("val_loss") is not None],
        train_s=train_s,
        only_site=only_site,
    )


def check_runs(run_dirs: list[Path], labels: list[str] | None) -> None:
    """The errors that need no file read: a run given twice, labels that do not fit."""
    seen: dict[Path, Path] = {}
    for run_dir in run_dirs:
        key = run_dir.resolve()
        if key in seen:
            raise ConfigError(f"run {run_dir} is given twice (as {seen[key]} too)")
        seen[key] = run_dir
    if labels is None:
        return
    if len(labels) != len(run_dirs):
        raise ConfigError(
            f"--labels names {len(labels)} run(s) but {len(run_dirs)} were given, "
            "one label per RUN_DIR in the same order"
        )
    if any(not label.strip() for label in labels) or len(set(labels)) != len(labels):
        raise ConfigError(f"--labels must be distinct and non-empty, got {labels}")


def default_labels(runs: list[ComparedRun]) -> list[str]:
    """What tells the runs apart: the sync mode, codec, sites x ranks and layout where
    they differ, else the folders' names."""
    parts = [_label_parts(run) for run in runs]
    differing = [key for key in parts[0] if len({p[key] for p in parts}) > 1]
    labels = [" ".join(p[key] for key in differing) for p in parts]
    if len(set(labels)) < len(labels) or not all(labels):
        named = [
            f"{label} {run.run_dir.name}".strip() for label, run in zip(labels, runs, strict=True)
        ]
        labels = named if len(set(named)) == len(named) else [str(r.run_dir) for r in runs]
    return labels


def _label_parts(run: ComparedRun) -> dict[str, str]:
    # In the order a label reads; only those that differ between the runs are kept.
    return {
        "mode": sync_name(run),
        "codec": codec_name(run),
        "size": f"{run.summary['sites']}x{run.summary['ranks_per_site']}",
        "layout": f"pp{run.setting('topology', 'pp')} tp{run.setting('topology', 'tp')}",
        "preset": f"{run.setting('model', 'preset')}",
        "link": f"{run.setting('wan', 'bandwidth_mbit'):g} Mbit/s "
        f"{run.setting('wan', 'distance_km'):g} km",
        "steps": f"{len(run.steps)} steps",
    }


def sync_name(run: ComparedRun) -> str:
    """The sync mode, with H (and P) for the outer modes."""
    mode = run.summary.get("sync_mode") or run.setting("sync", "mode")
    if mode == "step":
        return mode
    fragments = f" P={run.setting('sync', 'fragments')}" if mode == "streaming" else ""
    return f"{mode} H={run.setting('sync', 'inner_steps')}{fragments}"


def codec_name(run: ComparedRun) -> str:
    """The cross-site codec chain ("none" with one site)."""
    return run.summary.get("codec") or run.setting("sync", "codec")


def compare_table(runs: list[ComparedRun], labels: list[str]) -> str:
    """The comparison in words: one row per run, the first run the baseline."""
    base = runs[0].final_held_out
    header = [
        "run", "sync", "codec", "sites x ranks", "steps", "tokens",
        f"train loss (last {FINAL_WINDOW})", "held-out loss", "vs first",
        "bytes across/token", "wall s", "tokens/s",
    ]  # fmt: skip
    rows = []
    for run, label in zip(runs, labels, strict=True):
        held = run.final_held_out
        if held is None:
            held_cell, relative = NO_HELD_OUT, "-"
        else:
            held_cell = f"{held:.4f}"
            relative = f"{(held - base) / base:+.2%}" if base else "-"
        tokens = run.tokens
        sent = sum(s["cross_site_bytes"] for s in run.steps)
        rows.append(
            [
                label,
                sync_name(run),
                codec_name(run),
                f"{run.summary['sites']} x {run.summary['ranks_per_site']}",
                f"{len(run.steps)}",
                f"{tokens:,}",
                f"{run.final_train_loss:.4f}",
                held_cell,
                relative,
                f"{sent / tokens:,.1f}" if tokens else "-",
                f"{run.train_s:.1f}",
                f"{tokens / run.train_s:,.0f}" if run.train_s else "-",
            ]
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    left = 4  # the text columns; the numbers align right

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    lines = [line(header), line(["-" * w for w in widths]), *map(line, rows)]
    lines += [
        "",
        f"train loss: mean training loss (over sites) of the last {FINAL_WINDOW} steps",
        "held-out loss: the last measured (every run.eval_every steps and after the last)",
        f"vs first: held-out loss relative to the first run's ({labels[0]})",
        "bytes across/token: bytes sent between sites per token trained",
        "wall s: seconds of training, held-out evaluations included; tokens/s: tokens / wall s",
    ]
    for run, label in zip(runs, labels, strict=True):
        if run.only_site:
            lines.append(
                f"{label}: an `isthmus site` folder with only {run.only_site}'s records; "
                "its tokens, bytes and tokens/s are those sites' alone"
            )
    return "\n".join(lines)


def write_comparison(
    run_dirs: list[Path], out_dir: Path | None = None, labels: list[str] | None = None
) -> list[Path]:
    """Overlay the runs' curves (the first the baseline) and write compare.txt; returns
    the written paths. Nothing is written when a run is missing, unfinished or given
    twice, or the labels do not fit."""
    check_runs(run_dirs, labels)
    runs = [load_compared(run_dir) for run_dir in run_dirs]
    labels = labels or default_labels(runs)
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out = out_dir or DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    curves = [
        (label, colors[i % len(colors)], run, list(accumulate(s["tokens"] for s in run.steps)))
        for i, (label, run) in enumerate(zip(labels, runs, strict=True))
    ]
    written = []
    for name, xlabel, x_of in (
        ("compare_loss_tokens.png", "tokens trained", lambda run, tokens: tokens),
        ("compare_loss_time.png", "wall seconds", lambda run, _: [s["elapsed_s"] for s in run.steps]),
    ):  # fmt: skip
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for label, color, run, tokens in curves:
            x = x_of(run, tokens)
            ax.plot(x, [s["loss"] for s in run.steps], color=color, alpha=0.7, linewidth=1.5)
            ax.plot([], [], color=color, linewidth=2, label=label)  # one legend entry a run
            if run.held_out:
                at = [_index_of(run.steps, step) for step, _ in run.held_out]
                ax.plot(
                    [x[i] for i in at], [v for _, v in run.held_out],
                    color=color, marker="o", linewidth=2.5,
                )  # fmt: skip
        ax.plot([], [], color="gray", alpha=0.7, linewidth=1.5, label="training loss")
        if any(run.held_out for run in runs):
            ax.plot([], [], color="gray", marker="o", linewidth=2.5, label="held-out loss")
        ax.set(xlabel=xlabel, ylabel="loss (nats per byte)", title=f"Loss against {xlabel}")
        ax.legend(fontsize="small")
        written.append(save_figure(fig, out / name))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    totals = []
    for label, color, run, tokens in curves:
        sent = [b / 1e6 for b in accumulate(s["cross_site_bytes"] for s in run.steps)]
        ax.plot(tokens, sent, color=color, linewidth=2, label=label)
        totals.append(sent[-1])
    if min(totals) > 0 and max(totals) / min(totals) > 20:
        # Per-step sync next to DiLoCo: a factor of H or more apart. The steps before
        # DiLoCo's first round (nothing sent yet) are left out rather than drawn at 0.
        ax.set_yscale("log", nonpositive="mask")
    ax.set(xlabel="tokens trained", ylabel="MB sent across sites", title="Bytes across sites")
    ax.legend(fontsize="small")
    written.append(save_figure(fig, out / "compare_bytes.png"))

    text = out / "compare.txt"
    text.write_text(compare_table(runs, labels) + "\n")
    written.append(text)
    return written


def _index_of(steps: list[dict], step: int) -> int:
    """The record of `step`, or of the last step before it (an evaluation after the
    last step is drawn at the last step)."""
    return max(0, bisect_right([s["step"] for s in steps], step) - 1)
