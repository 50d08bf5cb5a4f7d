"""Turn the ranks' per-site files into the run's metrics.jsonl and summary.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

from isthmus.deploy.config.job import JobConfig
from isthmus.deploy.reports.egress import egress_rows, egress_summary, step_egress
from isthmus.deploy.reports.goodput import goodput, goodput_rows
from isthmus.deploy.reports.links import link_rows, link_summary, merge_links


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    # A line being written right now may be incomplete; it is read next time.
    return [json.loads(line) for line in lines if line.endswith("}")]


class JsonlTail:
    """Reads the complete lines appended to a JSONL file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path, self._offset = path, 0

    def read_new(self) -> list[dict]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line being written is read next time
        self._offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


def _token_mean(rows: list[dict]) -> float:
    """The sites' losses averaged over their tokens: the loss of the global batch."""
    tokens = sum(r["tokens"] for r in rows)
    if len({r["tokens"] for r in rows}) == 1 or not tokens:  # (a script may count none)
        return sum(r["loss"] for r in rows) / len(rows)
    return sum(r["loss"] * r["tokens"] for r in rows) / tokens


def merge_steps(per_site: dict[str, list[dict]]) -> list[dict]:
    """One record per step that a site committed, of the sites that did (a site the job
    went on without is absent from the steps it missed): losses averaged, weighted by
    each site's tokens (sites of different sizes), bytes summed, times as the slowest
    site saw them."""
    by_step: dict[int, list[dict]] = {}
    walls: dict[int, list[float]] = {}  # each site's own time for the step, on its clock
    for lines in per_site.values():
        for prev, line in zip([None, *lines], lines, strict=False):
            by_step.setdefault(line["step"], []).append(line)
            if prev is None or prev["step"] == line["step"] - 1:  # not across a gap
                walls.setdefault(line["step"], []).append(
                    line["elapsed_s"] - (prev["elapsed_s"] if prev else 0.0)
                )
    merged = []
    for step, rows in sorted(by_step.items()):
        merged.append(
            {
                "step": rows[0]["step"],
                "loss": _token_mean(rows),
                "loss_by_site": {r["site"]: r["loss"] for r in rows},
                "grad_norm": rows[0]["grad_norm"],
                **{
                    key: sum(r[key] for r in rows) / len(rows)
                    for key in ("moe_aux_loss", "moe_load_ratio", "moe_dropped")
                    if all(key in r for r in rows)
                },
                "lr": rows[0]["lr"],
                "tokens": sum(r["tokens"] for r in rows),
                "compute_s": max(r["compute_s"] for r in rows),
                "cross_site_s": max(r["sync_s"] for r in rows),
                "cross_site_bytes": sum(r["bytes_sent"] for r in rows),
                "raw_bytes": sum(r["raw_bytes"] for r in rows),
                "corrupt_chunks": sum(r.get("corrupt_chunks", 0) for r in rows),
                "nonfinite_chunks": sum(r.get("nonfinite_chunks", 0) for r in rows),
                "stalled_flows": sum(r.get("stalled_flows", 0) for r in rows),
                "elapsed_s": max(r["elapsed_s"] for r in rows),
                "wall_s": max(walls.get(step, [0.0])),
                # The slowest site's wait bounds the job's step.
                "exposed_sync_s": max(r.get("exposed_sync_s", r["sync_s"]) for r in rows),
                "sync_busy_s": max(r.get("sync_busy_s", 0.0) for r in rows),
                "links": merge_links(rows),
                "egress": step_egress(rows),
                "digest_s": max(r.get("digest_s", 0.0) for r in rows),
                "mfu": sum(r.get("mfu", 0.0) for r in rows) / len(rows),
                "intra_site_s": max(r.get("intra_site_s", 0.0) for r in rows),
                "outer_steps": max(r.get("outer_steps", 0) for r in rows),
                "retries": max(r.get("retries", 0) for r in rows),
                "live_sites": max(r.get("live_sites", len(rows)) for r in rows),
                "state_pull_s": max(r.get("state_pull_s", 0.0) for r in rows),
                "state_pull_bytes": sum(r.get("state_pull_bytes", 0) for r in rows),
                "eval_s": max(r.get("eval_s", 0.0) for r in rows),
                **_held_out(rows),
                **_batch(rows),
                **_script(rows),
            }
        )
    return merged


