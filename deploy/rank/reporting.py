"""What a rank tells the world after each step: the site's metrics.jsonl line
(rank 0) and a progress report to the site's coordinator, which feeds Prometheus
and compares parameter digests across sites (docs/design.md invariant 1)."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import grpc

from isthmus.inter.control.coordinator_client import CoordinatorClient, Progress
from isthmus.inter.security import SiteSecurity

log = logging.getLogger(__name__)
REPORT_TIMEOUT_S = 5.0
START_POLL_S = 0.1
"""How often a rank asks whether every site reported its starting parameters: peers'
digests come with heartbeats (1 s apart by default), so this adds no heartbeat's wait."""


class DivergenceError(RuntimeError):
    """Sites hold different parameters after the same step."""


class StepReporter:
    """Rank 0's per-step metrics file, the run's totals, and coordinator reports
    (``metrics_path`` None on other ranks, ``coordinator`` "" for none)."""

    def __init__(
        self,
        site: str,
        metrics_path: Path | None,
        coordinator: str,
        tensorboard_dir: Path | None = None,
        security: SiteSecurity | None = None,
    ) -> None:
        self.site = site
        self.file = metrics_path.open("w") if metrics_path else None
        self.board = open_tensorboard(tensorboard_dir) if metrics_path and tensorboard_dir else None
        seconds = ("compute_s", "sync_s", "exposed_sync_s", "sync_busy_s")
        counts = ("bytes_sent", "raw_bytes", "corrupt_chunks", "nonfinite_chunks", "stalled_flows")
        self.totals = {**dict.fromkeys(seconds, 0.0), **dict.fromkeys(counts, 0)}
        reports = bool(coordinator and metrics_path)  # rank 0 of a site with a coordinator
        self._coordinator = CoordinatorClient.connect(coordinator, security) if reports else None
        self.started = time.perf_counter()

    def record(self, line: dict, *, digest: str = "", finished: bool = False) -> None:
        """Write one step's line and report it (with the site's parameter digest, if
        computed); raises DivergenceError if sites differ."""
        for key in self.totals:
            self.totals[key] += line.get(key, 0)
        if self.file is None:
            return
        self.file.write(json.dumps({**line, **({"digest": digest} if digest else {})}) + "\n")
        self.file.flush()
        if self.board is not None:
            write_scalars(self.board, line)
        if self._coordinator is None:
            return
        progress = Progress(
            site=self.site,
            step=line["step"] + 1,
            loss=line["loss"],
            step_s=line["compute_s"] + line["sync_s"],
            compute_s=line["compute_s"],
            # isthmus_cross_site_seconds: what the step waited, i.e. the exposed sync.
            cross_site_s=line["sync_s"],
            tokens=line["tokens"],
            cross_site_bytes=line["bytes_sent"],
            raw_bytes=line["raw_bytes"],
            mfu=line.get("mfu", 0.0),
            sync_busy_s=line.get("sync_busy_s", 0.0),
            digest=digest,
            digest_step=line["step"] + 1 if digest else 0,
            # Prometheus takes finite numbers only; metrics.jsonl keeps every one.
            script_metrics={
                k.removeprefix("script/"): v
                for k, v in line.items()
                if k.startswith("script/") and math.isfinite(v)
            },
            finished=finished,
        )
        for peer, link in line.get("links", {}).items():
            if link["bytes"] is not None:  # a gRPC lane has no socket figures
                progress.links.add(**prometheus_link(peer, link))
        self._report(progress)

    def check_start(self, digest: str, layout: str, *, wait_s: float) -> None:
        """Before step 0 of a fresh job: the parameters this site starts from (their
        digest, and their names, shapes and dtypes), compared across sites as any step's
        digest; waits until every member site reported the same. A site that built or
        seeded its model otherwise stops the job at every site before it trains, in one
        line naming the first differing parameter when the models differ (issue 60)."""
        if self._coordinator is None:
            return
        start = Progress(site=self.site, step=0, digest=digest, model_layout=layout)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                divergence, agreed = self._coordinator.report(start, timeout_s=REPORT_TIMEOUT_S)
            except grpc.RpcError as exc:
                log.warning("start check with the coordinator failed: %s", exc.code().name)
                return  # the digests of later steps are still compared
            if divergence:
                raise DivergenceError(divergence)
            if agreed:
                return
            if time.monotonic() > deadline:
                log.warning(
                    "the other sites' starting parameters were not heard of within %.0f s; "
                    "training goes on, and their digests are compared at later steps",
                    wait_s,
                )
                return
            time.sleep(START_POLL_S)

    def report_final_digest(self, steps: int, digest: str) -> None:
        """For a site that joined with the state after the job's last step (admitted at
        its last commit: nothing left to train): give the coordinator the final digest
        that the other sites wait for. Writes no metrics line: no step ran here."""
        if self._coordinator is None:
            return
        self._report(
            Progress(site=self.site, step=steps, digest=digest, digest_step=steps, finished=True)
        )

    def register_alone(self, rank: int, world_size: int, fingerprint: dict[str, str]) -> None:
        """In a job of one site (no lanes, no cross-site registration): register this
        rank's key, without which the coordinator refuses its progress reports."""
        if self._coordinator is None:
            return
        self._coordinator.register_rank(
            site=self.site,
            rank=rank,
            world_size=world_size,
            lane_address="",
            fingerprint=fingerprint,
            timeout_s=REPORT_TIMEOUT_S,
        )

    def _report(self, progress: Progress) -> None:
        assert self._coordinator is not None
        try:
            # With the rank's key: the coordinator takes its site's digest from its ranks.
            divergence = self._coordinator.report_progress(progress, timeout_s=REPORT_TIMEOUT_S)
        except grpc.RpcError as exc:
            # Metrics are best effort: training goes on without its dashboard.
            log.warning("progress report to the coordinator failed: %s", exc.code().name)
            return
        if divergence:
            raise DivergenceError(divergence)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.board is not None:
            self.board.close()
        if self._coordinator is not None:
            self._coordinator.close()


