"""The control plane under load: one coordinator per site, hundreds to thousands of ranks.

Each site's coordinator (inter/control/coordinator.py) is a real gRPC server on
loopback in its own process, so its CPU time is its own; site0's is the failover
leader (every other site votes there). Each site's ranks are simulated by one client
process (grpc.aio, many ranks per event loop) that does per rank what deploy/rank/program.py
does through inter/control/coordinator_client.py and inter/data/membership.py:

- once: ``RegisterRank`` (lane address, key), then ``GetMembership`` until generation 1;
- always: the membership watcher, a ``GetMembership`` long poll (1 s) after another;
- per step: ``CommitStep`` (a long poll of 2 s, asked again while PENDING; ``sites_known``
  as inter/control/coordinator_client.py sends it), and on rank 0 ``ReportProgress``
  once the step committed.

With ``--host-ranks K`` (K > 1) the ranks of each host of K ranks are spoken for by one
agent, as a per-host agent would: one ``CommitHostStep`` a host a step carrying its
ranks' K ballots, and one membership watcher a host (a 10 s long poll). The coordinator then sees what it
would from such agents; the hop from a rank to its agent (on the host) is a function
call here. ``--calls agent`` runs the real agent instead (inter/control/host_agent.py, one
a host of ``--host-ranks`` ranks, threads of the ranks' process), which every simulated
rank votes and watches through: what a job's ranks do when a launcher starts several on a
host. ``--host-ranks 1 --calls stream`` is what ranks without an agent do (each its own
vote stream, its own watch); ``--calls call`` (the default) is how they voted before.

``--compare-rev REV`` runs each configuration twice, first with the coordinators of
git revision REV (extracted with ``git archive``; its ``inter/`` and ``proto/`` are
imported as ``isthmus.inter`` and ``isthmus.proto``), then with this tree's: old and new
in one run, on the same machine minutes apart.

Steps start on a fixed clock (``--rate`` steps/s); a step that takes longer than its
period delays the next one, and the table's ``steps/s`` says what was reached.

Reported per (sites, ranks per site):

- ``decision p50 / p99``: per step, from the last rank's vote (sent, in any site) to the
  moment every rank of every site holds the COMMIT, ms, over the measured steps;
  ``first``: the median to the first rank holding it (the rest is the fan-out);
- ``votes sent``: from the step's start to the last vote sent (the clients' own pace);
- ``leader / other cpu``: CPU seconds per step of site0's coordinator and of the busiest
  other coordinator (each its own process: /proc/PID/stat, user + system, every thread);
  ``leader cores``: the leader's CPU seconds per wall second (equal to its CPU per step
  when the steps keep to 1 step/s);
- ``clients cpu``: CPU seconds per step of all simulated ranks together, apart from the
  coordinators': on one machine they compete with them for its cores, which a real
  site's hosts do not.

Run::

    python benchmarks/control_plane.py --ranks 256,1024,4096 --sites 2,3 --steps 20 \\
        --json runs/control_plane.json
    python benchmarks/control_plane.py --ranks 1024 --sites 2 --host-ranks 1,8 \\
        --compare-rev HEAD~5  # old coordinators (per rank only), new per rank and per host
    python benchmarks/control_plane.py --quick   # 2 sites x 16 ranks, 3 steps: a smoke test

Timestamps of different processes are compared on CLOCK_MONOTONIC (``time.monotonic``),
which one machine shares among its processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from control_plane_procs import STEP_TIMEOUT_S, serve_coordinator, serve_ranks


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spawn(*args: str, code: Path | None = None) -> subprocess.Popen:
    """This script in a child process; ``code``: a folder whose ``isthmus`` package it
    imports instead of this tree's (:func:`extract_rev`)."""
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(code), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, __file__, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
        env=env,
    )


def extract_rev(rev: str, into: Path) -> Path:
    """``inter/`` and ``proto/`` of git revision ``rev`` as an ``isthmus`` package under
    ``into`` (a regular package: found on PYTHONPATH before the editable install)."""
    root = Path(__file__).resolve().parent.parent
    package = into / "isthmus"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", rev, "inter", "proto"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(package)], input=archive, check=True)
    return into