def _script(rows: list[dict]) -> dict:
    """A script's own numbers (``ctx.step(accuracy=...)``, ``script/`` keys), averaged
    over the sites that wrote them, and each site's."""
    keys = sorted({k for r in rows for k in r if k.startswith("script/")})
    out: dict = {}
    for key in keys:
        by_site = {r["site"]: r[key] for r in rows if key in r}
        out[key] = sum(by_site.values()) / len(by_site)
        if len(rows) > 1:
            out[f"{key}_by_site"] = by_site
    return out


def _batch(rows: list[dict]) -> dict:
    """A step's global batch (sequences; the same at every site), each site's
    micro-batches per rank, and the gradient noise scale when it is estimated."""
    if not all("global_batch" in r for r in rows):
        return {}
    out = {
        "global_batch": rows[0]["global_batch"],
        "micro_batches_by_site": {r["site"]: r["micro_batches"] for r in rows},
    }
    if "noise_scale" in rows[0]:
        out["noise_scale"] = rows[0]["noise_scale"]
    return out


def _held_out(rows: list[dict]) -> dict:
    """A step's held-out loss: each site's, and their mean (they are equal: every site
    measures the same model on the same batches; summarize() checks it)."""
    by_site = {r["site"]: r["val_loss"] for r in rows if r.get("val_loss") is not None}
    if not by_site:
        return {}
    return {"val_loss": sum(by_site.values()) / len(by_site), "val_loss_by_site": by_site}


def overlap(exposed_s: float, busy_s: float) -> float | None:
    """Share of the cross-site sync hidden behind compute, 1 - exposed / busy; None when
    nothing was synchronised (one site)."""
    if busy_s <= 0:
        return None
    return min(1.0, max(0.0, 1.0 - exposed_s / busy_s))


def steady_state(steps: list[dict], skip: int) -> dict:
    """Throughput and per-step means over the steps after the first `skip`.

    The first steps compile kernels, warm up allocators and fill the links; the
    figures a run is compared by (benchmarks/scaling_curve.py) leave them out. The
    wall time is from the end of the last skipped step to the end of the run, less
    the time spent on parameter digests and held-out losses (checks, not training).
    With too few steps only the first is left out; without steps the dict is empty."""
    if not steps:
        return {}
    if skip >= len(steps):
        skip = min(1, len(steps) - 1)
    window = steps[skip:]
    start = steps[skip - 1]["elapsed_s"] if skip else 0.0
    checks = sum(r.get("digest_s", 0.0) + r.get("eval_s", 0.0) for r in window)
    wall = window[-1]["elapsed_s"] - start - checks
    n = len(window)
    return {
        "steady_steps": n,
        "steady_tokens_per_s": sum(r["tokens"] for r in window) / wall if wall > 0 else 0.0,
        "steady_step_s": wall / n,
        "mfu": sum(r["mfu"] for r in window) / n,
        "compute_s_per_step": sum(r["compute_s"] for r in window) / n,
        "exposed_sync_s_per_step": sum(r["exposed_sync_s"] for r in window) / n,
        "sync_busy_s_per_step": sum(r["sync_busy_s"] for r in window) / n,
    }


