"""The cross-site all-reduce benchmark: one process per lane, lanes over given links.

:func:`run_case` starts one spawned process per lane; each runs a real lane server, its
peers and a :class:`~isthmus.inter.data.round.allreduce.CrossSiteAllReduce`, warms its
connections up, then all-reduces one tensor a step, every lane beginning each step when
the parent says go (as a site's ranks begin a step's sync together in training). The links
come from a factory the caller passes in (``inter`` does not import the WAN emulator), so
the same code can measure real links. Each codec's speed on one core comes from
:mod:`~isthmus.inter.data.codecs.speed` (re-exported: ``deploy`` imports this module).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import multiprocessing
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from isthmus.inter.data.codecs.speed import MIB, codec_throughput, format_throughput

if TYPE_CHECKING:  # imported at run time in the lane's process, after its environment
    from isthmus.inter.data.round.allreduce import CrossSiteAllReduce

__all__ = [
    "BenchCase",
    "LinkFactory",
    "codec_throughput",
    "format_results",
    "format_throughput",
    "link_bound_s",
    "run_case",
]

# (num_sites, rtt_s, bandwidth_bps, links_per_pair) -> {(i, j): the proxy URLs site i
# dials site j through, one per parallel link}; {} = lanes dial each other directly.
LinkFactory = Callable[
    [int, float, float, int], AbstractContextManager[dict[tuple[int, int], list[str]]]
]


@dataclasses.dataclass(kw_only=True, slots=True)
class BenchCase:
    """One point of the grid."""

    sites: int
    rtt_ms: float
    gbit: float  # link bandwidth per direction
    mib: float  # tensor size per site, MiB of fp32
    codec: str
    chunk_bytes: int  # 0 derives it from the link (``chunk_bytes_for_link``)
    connections: int = 4
    workers: int | None = None
    timeout_s: float = 600.0
    lanes: int = 1
    """Ranks per site, each a lane and process all-reducing an equal slice of the
    site's tensor with the same rank of every other site."""
    links: int = 1
    """Emulated links of ``gbit`` between each pair of sites; lane k crosses link k mod
    ``links``, as the hosts of a site of several each have an uplink of their own."""
    device: str = "cpu"
    """``cuda``: lane k of site i on GPU (i x lanes + k) mod count, as in training."""
    groups: int = 1
    """Groups each slice is split in, started one after another through
    ``LaneGradientSync`` as backward starts FSDP groups (1 = one plain all-reduce)."""
    in_flight: int = 4  # ``sync.rounds_in_flight`` when ``groups`` > 1
    load_ms: float = 0.0
    """Compute per step, in ms: before each group starts, its share of matrix products
    (as backward's before a group's gradients are ready); ``exposed_s`` then says how
    much of the sync did not hide behind it."""
    repeats: int = 1
    """Timed steps, each begun by every lane together; the figures are the median's."""
    warmup: int = 2
    """Full-size steps before the timed ones: a lane's first two pay first-use
    allocations (on 1x H200 a CUDA int8 lane moved 3.15 GB/s timed from its first step,
    8.10 after two warm-up steps: docs/benchmarks/lanes.md, "Warm lanes")."""
    certs_dir: str = ""
    """A job's certificates (`isthmus certs`, sites site0..): the lanes run mutual TLS,
    as a secure job's do; empty = plaintext."""


def link_bound_s(case: BenchCase) -> float:
    """The ideal uncompressed all-reduce: 2(S-1)/S x bytes / (bw x links) + RTT."""
    tensor_bytes = int(case.mib * MIB) // 4 * 4
    share = 2 * (case.sites - 1) / case.sites
    return share * tensor_bytes * 8 / (case.gbit * 1e9 * case.links) + case.rtt_ms / 1000