def _line(proc: subprocess.Popen, what: str) -> str:
    line = proc.stdout.readline() if proc.stdout else ""
    if not line:
        raise RuntimeError(f"{what} exited (rc {proc.poll()}) before answering")
    return line.strip()


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_case(
    sites: int,
    ranks: int,
    steps: int,
    rate: float,
    warmup: int,
    *,
    host_ranks: int = 1,
    calls: str = "call",
    code: Path | None = None,
    code_name: str = "new",
) -> dict:
    """One configuration: start the coordinators (of ``code``, else this tree's) and the
    ranks, run ``warmup`` + ``steps`` steps at ``rate`` steps/s, stop everything;
    returns the row of the table."""
    names = [f"site{i}" for i in range(sites)]
    procs: list[subprocess.Popen] = []
    join_s = 0.0
    try:
        coords = [
            _spawn("--serve-coordinator", n, ",".join(names), str(ranks), code=code) for n in names
        ]
        procs += coords
        addresses = {n: _line(p, f"coordinator {n}") for n, p in zip(names, coords, strict=True)}
        for p in coords:
            assert p.stdin is not None
            p.stdin.write(json.dumps(addresses) + "\n")
        for n, p in zip(names, coords, strict=True):
            _line(p, f"coordinator {n}")
        t0 = time.monotonic()
        clients = [
            _spawn("--serve-ranks", n, addresses[n], str(ranks), str(host_ranks), calls)
            for n in names
        ]
        procs += clients
        for n, p in zip(names, clients, strict=True):
            if _line(p, f"ranks of {n}") != "ready":
                raise RuntimeError(f"ranks of {n} did not join")
        join_s = time.monotonic() - t0
        period = 1.0 / rate
        rows: list[dict] = []
        at = time.monotonic() + 0.2
        cpu0: list[float] = []
        measured_from = 0.0
        failed = ""
        for step in range(warmup + steps):
            if step == warmup:
                cpu0 = [cpu_seconds(p.pid) for p in procs]
                measured_from = at
            for p in clients:
                assert p.stdin is not None
                p.stdin.write(f"step {step} {at}\n")
            seen = [json.loads(_line(p, "ranks")) for p in clients]
            if any(s["timed_out"] for s in seen):
                failed = f"step {step} not decided within {STEP_TIMEOUT_S:.0f}s"
                break
            if step >= warmup:
                rows.append({"start": at, "sites": seen})
            at = max(at + period, time.monotonic() + 0.01)
        elapsed = at - measured_from  # when the next step would start
        now = [cpu_seconds(p.pid) for p in procs] if cpu0 else cpu0
        cpu = [b - a for a, b in zip(cpu0, now, strict=True)]
    finally:
        for p in procs:
            if p.stdin is not None and p.poll() is None:
                try:
                    p.stdin.write("stop\n")
                    p.stdin.close()
                except OSError:
                    pass
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    row = {
        "code": code_name,
        "host_ranks": host_ranks,
        "calls": calls,
        "sites": sites,
        "ranks_per_site": ranks,
        "steps": steps,
        "target_steps_per_s": rate,
    }
    if failed or not rows:
        return {**row, "failed": failed or "no step measured", "join_s": join_s}
    return {
        **row,
        **_figures(rows, cpu, sites, steps, elapsed),
        "join_s": join_s,
        # Real agents only: vote messages they sent per host and step (1 when a host's
        # ballots all went in one).
        **(
            {
                "agent_messages_per_host_step": _messages(rows)
                / steps
                / (sites * -(-ranks // host_ranks))
            }
            if calls == "agent"
            else {}
        ),
    }


def _messages(rows: list[dict]) -> int:
    return sum(s.get("messages", 0) for measured in rows for s in measured["sites"])


def _figures(rows: list[dict], cpu: list[float], sites: int, steps: int, elapsed: float) -> dict:
    """The measured steps' latencies, CPU and verdicts, as the table's row holds them."""
    latencies, sent, first = [], [], []
    verdicts: dict[str, int] = {}
    errors: dict[str, int] = {}
    repolls = 0
    for measured in rows:
        last_vote = max(s["last_vote"] for s in measured["sites"])
        latencies.append(1000 * (max(s["last_seen"] for s in measured["sites"]) - last_vote))
        first.append(1000 * (min(s["first_seen"] for s in measured["sites"]) - last_vote))
        sent.append(1000 * (last_vote - measured["start"]))
        for s in measured["sites"]:
            for name, count in s["errors"].items():
                errors[name] = errors.get(name, 0) + count
            repolls += s["repolls"]
            for name, count in s["verdicts"].items():
                verdicts[name] = verdicts.get(name, 0) + count
    coord_cpu = [c / steps for c in cpu[:sites]]
    return {
        "steps_per_s": steps / elapsed,
        "decision_ms_p50": percentile(latencies, 0.5),
        "decision_ms_p99": percentile(latencies, 0.99),
        "decision_ms": latencies,
        "first_answer_ms_p50": statistics.median(first),
        "votes_sent_ms_p50": statistics.median(sent),
        "leader_cores": coord_cpu[0] * steps / elapsed,
        "coordinator_cores": [c * steps / elapsed for c in coord_cpu],
        "leader_cpu_s_per_step": coord_cpu[0],
        "other_cpu_s_per_step": max(coord_cpu[1:]),
        "coordinator_cpu_s_per_step": coord_cpu,
        "clients_cpu_s_per_step": sum(cpu[sites:]) / steps,
        "clients_cores": sum(cpu[sites:]) / elapsed,
        "verdicts": verdicts,
        "vote_errors": errors,
        "vote_repolls": repolls,
    }


HEADER = (
    f"{'code':>8} {'host':>4} {'calls':>6} "
    f"{'sites':>5} {'ranks/site':>10} {'steps/s':>7} {'decision p50':>12} {'p99':>8} "
    f"{'first':>6} "
    f"{'votes sent':>10} {'leader cpu':>10} {'other cpu':>9} {'leader cores':>12} "
    f"{'clients cpu':>11}"
)


def format_row(r: dict) -> str:
    head = (
        f"{r['code'][:8]:>8} {r['host_ranks']:>4} {r.get('calls', 'call'):>6} "
        f"{r['sites']:>5} {r['ranks_per_site']:>10}"
    )
    if "failed" in r:
        return f"{head}  did not keep up: {r['failed']}"
    return (
        f"{head} {r['steps_per_s']:>7.2f} "
        f"{r['decision_ms_p50']:>9.1f} ms {r['decision_ms_p99']:>5.1f} ms "
        f"{r['first_answer_ms_p50']:>6.1f} "
        f"{r['votes_sent_ms_p50']:>7.0f} ms {r['leader_cpu_s_per_step']:>8.3f} s "
        f"{r['other_cpu_s_per_step']:>7.3f} s {r['leader_cores']:>12.2f} "
        f"{r['clients_cpu_s_per_step']:>9.3f} s"
    )


def _counts(text: str, flag: str, low: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag} takes integers separated by commas") from None
    if not values or min(values) < low:
        raise argparse.ArgumentTypeError(f"{flag} values must be >= {low}")
    return values


def _ways(hosts: list[int], calls: list[str]) -> list[tuple[int, str]]:
    """Every (ranks a voter speaks for, how it votes) to run, in that order; an agent
    for one rank is left out (a rank without one votes on its own stream)."""
    return [(h, how) for h in hosts for how in calls if not (how == "agent" and h == 1)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", default="256,1024,4096", help="ranks per site, comma-separated")
    p.add_argument("--sites", default="2,3", help="site counts, comma-separated (>= 2)")
    p.add_argument("--steps", type=int, default=20, help="measured steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="steps run before measuring")
    p.add_argument("--rate", type=float, default=1.0, help="target steps per second")
    p.add_argument(
        "--host-ranks",
        default="1",
        help="ranks one agent votes and watches for, comma-separated (1: each rank itself)",
    )
    p.add_argument(
        "--calls",
        default="call",
        help="how voters vote, comma-separated: call (a CommitStep/CommitHostStep call a "
        "vote), stream (each voter's votes on one HostSession stream) or agent (a real "
        "HostAgent a host of --host-ranks ranks, each rank voting and watching through it)",
    )
    p.add_argument(
        "--compare-rev",
        metavar="REV",
        help="run each configuration with REV's coordinators first (per rank only)",
    )
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--quick", action="store_true", help="2 sites x 16 ranks, 3 steps")
    p.add_argument("--serve-coordinator", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--serve-ranks", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_coordinator:
        site, names, ranks = args.serve_coordinator
        serve_coordinator(site, names.split(","), int(ranks))
        return 0
    if args.serve_ranks:
        site, address, ranks, host_ranks, calls = args.serve_ranks
        serve_ranks(site, address, int(ranks), int(host_ranks), calls)
        return 0
    try:
        ranks = _counts(args.ranks, "--ranks", 1)
        sites = _counts(args.sites, "--sites", 2)
        hosts = _counts(args.host_ranks, "--host-ranks", 1)
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    calls = [c.strip() for c in args.calls.split(",") if c.strip()]
    if not calls or set(calls) - {"call", "stream", "agent"}:
        p.error(f"--calls takes call, stream and/or agent, got {args.calls!r}")
    if args.steps < 1 or args.warmup < 0 or args.rate <= 0:
        p.error("--steps must be >= 1, --warmup >= 0 and --rate > 0")
    if args.quick:
        ranks, sites, args.steps, args.warmup = [16], [2], 3, 1
    with tempfile.TemporaryDirectory(prefix="control-plane-") as tmp:
        codes: list[tuple[str, Path | None]] = [("new", None)]
        if args.compare_rev:
            try:
                old = extract_rev(args.compare_rev, Path(tmp))
            except subprocess.CalledProcessError:
                p.error(f"--compare-rev: git cannot archive {args.compare_rev!r}")
            codes.insert(0, (args.compare_rev, old))
        print(HEADER, flush=True)
        results = []
        for s in sites:
            for r in ranks:
                for name, code in codes:
                    # An older coordinator may know neither CommitHostStep nor
                    # HostSession: it runs per rank, a call a vote, only.
                    for h, how in _ways(hosts, calls) if code is None else [(1, "call")]:
                        row = run_case(
                            s,
                            r,
                            args.steps,
                            args.rate,
                            args.warmup,
                            host_ranks=h,
                            calls=how,
                            code=code,
                            code_name=name,
                        )
                        results.append(row)
                        print(format_row(row), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "machine": f"{os.cpu_count()} cores",
            "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(
                ["python3", "benchmarks/control_plane.py", *(argv or sys.argv[1:])]
            ),
        }
        args.json.write_text(json.dumps({**meta, "rows": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
