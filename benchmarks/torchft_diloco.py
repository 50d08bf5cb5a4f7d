"""torchft 0.2's DiLoCo vs isthmus's DiLoCo, on the same emulated link.

Two replica groups ("sites") of one rank each, each in its own network namespace,
joined by one emulated link in transparent mode (`isthmus.sim.transparent`; needs
root and iptables). Both sides train the same thing: isthmus's model
(`model.preset`, seed `job.seed`), its byte-level stdlib corpus sharded by site
(`ShardedBatches`), its inner step (`isthmus.intra.train.Trainer`: AdamW, warmup +
cosine schedule, lr `scaled_lr(train.lr, dp of the site)`, grad clipping), H inner
steps between outer steps, outer Nesterov SGD (`sync.outer_lr`, `sync.outer_momentum`).
What differs is who averages the outer gradient across the link:

- torchft: `torchft.local_sgd.DiLoCo` on the Trainer's AdamW, a `torchft.Manager`
  per replica group (replica ids replica0/replica1, use_async_quorum=False, as
  DiLoCo requires), a lighthouse in site 0's namespace (min_replicas=2) and
  torchft's reconfigurable `ProcessGroupGloo`; each outer step asks the lighthouse
  for a quorum, all-reduces the pseudo-gradient over gloo across the link (one
  all-reduce per parameter tensor unless --torchft-bucketize), votes should_commit
  and steps the outer SGD;
- isthmus: `isthmus site` run in each namespace (`sync.mode=diloco`), coordinators
  and lanes on the namespace addresses, no proxies: its control plane, lanes and
  bulk ports cross the same relay as torchft's traffic (--isthmus-via local runs
  `isthmus local` instead, with its own user-space emulator of the same link).

Per side: wall time per outer step (H inner steps and the sync; median over the
outer steps after each run's first), the sync's time (torchft: quorum + all-reduce +
should_commit + outer SGD, timed around its hooks; isthmus: `OuterOptimizer.step`)
at the site that waited longest and at the site that arrived last (the sync's own
cost, without waiting for the other replica), the median inner step, the total wall
time (launch to exit, and the training loop alone), the final training loss (mean
of the last --loss-window steps of both replicas), bytes the link carried, outer
steps committed, and whether the replicas end equal (sha256 of the parameters,
`Trainer.parameter_digest`; also compared across the two sides). --repeats N runs
each side N times in alternating order (the machine's load drifts).

torchft is never a dependency of isthmus: it is imported only by this script's
worker processes, from --torchft-path (appended to sys.path, after site-packages,
so the installed torch is used). See docs/torchft_comparison.md for the install.

    sudo python3 benchmarks/torchft_diloco.py [--steps 100] [--inner-steps 20]
        [--distance-km 1000] [--bandwidth-mbit 1000] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from _common import parser
from torchft_results import combine, outer_sync_times, print_table, summarize_side

# The worker side, run by this script inside the namespaces (same directory: a script's
# own folder is first on sys.path).
from torchft_workers import (
    COORDINATOR_PORT,
    DEFAULT_TORCHFT_PATH,
    job_overrides,
    lighthouse_worker,
    torchft_worker,
)

SIDES = ("torchft", "isthmus")
CLI_WITH_CORES = (
    "import os, sys; os.cpu_count = lambda: {cores}; sys.argv[0] = 'isthmus'; "
    "from isthmus.deploy.cli import main; sys.exit(main())"
)
TORCHFT_MODULES = (
    "torchft.local_sgd",
    "torchft.manager",
    "torchft.process_group",
    "torchft.coordination",
    "torchft.checkpointing.http_transport",
)


# -- driver (root namespace) -------------------------------------------------------------


def python_env(threads: int) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "no_grpc_proxy": "none.invalid",  # gRPC must not take a proxy from the environment
        "PYTHONUNBUFFERED": "1",
    }


def spawn(cmd: list[str], threads: int, log: Path) -> subprocess.Popen:
    """Start `cmd` in its own process group; stderr goes to `log`."""
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
        env=python_env(threads),
        start_new_session=True,
    )


def stop(procs: list[subprocess.Popen]) -> None:
    """Kill what is left of the benchmark's own process groups."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def link_bytes(wan) -> int:
    stats = wan.links["site0-site1"].stats()
    return int(sum(d["bytes_delivered"] for d in stats.values()))


def tail(path: Path, n: int = 3000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-n:]
    return ""