def _site_main(index: int, rank: int, case: dict[str, Any], conn: Any) -> None:
    """One lane's process (site ``index``, rank ``rank``): lane up, warm up, all-reduce
    its slice on "go", report."""
    os.environ["no_grpc_proxy"] = "none.invalid"  # noqa: SIM112 (gRPC reads lowercase)
    torch.set_num_threads(1)
    from isthmus.inter.data.sync.gradient import LaneGradientSync

    # As the rank program does (deploy/rank/program.py): else a full collection walks
    # torch's ~180k objects, 0.1-0.3 s on the 2-core VM with the GIL held, in some step.
    gc.freeze()
    collector = CollectorClock()
    c = BenchCase(**case)
    ar = _open_lane(index, c, conn)
    sync = None
    try:
        device = _lane_device(c, index, rank)
        tensor = _lane_slice(c, index, rank, device)
        load = _Load(device, c.load_ms / c.groups) if c.load_ms else None
        # Warm-up: opens every connection (through the proxies) before the clock runs.
        warm = torch.ones(c.chunk_bytes // 4 * c.sites, device=device)
        ar.allreduce([warm], step=0, group=0, average=True)

        def barrier() -> None:
            conn.send("ready")
            conn.recv()  # "go": every lane of every site starts the step together

        # As training does: one sync object for every step (closing it closes ``ar``).
        sync = LaneGradientSync(ar, rounds_in_flight=c.in_flight)
        conn.send(_median_report(ar, sync, c, tensor, load, barrier, collector))
        conn.recv()  # "done": nobody stops its server while a peer may still pull
    except BaseException as exc:  # noqa: BLE001 (reported to the parent as one line)
        with contextlib.suppress(Exception):
            conn.send({"error": f"site {index} rank {rank}: {type(exc).__name__}: {exc}"})
    finally:
        if sync is not None:
            sync.close()  # closes ar too
        else:
            ar.close()
        for peer in ar.membership.peers().values():
            peer.close()
        ar.server.stop(0)


def _open_lane(index: int, c: BenchCase, conn: Any) -> CrossSiteAllReduce:
    """Start the lane's server, send its address to the parent, receive the peers'
    (address, proxy) and connect: returns the all-reduce over them."""
    from isthmus.inter.data.codecs.chain import make_codec
    from isthmus.inter.data.lane.peer import LanePeer
    from isthmus.inter.data.lane.server import LaneServer
    from isthmus.inter.data.round.allreduce import CrossSiteAllReduce, FixedMembership
    from isthmus.inter.security import SiteSecurity

    codec = make_codec(c.codec)
    tls = SiteSecurity.load(c.certs_dir, f"site{index}", require_tls=True) if c.certs_dir else None
    server = LaneServer(
        site_index=index,
        num_sites=c.sites,
        codec=codec.name,
        chunk_bytes=c.chunk_bytes,
        security=tls,
    )
    conn.send(server.address)
    peers_info: dict[int, tuple[str, str | None]] = conn.recv()
    peers = {
        j: LanePeer(
            addr, chunk_bytes=c.chunk_bytes, proxy=proxy, connections=c.connections, security=tls
        )
        for j, (addr, proxy) in peers_info.items()
    }
    return CrossSiteAllReduce(
        membership=FixedMembership(server, peers),
        codec=codec,
        chunk_bytes=c.chunk_bytes,
        timeout_s=c.timeout_s,
        workers=c.workers,
    )


def _lane_device(c: BenchCase, index: int, rank: int) -> torch.device:
    """The CPU, or (``c.device == "cuda"``) lane ``rank`` of site ``index``'s GPU, made current."""
    if c.device != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", (index * c.lanes + rank) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _lane_slice(c: BenchCase, index: int, rank: int, device: torch.device) -> torch.Tensor:
    """This lane's slice of the site's tensor: gradient-like values (zero-mean, small),
    every site and slice different."""
    n = int(c.mib * MIB) // 4
    lo, hi = n * rank // c.lanes, n * (rank + 1) // c.lanes
    g = torch.Generator(device=device).manual_seed(index * 1000 + rank)
    return torch.randn(hi - lo, generator=g, device=device) * 1e-3


def _median_report(
    ar: Any,
    sync: Any,
    c: BenchCase,
    tensor: torch.Tensor,
    load: _Load | None,
    barrier: Callable[[], None],
    collector: CollectorClock,
) -> dict[str, Any]:
    """Run ``c.warmup`` untimed steps, then ``c.repeats`` timed ones, each begun when
    every lane is ready (``barrier``): this lane's figures of its step of median wall
    time, every timed step's in ``steps``, and the digest of the tensor after the last."""
    for step in range(1, c.warmup + 1):
        barrier()
        _timed_step(ar, sync, c, tensor, load, step)
    runs = []
    for step in range(c.warmup + 1, c.warmup + c.repeats + 1):
        barrier()
        began, cpu0, t0 = time.monotonic(), time.process_time(), time.perf_counter()
        gc0 = collector.total_s
        stats, compute_s, sync_s = _timed_step(ar, sync, c, tensor, load, step)
        wall = time.perf_counter() - t0
        runs.append(
            {
                "began": began,  # CLOCK_MONOTONIC: one clock for every process of the host
                "wall_s": wall,
                "cpu_s": time.process_time() - cpu0,
                "gc_s": collector.total_s - gc0,  # of the wall time, in the collector
                "compute_s": compute_s,
                "exposed_s": max(0.0, wall - compute_s),
                "sync_s": sync_s,
                **{k: getattr(stats, k) for k in _REPORTED},
                "encode_s": getattr(stats, "encode_s", 0.0),
                "decode_s": getattr(stats, "decode_s", 0.0),
            }
        )
    median = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    digest = hashlib.sha256(tensor.cpu().numpy().tobytes()).hexdigest()[:16]
    return {**median, "digest": digest, "steps": runs, "gc_frozen": gc.get_freeze_count()}


_REPORTED = ("bytes_sent", "raw_bytes", "corrupt_chunks", "stalled_flows")


class CollectorClock:
    """Seconds this process has spent in the cyclic garbage collector (``gc.callbacks``):
    a step's share tells a slow step that was a collection from one that was the wire."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._began = 0.0
        gc.callbacks.append(self.note)

    def note(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._began


class _Load:
    """Matrix products standing in for backward: ``ms`` of them per call, queued on the
    GPU's current stream (the CPU runs ahead, as training's does) or run on the CPU."""

    def __init__(self, device: torch.device, ms: float) -> None:
        self.device, self.ms = device, ms
        size = 8192 if device.type == "cuda" else 256
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.a = torch.randn(size, size, device=device, dtype=dtype)
        self.b = torch.randn(size, size, device=device, dtype=dtype)
        self.per_product_ms = 0.0
        if device.type == "cuda":
            self._products(3)  # warm-up
            t0 = time.perf_counter()
            self._products(20)
            self.per_product_ms = (time.perf_counter() - t0) * 1000 / 20

    def _products(self, count: int) -> None:
        for _ in range(count):
            self.a @ self.b
        torch.cuda.synchronize(self.device)

    def __call__(self) -> None:
        if self.device.type == "cuda":
            for _ in range(max(1, round(self.ms / self.per_product_ms))):
                self.a @ self.b
            return
        end = time.perf_counter() + self.ms / 1000
        while time.perf_counter() < end:
            self.a @ self.b


def _timed_step(
    ar: Any, sync: Any, c: BenchCase, tensor: torch.Tensor, load: _Load | None, step: int
) -> tuple[Any, float, float]:
    """The measured all-reduce: one plain round, or ``c.groups`` rounds started as
    backward would start them. Returns (stats, compute seconds, sync seconds)."""
    t0 = time.perf_counter()
    if c.groups == 1 and load is None:
        stats = ar.allreduce([tensor], step=step, group=0, average=True)
        return stats, 0.0, time.perf_counter() - t0
    began = done = None
    if tensor.is_cuda:
        began, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
    for group, part in enumerate(tensor.chunk(c.groups)):
        if load is not None:
            load()
        sync.start(step, group, part)
    compute_s = time.perf_counter() - t0
    if done is not None:
        done.record()
    stats = sync.finish(step).stats
    if began is not None and done is not None:
        done.synchronize()
        compute_s = began.elapsed_time(done) / 1000
    return stats, compute_s, stats.sync_s


def run_case(case: BenchCase, links: LinkFactory) -> dict[str, Any]:
    """Runs one case (``chunk_bytes`` resolved, > 0), one process per lane, over the
    links ``links`` makes: the case's parameters and figures (``wall_s`` of the slowest
    site, ``goodput_mb_s``, ``efficiency``, ``identical``: every site ended with the same
    bits, ...). Raises RuntimeError naming a site that failed or timed out."""
    ctx = multiprocessing.get_context("spawn")
    spec = dataclasses.asdict(case)
    pipes, procs = [], []
    wait_s = case.timeout_s + 60
    with links(case.sites, case.rtt_ms / 1000, case.gbit * 1e9, case.links) as proxies:
        try:
            lanes = [(i, r) for i in range(case.sites) for r in range(case.lanes)]
            for i, r in lanes:
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_site_main, args=(i, r, spec, child), daemon=True)
                proc.start()
                pipes.append(parent)
                procs.append(proc)
            addresses = {
                lane: _recv(p, k, wait_s)
                for k, (lane, p) in enumerate(zip(lanes, pipes, strict=True))
            }
            for (i, r), pipe in zip(lanes, pipes, strict=True):
                # A lane pairs with the same rank of every other site, via link r mod links.
                others = [j for j in range(case.sites) if j != i]
                pipe.send({j: (addresses[(j, r)], _proxy(proxies, i, j, r)) for j in others})
            for _ in range(case.warmup + case.repeats):
                for i, pipe in enumerate(pipes):
                    _recv(pipe, i, wait_s)  # "ready"
                for pipe in pipes:
                    pipe.send("go")
            reports = [_recv(p, i, wait_s) for i, p in enumerate(pipes)]
            for pipe in pipes:
                pipe.send("done")
        finally:
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    return summarize(case, reports)


def _proxy(proxies: dict[tuple[int, int], list[str]], i: int, j: int, lane: int) -> str | None:
    urls = proxies.get((i, j))
    return urls[lane % len(urls)] if urls else None


def _recv(pipe: Any, index: int, timeout: float) -> Any:
    if not pipe.poll(timeout):
        raise RuntimeError(f"site {index} did not answer within {timeout:.0f}s")
    msg = pipe.recv()
    if isinstance(msg, dict) and "error" in msg:
        raise RuntimeError(msg["error"])
    return msg


def summarize(case: BenchCase, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The case's figures from its lanes' reports, all of the timed step whose slowest
    lane (whose time is the step's, as a site's in training) took the median time."""
    tensor_bytes = int(case.mib * MIB) // 4 * 4
    timed = len(reports[0]["steps"])
    step_walls = [max(r["steps"][k]["wall_s"] for r in reports) for k in range(timed)]
    median = sorted(range(timed), key=step_walls.__getitem__)[timed // 2]
    lanes = [r["steps"][median] for r in reports]
    wall = step_walls[median]
    sent = sum(s["bytes_sent"] for s in lanes)
    raw = sum(s["raw_bytes"] for s in lanes)
    bound = link_bound_s(case)
    cpu = sum(s["cpu_s"] for s in lanes) / case.sites  # per site, all its lanes
    return {
        **dataclasses.asdict(case),
        "tensor_bytes": tensor_bytes,
        "wall_s": wall,
        "goodput_mb_s": tensor_bytes / wall / 1e6,
        "link_bound_s": bound,
        "efficiency": bound / wall,
        "compression_ratio": raw / sent if sent else 1.0,
        "cpu_s_per_gb": cpu / (tensor_bytes / 1e9),
        # Lane k of every site holds the same slice: equal bits per slice.
        "identical": all(
            len({r["digest"] for r in reports[k :: case.lanes]}) == 1 for k in range(case.lanes)
        ),
        # Faults count over every timed step, not the median one only.
        "corrupt_chunks": sum(s["corrupt_chunks"] for r in reports for s in r["steps"]),
        "stalled_flows": sum(s["stalled_flows"] for r in reports for s in r["steps"]),
        # With groups and load: the slowest lane's compute, and its wait for the sync after.
        "compute_s": max(s["compute_s"] for s in lanes),
        "exposed_s": max(s["exposed_s"] for s in lanes),
        # A site's bytes against what its links carry while the slowest lane's rounds ran.
        "link_utilization": _link_utilization(case, lanes),
        "step_walls_s": step_walls,
        "sites_detail": reports,
    }


def _link_utilization(case: BenchCase, lanes: list[dict[str, Any]]) -> float:
    """``lanes``: one step's figures of every lane, site by site."""
    per_site = [
        sum(s["bytes_sent"] for s in lanes[i * case.lanes : (i + 1) * case.lanes])
        for i in range(case.sites)
    ]
    busy = max(s["sync_s"] or s["wall_s"] for s in lanes)
    capacity_bps = case.gbit * 1e9 * case.links
    return max(per_site) * 8 / capacity_bps / busy if busy > 0 else 0.0


def format_results(rows: list[dict[str, Any]]) -> str:
    """The results table, one line per case."""
    head = (
        f"{'sites':>5}{'lanes':>6}{'links':>6}{'rtt ms':>8}{'Gbit/s':>7}{'MiB':>6}  {'codec':<22}{'chunk KiB':>10}"
        f"{'wall s':>8}{'goodput MB/s':>13}{'bound s':>8}{'effic.':>7}{'ratio':>7}"
        f"{'cpu s/GB':>9}{'link':>6}{'exposed':>8}{'same':>5}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['sites']:>5}{r.get('lanes', 1):>6}{r.get('links', 1):>6}{r['rtt_ms']:>8g}{r['gbit']:>7g}{r['mib']:>6g}  {r['codec']:<22}"
            f"{r['chunk_bytes'] // 1024:>10}{r['wall_s']:>8.2f}{r['goodput_mb_s']:>13.1f}"
            f"{r['link_bound_s']:>8.2f}{r['efficiency']:>7.2f}{r['compression_ratio']:>7.2f}"
            f"{r['cpu_s_per_gb']:>9.2f}{r.get('link_utilization', 0):>6.2f}"
            f"{r.get('exposed_s', 0):>8.2f}{'yes' if r['identical'] else 'NO':>5}"
        )
    return "\n".join(lines)
