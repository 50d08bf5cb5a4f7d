"""Prometheus metrics of one site, served by its coordinator.

Names follow Prometheus conventions (base units, `_total` for counters, `_seconds`,
`_bytes`); every metric carries the `site` label. Values come from rank 0's
per-step reports (`ReportProgress`) and from peer heartbeats, so a scrape shows the
same numbers as the site's metrics.jsonl.
"""

from __future__ import annotations

import math
import re
import socket
import threading
from collections.abc import Mapping
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, make_wsgi_app

from isthmus.inter.control.replicas import MAX_LAYOUT_CHARS, ReplicaDigests


class _MetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight never holds the coordinator's stop


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
        """Scrapes are not logged (the default writes a line per request to stderr)."""


def report_problem(report, site: str) -> str | None:
    """Why a ReportProgressRequest to ``site``'s coordinator is malformed, or None."""
    if report.site != site:
        return f"progress for site {report.site[:64]!r} sent to the coordinator of {site}"
    if not ReplicaDigests.valid(report.digest):
        return "digest must be 64 lowercase hex digits"
    if report.model_layout and (report.digest_step != 0 or not report.digest):
        return "model_layout comes only with a digest after 0 steps"
    if len(report.model_layout) > MAX_LAYOUT_CHARS:
        return f"model_layout is longer than {MAX_LAYOUT_CHARS:,} characters"
    for name in ("step_s", "compute_s", "cross_site_s", "sync_busy_s", "mfu"):
        value = getattr(report, name)
        if not (math.isfinite(value) and value >= 0):  # counters refuse negative amounts
            return f"{name} must be a finite number >= 0, got {value!r}"
    return script_metrics_problem(report.script_metrics) or links_problem(report.links)


MAX_LINKS = 64  # a series each per peer site, for as long as the coordinator runs


def links_problem(links) -> str | None:
    """Why a step's ``LinkFigures`` cannot be reported, or None."""
    if len(links) > MAX_LINKS:
        return f"{len(links)} links in one step; at most {MAX_LINKS}"
    for link in links:
        if not (0 < len(link.peer) <= 64 and link.peer.isprintable()):
            return f"link peer {link.peer[:80]!r}: 1 to 64 printable characters"
        for name in ("wire_s", "rate_bps", "line_share", "rtt_s", "min_rtt_s"):
            value = getattr(link, name)
            if not (math.isfinite(value) and value >= 0):
                return f"link {link.peer}: {name} must be a finite number >= 0, got {value!r}"
    return None


MAX_SCRIPT_METRICS = 32
"""A script's own numbers a step may report: each is a Prometheus series for as long as
the coordinator runs, so their count is bounded."""
SCRIPT_METRIC_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def script_metrics_problem(metrics: Mapping[str, float]) -> str | None:
    """Why a script's own metrics of one step cannot be reported, or None."""
    if len(metrics) > MAX_SCRIPT_METRICS:
        return f"{len(metrics)} script metrics in one step; at most {MAX_SCRIPT_METRICS}"
    for name, value in metrics.items():
        if not SCRIPT_METRIC_NAME.match(name):
            return f"script metric {name[:80]!r}: a name is [A-Za-z_][A-Za-z0-9_]*, at most 64 long"
        if not math.isfinite(value):
            return f"script metric {name!r} must be finite, got {value!r}"
    return None