def run_torchft(wan, args: argparse.Namespace, logs: Path) -> dict:
    addresses = [s.address for s in wan.sites]
    me = [sys.executable, str(Path(__file__).resolve())]
    procs: list[subprocess.Popen] = []
    bytes0 = link_bytes(wan)
    t0 = time.perf_counter()
    try:
        lh_log = logs / "torchft-lighthouse.log"
        lighthouse = spawn(
            [
                *wan.sites[0].exec_prefix,
                *me,
                "--worker",
                "lighthouse",
                "--torchft-path",
                args.torchft_path,
            ],  # fmt: skip
            1,
            lh_log,
        )
        procs.append(lighthouse)
        line = lighthouse.stdout.readline()  # ready once it prints its address
        if not line:
            raise SystemExit(f"torchft lighthouse failed:\n{tail(lh_log)}")
        workers = []
        for site in range(2):
            cmd = [
                *wan.sites[site].exec_prefix, *me, "--worker", "torchft", "--site", str(site),
                "--addresses", *addresses, "--threads", str(args.threads),
                *worker_flags(args),
            ]  # fmt: skip
            workers.append(spawn(cmd, args.threads, logs / f"torchft-site{site}.log"))
        procs.extend(workers)
        results = []
        for site, p in enumerate(workers):
            stdout, _ = p.communicate(timeout=args.side_timeout_s)
            if p.returncode != 0:
                log = tail(logs / f"torchft-site{site}.log")
                raise SystemExit(f"torchft worker site{site} failed (exit {p.returncode}):\n{log}")
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        stop(procs)
    wall = time.perf_counter() - t0
    per_site = {
        f"site{r['site']}": {
            "steps": [{k: x[k] for k in ("step", "loss", "elapsed_s")} for x in r["records"]],
            "sync_s": outer_sync_times(r),
            "digest": r["digest"],
            "committed": sum(r["commits"]),
        }
        for r in results
    }
    extra = {
        "phases_s": {f"site{r['site']}": r["phases"] for r in results},
        "commits": {f"site{r['site']}": r["commits"] for r in results},
        "manager_step": {f"site{r['site']}": r["manager_step"] for r in results},
        "errored": {f"site{r['site']}": r["errored"] for r in results},
        "threads_per_rank": args.threads,
        "bucketize": args.torchft_bucketize,
        "init_sync": args.init_sync,
    }
    return summarize_side(per_site, wall, link_bytes(wan) - bytes0, args, extra)


def run_isthmus(wan, args: argparse.Namespace, logs: Path, run_root: Path) -> dict:
    common = [
        "--sites", "2", "--ranks-per-site", "1", "--steps", str(args.steps), "--quiet",
        *(x for s in job_overrides(args) for x in ("--set", s)),
    ]  # fmt: skip
    run_root.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    bytes0 = link_bytes(wan) if wan is not None else 0
    t0 = time.perf_counter()
    # The isthmus CLI, with os.cpu_count() made to give every rank --threads threads
    # (deploy/launch/site.py divides the cores by the site's ranks, deploy/launch/local.py by all
    # ranks; both sites share this machine, and torchft's ranks get --threads too).
    ranks = 1 if args.isthmus_via == "netns" else 2
    cli = [sys.executable, "-c", CLI_WITH_CORES.format(cores=args.threads * ranks)]
    try:
        if args.isthmus_via == "local":
            run_dir = run_root / "isthmus-local"
            cmd = [*cli, "local", *common, "--run-dir", str(run_dir)]
            procs.append(spawn(cmd, args.threads, logs / "isthmus-local.log"))
            site_dirs = {f"site{i}": run_dir / "sites" / f"site{i}" for i in range(2)}
        else:
            addresses = [s.address for s in wan.sites]
            coords = [f"cluster.coordinators.site{i}={a}:{COORDINATOR_PORT}" for i, a in enumerate(addresses)]  # fmt: skip
            site_dirs = {}
            for i, site in enumerate(wan.sites):
                run_dir = run_root / f"isthmus-site{i}"
                site_dirs[f"site{i}"] = run_dir / "sites" / f"site{i}"
                cmd = [
                    *site.exec_prefix, *cli, "site", "--site", f"site{i}", "--insecure",
                    *common, "--run-dir", str(run_dir),
                    *(x for c in coords for x in ("--set", c)),
                    "--set", f"cluster.lane_host={site.address}",
                ]  # fmt: skip
                procs.append(spawn(cmd, args.threads, logs / f"isthmus-site{i}.log"))
        for i, p in enumerate(procs):
            p.communicate(timeout=args.side_timeout_s)
            if p.returncode != 0:
                name = "isthmus-local" if args.isthmus_via == "local" else f"isthmus-site{i}"
                raise SystemExit(
                    f"{name} failed (exit {p.returncode}):\n{tail(logs / f'{name}.log')}"
                )
    finally:
        stop(procs)
    wall = time.perf_counter() - t0
    per_site = {}
    for name, d in site_dirs.items():
        steps = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
        steps.sort(key=lambda r: r["step"])
        h = args.inner_steps
        summary_path = d / "summary.json"
        if not summary_path.exists():  # isthmus local: one summary for the run
            summary_path = d.parent.parent / "summary.json"
        summary = json.loads(summary_path.read_text())
        per_site[name] = {
            "steps": [{k: r[k] for k in ("step", "loss", "elapsed_s")} for r in steps],
            "sync_s": [r["sync_s"] for r in steps if (r["step"] + 1) % h == 0],
            "digest": summary["digests"][name],
            "committed": max((r.get("outer_steps", 0) for r in steps), default=0),
            "bytes_sent": sum(r.get("bytes_sent", 0) for r in steps),
        }
    crossed = link_bytes(wan) - bytes0 if args.isthmus_via == "netns" else None
    if crossed is None:  # the user-space emulator's counters are not ours; use the lanes'
        crossed = sum(s["bytes_sent"] for s in per_site.values())
    extra = {"via": args.isthmus_via, "threads_per_rank": args.threads}
    return summarize_side(per_site, wall, crossed, args, extra)