def summarize(
    config: JobConfig,
    run_dir: Path,
    sites: list[str] | None = None,
    host_agents: dict[str, dict[str, int]] | None = None,
    missing_ok: bool = False,
) -> dict:
    """Write the run's metrics.jsonl and summary.json; returns the summary.

    ``sites`` (one `isthmus site`) writes under run_dir/sites/SITE/ instead.
    ``missing_ok`` summarises the ranks whose results are there (a site on several nodes
    without a shared run folder); rank 0's must be. RuntimeError when a rank's result is
    missing, ranks of a site disagree, or a file cannot be written."""
    names = sites or config.site_names
    out_dir = run_dir / "sites" / names[0] if sites else run_dir
    per_site = {site: read_jsonl(run_dir / "sites" / site / "metrics.jsonl") for site in names}
    steps = merge_steps(per_site)
    if not sites:  # one site's own metrics.jsonl already is its record
        _write(run_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in steps))
    summary = _summary(config, steps, _rank_results(config, run_dir, names, missing_ok))
    if host_agents:
        summary["host_agents"] = host_agents
    _write(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def _rank_results(
    config: JobConfig, run_dir: Path, names: list[str], missing_ok: bool = False
) -> dict[str, list[dict]]:
    """Each site's ranks' results (rank{N}.json), in rank order; a missing one raises
    (but for rank 0's, only without ``missing_ok``)."""
    results: dict[str, list[dict]] = {}
    for site in names:
        for rank in range(config.ranks_of(site)):
            path = run_dir / "sites" / site / f"rank{rank}.json"
            if rank and missing_ok and not path.exists():
                continue
            if not path.exists():
                raise RuntimeError(f"{site} rank {rank} wrote no result ({path})")
            results.setdefault(site, []).append(json.loads(path.read_text()))
    return results


def _summary(config: JobConfig, steps: list[dict], results: dict[str, list[dict]]) -> dict:
    """summary.json's content, from the merged steps and the ranks' results; ranks of a
    site that disagree on the parameter digest raise."""
    digests = {}
    for site, ranks in results.items():
        if len({r["digest"] for r in ranks}) != 1:
            raise RuntimeError(f"ranks of {site} disagree on the parameter digest")
        digests[site] = ranks[0]["digest"]
    # The held-out loss: the last measured (after the last step), and whether every
    # site measured the same value every time.
    measured = [r for r in steps if "val_loss" in r]
    held_out = measured[-1] if measured else {}
    unequal = [r["step"] for r in measured if len(set(r["val_loss_by_site"].values())) > 1]
    train_s = max(r["train_s"] for ranks in results.values() for r in ranks)
    sent = sum(r["cross_site_bytes"] for r in steps)
    raw = sum(r["raw_bytes"] for r in steps)
    exposed = sum(r["exposed_sync_s"] for r in steps)
    busy = sum(r["sync_busy_s"] for r in steps)
    steady = steady_state(steps, config.run.steady_after)
    summary = {
        "sites": config.topology.sites,
        "ranks_per_site": config.topology.ranks_per_site,
        "steps": len(steps),
        "loss_first": steps[0]["loss"] if steps else None,
        "loss_last": steps[-1]["loss"] if steps else None,
        "tokens": sum(r["tokens"] for r in steps),
        # Over the whole run, start-up and compilation included; see steady_tokens_per_s.
        "tokens_per_s": sum(r["tokens"] for r in steps) / train_s if train_s else 0.0,
        "train_s": train_s,
        "compute_s": sum(r["compute_s"] for r in steps),
        # Seconds the steps waited for the cross-site sync (the trainer's measure of
        # exposed_sync_s, kept under its old name).
        "cross_site_s": sum(r["cross_site_s"] for r in steps),
        "exposed_sync_s": exposed,
        # Seconds the cross-site rounds ran, most of it behind backward.
        "sync_busy_s": busy,
        # Of the steady-state steps: 1 - exposed / busy.
        "overlap": overlap(
            steady.get("exposed_sync_s_per_step", exposed), steady.get("sync_busy_s_per_step", busy)
        ),
        "cross_site_bytes": sent,
        "raw_bytes": raw,
        "compression_ratio": raw / sent if sent else 1.0,
        "corrupt_chunks": sum(r["corrupt_chunks"] for r in steps),
        "nonfinite_chunks": sum(r.get("nonfinite_chunks", 0) for r in steps),
        "stalled_flows": sum(r.get("stalled_flows", 0) for r in steps),
        # Steady state: the steps after run.steady_after (steady_state()); "mfu" too.
        "steady_after": config.run.steady_after,
        "mfu": 0.0,
        **steady,
        "codec": config.sync.codec if config.topology.sites > 1 else "none",
        "sync_mode": config.sync.mode,
        # DiLoCo: the times the sites synced (0 in per-step sync, which syncs every step);
        # Streaming DiLoCo: the fragments' rounds.
        "outer_steps": steps[-1].get("outer_steps", 0) if steps else 0,
        "bytes_per_token": sent / tokens if (tokens := sum(r["tokens"] for r in steps)) else 0.0,
        "preset": config.model.preset,
        "batch_size": config.train.batch_size,
        "seq_len": config.train.seq_len,
        "val_loss": held_out.get("val_loss"),
        "val_losses": held_out.get("val_loss_by_site", {}),
        "val_step": held_out.get("step"),
        # Steps whose held-out loss differed between sites (never, unless replicas differ).
        "val_unequal_steps": unequal,
        **link_summary(steps, config.wan.bandwidth_mbit),
        **goodput(steps),
        **egress_summary(steps, config.wan),
        "digests": digests,
        "shard_digests": {
            site: [r["shard_digest"] for r in ranks] for site, ranks in results.items()
        },
    }
    return summary


def _write(path: Path, text: str) -> None:
    """Write a file of the run; a failure (a full disk) is one line naming the errno and
    the file, which a failed write() itself does not name."""
    try:
        path.write_text(text)
    except OSError as exc:
        from isthmus.intra.checkpoint_failures import describe_os_error  # torch: when it failed

        raise RuntimeError(describe_os_error(exc, path)) from None


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} GB"