class SiteMetrics:
    """The gauges and counters of one site, in a registry of their own."""

    def __init__(self, site: str) -> None:
        self.site = site
        self.registry = CollectorRegistry()
        r = self.registry

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, ("site", *labels), registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ("site",), registry=r)

        self.step = gauge("isthmus_step", "Training steps completed")
        self.loss = gauge("isthmus_loss", "Training loss of the last step")
        self.step_seconds = gauge("isthmus_step_seconds", "Wall time of the last step")
        self.compute_seconds = gauge("isthmus_compute_seconds", "Compute time of the last step")
        self.cross_site_seconds = gauge(
            "isthmus_cross_site_seconds", "Time the last step waited on the cross-site sync"
        )
        self.tokens_per_second = gauge("isthmus_tokens_per_second", "Tokens per second, last step")
        self.mfu = gauge("isthmus_mfu_ratio", "Model FLOPs utilisation of the last step, 0..1")
        self.compression_ratio = gauge(
            "isthmus_compression_ratio", "Raw / wire bytes of the last step's cross-site sync"
        )
        self.wan_goodput = gauge(
            "isthmus_wan_goodput_bytes_per_second",
            "Raw gradient bytes synchronised per second the lanes were busy, last step",
        )
        self.tokens_total = counter("isthmus_tokens", "Tokens trained")
        self.cross_site_bytes_total = counter(
            "isthmus_cross_site_bytes", "Bytes sent across sites (after the codec)"
        )
        self.cross_site_seconds_total = counter(
            "isthmus_cross_site_wait_seconds", "Seconds steps waited on the cross-site sync"
        )
        self.site_up = gauge(
            "isthmus_site_up", "1 while a peer site answers joins and heartbeats", ("peer",)
        )
        self.replicas_identical = gauge(
            "isthmus_replicas_identical", "1 while every site's parameter digest agrees, else 0"
        )
        self.replicas_identical.labels(site).set(1)
        self.script_metric = gauge(
            "isthmus_script_metric", "A script's own number of its last step", ("name",)
        )
        by_peer = ("peer",)
        self.link_rate = gauge(
            "isthmus_link_rate_bits_per_second",
            "Bits a link moved over its time on the wire, last step",
            by_peer,
        )
        self.link_line_share = gauge(
            "isthmus_link_line_share_ratio", "Achieved rate over wan.bandwidth_mbit", by_peer
        )
        self.link_rtt = gauge("isthmus_link_rtt_seconds", "Smoothed RTT (TCP_INFO)", by_peer)
        self.link_min_rtt = gauge("isthmus_link_min_rtt_seconds", "Least RTT seen", by_peer)
        self.link_cwnd = gauge("isthmus_link_cwnd_bytes", "Congestion windows, added", by_peer)
        self.link_bytes = Counter(
            "isthmus_link_bytes", "Frame bytes a link delivered", ("site", "peer"), registry=r
        )
        self.link_retransmits = Counter(
            "isthmus_link_retransmits", "TCP segments retransmitted", ("site", "peer"), registry=r
        )
        self._server: WSGIServer | None = None

    def record_step(self, report) -> None:  # a ReportProgressRequest
        s = self.site
        self.step.labels(s).set(report.step)
        self.loss.labels(s).set(report.loss)
        self.step_seconds.labels(s).set(report.step_s)
        self.compute_seconds.labels(s).set(report.compute_s)
        self.cross_site_seconds.labels(s).set(report.cross_site_s)
        self.tokens_per_second.labels(s).set(report.tokens / report.step_s if report.step_s else 0)
        self.mfu.labels(s).set(report.mfu)
        if report.cross_site_bytes:
            self.compression_ratio.labels(s).set(report.raw_bytes / report.cross_site_bytes)
        if report.sync_busy_s > 0:
            self.wan_goodput.labels(s).set(report.raw_bytes / report.sync_busy_s)
        self.tokens_total.labels(s).inc(report.tokens)
        self.cross_site_bytes_total.labels(s).inc(report.cross_site_bytes)
        self.cross_site_seconds_total.labels(s).inc(report.cross_site_s)
        for name, value in report.script_metrics.items():
            self.script_metric.labels(s, name).set(value)
        for link in report.links:
            self.link_bytes.labels(s, link.peer).inc(link.bytes)
            self.link_retransmits.labels(s, link.peer).inc(link.retransmits)
            self.link_cwnd.labels(s, link.peer).set(link.cwnd_bytes)
            if link.rate_bps > 0:  # a step that moved nothing leaves the last rate
                self.link_rate.labels(s, link.peer).set(link.rate_bps)
                self.link_line_share.labels(s, link.peer).set(link.line_share)
            if link.rtt_s > 0:
                self.link_rtt.labels(s, link.peer).set(link.rtt_s)
                self.link_min_rtt.labels(s, link.peer).set(link.min_rtt_s)

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve /metrics over HTTP; returns the bound port."""

        class Server(_MetricsServer):
            address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

        self._server = make_server(
            host, port, make_wsgi_app(self.registry), Server, handler_class=_QuietHandler
        )
        # prometheus_client's start_http_server polls for shutdown every 0.5 s, and
        # every coordinator's stop waited for it: 0.3 s on average of every job's end.
        threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="metrics-http",
            daemon=True,
        ).start()
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