def worker_flags(args: argparse.Namespace) -> list[str]:
    flags = [
        "--torchft-path", args.torchft_path, "--steps", str(args.steps),
        "--inner-steps", str(args.inner_steps), "--outer-lr", str(args.outer_lr),
        "--outer-momentum", str(args.outer_momentum), "--preset", args.preset,
        "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
        "--seed", str(args.seed), "--codec", args.codec,
        "--distance-km", str(args.distance_km), "--bandwidth-mbit", str(args.bandwidth_mbit),
        "--timeout-s", str(args.timeout_s),
    ]  # fmt: skip
    for s in args.set:
        flags += ["--set", s]
    if args.torchft_bucketize:
        flags.append("--torchft-bucketize")
    if args.init_sync:
        flags.append("--init-sync")
    if args.torchft_hostname:
        flags.append("--torchft-hostname")
    return flags


def preflight(args: argparse.Namespace) -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and iptables)"
    for tool in ("iptables", "ip"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (apt-get install -y {'iptables' if tool == 'iptables' else 'iproute2'})"  # fmt: skip
    check = (
        f"import sys; sys.path.append({args.torchft_path!r}); "
        f"import importlib; [importlib.import_module(m) for m in {TORCHFT_MODULES!r}]"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", check], capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        return "importing torchft timed out"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return (
            f"torchft is not importable from {args.torchft_path} ({last}); "
            "see docs/torchft_comparison.md to install it"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    add = p.add_argument
    add("--torchft-path", default=DEFAULT_TORCHFT_PATH, help="directory torchft 0.2 is installed in (pip --target)")  # fmt: skip
    add("--steps", type=int, default=100, help="inner steps in all (a multiple of H)")
    add("--inner-steps", type=int, default=20, help="H: inner steps per outer step")
    add("--outer-lr", type=float, default=0.7)
    add("--outer-momentum", type=float, default=0.9, help="Nesterov momentum of the outer SGD")
    add("--preset", default="small", help="isthmus model preset")
    add("--batch-size", type=int, default=8)
    add("--seq-len", type=int, default=128)
    add("--seed", type=int, default=0)
    add("--codec", default="raw", help="isthmus codec (raw: fp32 like torchft's gloo all-reduce)")
    add("--distance-km", type=float, default=1000.0, help="fiber distance (4.9 us/km one way)")
    add("--bandwidth-mbit", type=float, default=1000.0, help="link bandwidth each way, Mbit/s")
    add("--set", action="append", default=[], help="extra isthmus config override (both sides)")  # fmt: skip
    add("--threads", type=int, default=0, help="torch threads per rank, both sides; 0 = cores / 2")  # fmt: skip
    add("--isthmus-via", choices=("netns", "local"), default="netns", help="isthmus side: `isthmus site` in the namespaces (default) or `isthmus local` (its own emulator)")  # fmt: skip
    add("--torchft-bucketize", action="store_true", help="torchft: one all-reduce per 1 GiB bucket instead of per tensor")  # fmt: skip
    add("--init-sync", action="store_true", help="torchft: init_sync=True (replica1 heals from replica0 at the first quorum, over the checkpoint server)")  # fmt: skip
    add("--torchft-hostname", action="store_true", help="torchft: advertise the host name (its default) instead of the namespace address, to see why that fails")  # fmt: skip
    add("--sides", nargs="+", choices=SIDES, default=list(SIDES), help="which sides to run")
    add("--repeats", type=int, default=1, help="runs per side, in alternating order (A B B A ...)")  # fmt: skip
    add("--loss-window", type=int, default=5, help="final loss: mean of this many last steps")
    add("--timeout-s", type=float, default=300.0, help="torchft collective/quorum timeout")
    add("--side-timeout-s", type=float, default=1800.0, help="give up on a side after this long")
    add("--job", default="tftdl", help="namespace job name (1-8 of [a-z0-9])")
    add("--keep", default=None, help="keep run dirs and logs here (default: a temporary dir)")
    add("--json", default=None, help="also write the results here")
    add("--worker", choices=("torchft", "lighthouse"), help=argparse.SUPPRESS)
    add("--site", type=int, help=argparse.SUPPRESS)
    add("--addresses", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker == "lighthouse":
        lighthouse_worker(args)
        return 0
    if args.worker == "torchft":
        torchft_worker(args)
        return 0
    if args.inner_steps < 1 or args.steps < args.inner_steps or args.steps % args.inner_steps:
        p.error("--steps must be a positive multiple of --inner-steps")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.threads <= 0:
        args.threads = max(1, (os.cpu_count() or 1) // 2)  # two ranks share the machine
    reason = preflight(args)
    if reason is not None:
        print(f"torchft_diloco: {reason}", file=sys.stderr)
        return 2

    from isthmus.sim import LinkSpec
    from isthmus.sim.transparent import TransparentWan

    spec = LinkSpec.from_distance(args.distance_km, args.bandwidth_mbit * 1e6)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    with contextlib.ExitStack() as stack:
        if args.keep:
            root = Path(args.keep)
            root.mkdir(parents=True, exist_ok=True)
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tftdl-")))
        logs = root / "logs"
        logs.mkdir(exist_ok=True)
        wan = stack.enter_context(TransparentWan(args.job, 2, spec))
        runs: dict[str, list[dict]] = {side: [] for side in args.sides}
        for rep in range(args.repeats):
            # Alternate the order (A B, B A, ...): the machine's load drifts.
            for side in args.sides if rep % 2 == 0 else args.sides[::-1]:
                print(f"running {side} ({rep + 1}/{args.repeats}) ...", file=sys.stderr, flush=True)  # fmt: skip
                rep_logs = logs / f"{side}-{rep}"
                rep_logs.mkdir(exist_ok=True)
                if side == "torchft":
                    runs[side].append(run_torchft(wan, args, rep_logs))
                else:
                    runs[side].append(run_isthmus(wan, args, rep_logs, root / f"run{rep}"))
        out = {side: combine(r) for side, r in runs.items()}
    result = {
        "date": date.today().isoformat(),
        "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.processor() or platform.machine()})",  # fmt: skip
        "command": " ".join(
            [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
        ),  # fmt: skip
        "steps": args.steps,
        "inner_steps": args.inner_steps,
        "preset": args.preset,
        "batch": [args.batch_size, args.seq_len],
        "outer_lr": args.outer_lr,
        "outer_momentum": args.outer_momentum,
        "distance_km": args.distance_km,
        "one_way_latency_s": spec.a_to_b.latency_s,
        "bandwidth_mbit": args.bandwidth_mbit,
        "loss_window": args.loss_window,
        "repeats": args.repeats,
        **out,
    }
    if len(out) == 2:
        digests = {d for side in out.values() for d in side["digests"].values()}
        result["same_parameters"] = len(digests) == 1
    if len(out) == 2:
        print_table(result)
    else:
        for side, r in out.items():
            keys = ("outer_step_median_s", "sync_median_s", "sync_last_median_s", "train_wall_s", "total_wall_s", "final_loss", "link_bytes", "outer_steps_committed", "replicas_equal")  # fmt: skip
            print(side, {k: r[k] for k in keys})
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