def prometheus_link(peer: str, link: dict) -> dict:
    """A metrics line's link as ``LinkFigures``' fields (SI units; None as 0)."""
    ms = {"rtt_s": link["rtt_ms"], "min_rtt_s": link["min_rtt_ms"]}
    return {
        "peer": peer,
        "bytes": link["bytes"],
        "wire_s": link["wire_s"],
        "rate_bps": (link["gbit_s"] or 0.0) * 1e9,
        "line_share": link.get("line_share") or 0.0,
        **{key: (value or 0.0) / 1e3 for key, value in ms.items()},
        "cwnd_bytes": link["cwnd_bytes"] or 0,
        "retransmits": link["retrans"] or 0,
    }


def open_tensorboard(path: Path):
    """A SummaryWriter for the site's event files, or None (with a warning) when the
    tensorboard package is not installed: training does not depend on it."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning(
            "tensorboard is not installed; run.tensorboard is ignored (pip install tensorboard)"
        )
        return None
    return SummaryWriter(log_dir=str(path))


def write_scalars(board, line: dict) -> None:
    """One step's numbers as TensorBoard scalars, named like the Prometheus metrics."""
    step = line["step"] + 1
    step_s = line["compute_s"] + line["sync_s"]
    scalars = {
        "train/loss": line["loss"],
        "train/grad_norm": line["grad_norm"],
        "train/lr": line["lr"],
        "time/step_seconds": step_s,
        "time/compute_seconds": line["compute_s"],
        "time/cross_site_seconds": line["sync_s"],
        "time/exposed_sync_seconds": line.get("exposed_sync_s", line["sync_s"]),
        "time/sync_busy_seconds": line.get("sync_busy_s", 0.0),
        "throughput/tokens_per_second": line["tokens"] / step_s if step_s else 0.0,
        "wan/cross_site_bytes": line["bytes_sent"],
    }
    for key in ("moe_aux_loss", "moe_load_ratio", "moe_dropped"):
        if key in line:
            scalars[f"train/{key}"] = line[key]
    if line["bytes_sent"]:
        scalars["wan/compression_ratio"] = line["raw_bytes"] / line["bytes_sent"]
    if line.get("mfu"):
        scalars["throughput/mfu"] = line["mfu"]
    if line.get("val_loss") is not None:
        scalars["eval/val_loss"] = line["val_loss"]
    if line.get("sync_busy_s"):
        # Share of the rounds hidden behind compute (summary.overlap, per step).
        exposed = line.get("exposed_sync_s", line["sync_s"])
        scalars["time/sync_overlap"] = min(1.0, max(0.0, 1 - exposed / line["sync_busy_s"]))
    # A script's own numbers (ctx.step(accuracy=...)), under the names it wrote.
    scalars.update({k: v for k, v in line.items() if k.startswith("script/")})
    for name, value in scalars.items():
        board.add_scalar(name, value, step)