def print_summary(summary: dict, out: TextIO, run_dir: Path | None) -> None:
    """The end-of-run table a user reads."""
    equal = len(set(summary["digests"].values())) == 1
    steady = summary.get("steady_steps", 0)
    rows = [
        ("steps", f"{summary['steps']}"),
        ("loss", f"{summary['loss_first']:.4f} -> {summary['loss_last']:.4f}"),
        (
            "tokens/s",
            f"{summary['tokens_per_s']:,.0f}"
            if summary.get("tokens") != 0
            else "- (no step counted its tokens: ctx.step(tokens=...))",
        ),
    ]
    if steady and steady < summary["steps"] and summary.get("tokens") != 0:
        rows.append(
            (
                "steady tokens/s",
                f"{summary['steady_tokens_per_s']:,.0f} "
                f"(last {steady} steps, {summary['steady_step_s']:.3f} s/step)",
            )
        )
    if summary["mfu"]:  # unknown (a script's model, a device of no known peak): left out
        rows.append(("MFU", f"{summary['mfu']:.1%}"))
    rows.append(("compute", f"{summary['compute_s']:.2f} s"))
    if summary["sites"] > 1:
        hidden = summary.get("overlap")
        rows += [
            (
                "cross-site sync",
                f"{summary['sync_busy_s']:.2f} s "
                f"({summary.get('sync_busy_s_per_step', 0.0):.3f} s/step in rounds)",
            ),
            (
                "exposed sync",
                f"{summary['exposed_sync_s']:.2f} s "
                f"({summary.get('exposed_sync_s_per_step', 0.0):.3f} s/step waited"
                + (f", {hidden:.0%} overlapped)" if hidden is not None else ")"),
            ),
        ]
    rows += link_rows(summary) + goodput_rows(summary) + egress_rows(summary)
    if summary.get("outer_steps"):
        if summary.get("sync_mode") == "streaming":
            rows.append(("sync", f"Streaming DiLoCo: {summary['outer_steps']} fragment rounds"))
        else:
            rows.append(("sync", f"DiLoCo: {summary['outer_steps']} outer steps"))
    rows += [
        ("bytes across sites", human_bytes(summary["cross_site_bytes"])),
        ("compression ratio", f"{summary['compression_ratio']:.3f} ({summary['codec']})"),
    ]
    if summary.get("val_loss") is not None:
        same = "every site" if not summary.get("val_unequal_steps") else "DIFFERS between sites"
        rows.append(
            (
                "held-out loss",
                f"{summary['val_loss']:.4f} after step {summary['val_step'] + 1} ({same})",
            )
        )
    rows += [(f"digest {site}", digest[:16]) for site, digest in summary["digests"].items()]
    rows.append(("replicas", "identical" if equal else "DIFFERENT"))
    if run_dir is not None:
        rows.append(("run dir", str(run_dir)))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}", file=out)
