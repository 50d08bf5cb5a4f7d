"""The control plane under load: one coordinator per site, hundreds to thousands of ranks.

Each site's coordinator (inter/control/coordinator.py) is a real gRPC server on
loopback in its own process, so its CPU time is its own; site0's is the failover
leader (every other site votes there). Each site's ranks are simulated by one client
process (many ranks per event loop) that does per rank what deploy/rank/program.py
does through inter/control/coordinator_client.py and inter/data/sync/membership.py:

- once: ``RegisterRank`` (lane address, key), then ``GetMembership`` until generation 1
  (grpc.aio);
- always: the membership watcher, a ``GetMembership`` long poll (5 s, spread over 75-100 %
  of it) after another;
- per step: a vote that waits (2 s, asked again while PENDING; ``sites_known`` as
  inter/control/coordinator_client.py sends it), and on rank 0 ``ReportProgress`` once
  the step committed.

The watches and votes, the calls that repeat, go over benchmarks/h2_client.py: the same
HTTP/2 frames and protobuf bytes as a gRPC client's, at a tenth of grpc.aio's CPU, so
that thousands of simulated ranks do not take the cores from what is measured (a real
rank runs on its own). Their CPU is measured apart (``clients cpu``).

``--calls agent`` runs real host agents (inter/control/host_agent.py): one a host of
``--host-ranks`` ranks, each in a process of its own as a node's launcher runs it
(forked from one process per site that imported gRPC and the agent once), on a Unix
socket; every simulated rank votes and watches through its host's agent, in frames on
its own connection there (inter/control/agent_wire.py), opened and checked by the rank's
own ``AgentConnection``, as a job's ranks do. Their CPU is measured
apart too (``agents cpu``). Without agents, ``--host-ranks 1 --calls stream`` is what ranks
do (each its own vote stream, its own watch), ``--calls call`` how they voted before;
``--host-ranks K`` with ``call``/``stream`` simulates an agent a host of K ranks in the
ranks' process (one ``CommitHostStep`` a host a step, one 10 s watch a host).

``--compare-rev REV`` runs each configuration twice, first with the coordinators and
agents of git revision REV (extracted with ``git archive``; its ``inter/`` and
``proto/`` are imported as ``isthmus.inter`` and ``isthmus.proto``; ``--compare-code``
hands an extracted copy where there is no git history), then with this tree's: old and
new in one run, on the same machine minutes apart. REV's agents must speak gRPC to their
ranks (before the framed hop, 2026-12-07): its simulated ranks vote on a ``HostSession``
stream to their agent, one a host, and watch 5 s, as its ranks did.

Steps start on a fixed clock (``--rate`` steps/s); a step that takes longer than its
period delays the next one, and the table's ``steps/s`` says what was reached. The
coordinators declare a rank dead after ``--failure-timeout-s`` (the job's 10 s) of
silence; ``dead`` counts the ranks they did (none of the simulated ranks dies).

Reported per (sites, ranks per site):

- ``decision p50 / p99``: per step, from the last rank's vote (sent, in any site) to the
  moment every rank of every site holds the COMMIT, ms, over the measured steps;
  ``first``: the median to the first rank holding it (the rest is the fan-out);
- ``votes sent``: from the step's start to the last vote sent (the clients' own pace);
- ``leader / other cpu``: CPU seconds per step of site0's coordinator and of the busiest
  other coordinator (each its own process: /proc/PID/stat, user + system, every thread);
  ``leader cores``: the leader's CPU seconds per wall second (equal to its CPU per step
  when the steps keep to 1 step/s);
- ``agents cpu``: CPU seconds per step of all host agents' processes together;
- ``clients cpu``: CPU seconds per step of all simulated ranks together: on one machine
  they compete with the rest for its cores, which a real site's hosts do not.

Run::

    python3 benchmarks/control_plane.py --ranks 256,1024 --sites 2 --host-ranks 8 \\
        --calls agent --compare-rev HEAD~5 --json runs/agents.json  # old and new agents
    python3 benchmarks/control_plane.py --ranks 1024 --sites 2 --host-ranks 1 --calls stream
    python3 benchmarks/control_plane.py --quick   # 2 sites x 16 ranks, 3 steps: a smoke test

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

from _common import parser
from control_plane_procs import STEP_TIMEOUT_S, serve_agents, serve_coordinator, serve_ranks


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spawn(*args: str, code: Path | None = None, **extra: str) -> subprocess.Popen:
    """This script in a child process; ``code``: a folder whose ``isthmus`` package it
    imports instead of this tree's (:func:`extract_rev`); ``extra``: environment
    variables set for it alone."""
    env = {**os.environ, **extra}
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


def _agents_env() -> dict[str, str]:
    """``AGENTS_GRPC_EXPERIMENTS``, when set, is the agents' processes' alone
    ``GRPC_EXPERIMENTS`` (gRPC's C-core experiments, read when gRPC starts)."""
    value = os.environ.get("AGENTS_GRPC_EXPERIMENTS")
    return {"GRPC_EXPERIMENTS": value} if value is not None else {}


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
    failure_timeout_s: float = 10.0,
) -> dict:
    """One configuration: start the coordinators (and with ``calls="agent"`` the host
    agents, a process each; both of ``code``, else this tree's) and the ranks, run
    ``warmup`` + ``steps`` steps at ``rate`` steps/s, stop everything; returns the row
    of the table."""
    names = [f"site{i}" for i in range(sites)]
    procs: list[subprocess.Popen] = []
    coords: list[subprocess.Popen] = []
    agents: list[subprocess.Popen] = []
    agent_pids: list[int] = []
    join_s = 0.0
    folder = tempfile.TemporaryDirectory(prefix="isthmus-agents-")
    try:
        coords = [
            _spawn(
                "--serve-coordinator",
                *(n, ",".join(names), str(ranks), str(failure_timeout_s)),
                code=code,
            )
            for n in names
        ]
        procs += coords
        addresses = {n: _line(p, f"coordinator {n}") for n, p in zip(names, coords, strict=True)}
        for p in coords:
            assert p.stdin is not None
            p.stdin.write(json.dumps(addresses) + "\n")
        for n, p in zip(names, coords, strict=True):
            _line(p, f"coordinator {n}")
        t0 = time.monotonic()
        folders = {n: Path(folder.name) / n for n in names}
        if calls == "agent":
            for n in names:
                folders[n].mkdir(mode=0o700)
            agents = [
                _spawn(
                    "--serve-agents",
                    *(n, addresses[n], str(ranks), str(host_ranks), str(folders[n])),
                    code=code,
                    **_agents_env(),
                )
                for n in names
            ]
            procs += agents
            for n, p in zip(names, agents, strict=True):
                agent_pids += json.loads(_line(p, f"agents of {n}"))["pids"]
        clients = [
            _spawn(
                "--serve-ranks",
                *(n, addresses[n], str(ranks), str(host_ranks), calls, str(folders[n])),
                # An older revision's ranks: as its rank client votes and watches.
                *(["--old-ranks"] if code is not None else []),
            )
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
        watched = [*(p.pid for p in coords), *agent_pids, *(p.pid for p in clients)]
        cpu0: list[float] = []
        measured_from = 0.0
        failed = ""
        for step in range(warmup + steps):
            if step == warmup:
                cpu0 = [cpu_seconds(pid) for pid in watched]
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
        now = [cpu_seconds(pid) for pid in watched] if cpu0 else cpu0
        cpu = [b - a for a, b in zip(cpu0, now, strict=True)]
    finally:
        ends = _stop(procs)
        folder.cleanup()
    row = {
        "code": code_name,
        "host_ranks": host_ranks,
        "calls": calls,
        "sites": sites,
        "ranks_per_site": ranks,
        "steps": steps,
        "target_steps_per_s": rate,
        "failure_timeout_s": failure_timeout_s,
        # Ranks a coordinator's failover loop found silent, and so declared dead: none
        # of the simulated ranks dies, so any is declared wrongly.
        "declared_dead": sum(len(ends[p.pid].get("declared_dead", ())) for p in coords),
    }
    hosts = sites * -(-ranks // host_ranks)
    if calls == "agent":
        # What the agents carried, over the whole run (warm-up steps included).
        totals: dict[str, int] = {}
        for p in agents:
            for name, value in ends[p.pid].items():
                totals[name] = totals.get(name, 0) + value
        row["agents"] = totals
        row["agent_messages_per_host_step"] = totals.get("vote_messages", 0) / (
            hosts * (len(rows) + warmup)
        )
    if failed or not rows:
        return {**row, "failed": failed or "no step measured", "join_s": join_s}
    figures = _figures(rows, cpu, sites, len(agent_pids), steps, elapsed)
    if agent_pids:
        figures["agent_cpu_ms_per_host_step"] = 1000 * figures["agents_cpu_s_per_step"] / hosts
    return {**row, **figures, "join_s": join_s}


def _stop(procs: list[subprocess.Popen]) -> dict[int, dict]:
    """Tells each process to stop and waits for it; the last JSON object each printed
    (a coordinator: the ranks it declared dead; the agents: their stats), by pid."""
    for p in procs:
        if p.stdin is not None and p.poll() is None:
            try:
                p.stdin.write("stop\n")
                p.stdin.close()
            except OSError:
                pass
        p.stdin = None  # closed: communicate() would flush it
    ends: dict[int, dict] = {}
    for p in procs:
        try:
            out, _ = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        last = [line for line in (out or "").splitlines() if line.startswith("{")]
        ends[p.pid] = json.loads(last[-1]) if last else {}
    return ends


def _figures(
    rows: list[dict], cpu: list[float], sites: int, agents: int, steps: int, elapsed: float
) -> dict:
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
        "agents_cpu_s_per_step": sum(cpu[sites : sites + agents]) / steps,
        "agents_cores": sum(cpu[sites : sites + agents]) / elapsed,
        "clients_cpu_s_per_step": sum(cpu[sites + agents :]) / steps,
        "clients_cores": sum(cpu[sites + agents :]) / elapsed,
        "verdicts": verdicts,
        "vote_errors": errors,
        "vote_repolls": repolls,
    }


HEADER = (
    f"{'code':>8} {'host':>4} {'calls':>6} "
    f"{'sites':>5} {'ranks/site':>10} {'steps/s':>7} {'decision p50':>12} {'p99':>8} "
    f"{'first':>6} "
    f"{'votes sent':>10} {'leader cpu':>10} {'other cpu':>9} {'leader cores':>12} "
    f"{'agents cpu':>10} {'clients cpu':>11} {'dead':>4}"
)


def format_row(r: dict) -> str:
    head = (
        f"{r['code'][:8]:>8} {r['host_ranks']:>4} {r.get('calls', 'call'):>6} "
        f"{r['sites']:>5} {r['ranks_per_site']:>10}"
    )
    if "failed" in r:
        return f"{head}  did not keep up: {r['failed']} ({r['declared_dead']} declared dead)"
    return (
        f"{head} {r['steps_per_s']:>7.2f} "
        f"{r['decision_ms_p50']:>9.1f} ms {r['decision_ms_p99']:>5.1f} ms "
        f"{r['first_answer_ms_p50']:>6.1f} "
        f"{r['votes_sent_ms_p50']:>7.0f} ms {r['leader_cpu_s_per_step']:>8.3f} s "
        f"{r['other_cpu_s_per_step']:>7.3f} s {r['leader_cores']:>12.2f} "
        f"{r['agents_cpu_s_per_step']:>8.3f} s {r['clients_cpu_s_per_step']:>9.3f} s "
        f"{r['declared_dead']:>4}"
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
    p = parser(__doc__)
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
    p.add_argument(
        "--compare-code",
        type=Path,
        metavar="DIR",
        help="with --compare-rev: REV's code extracted already (a folder holding its isthmus "
        "package, as extract_rev makes it), for a machine without the git history",
    )
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--quick", action="store_true", help="2 sites x 16 ranks, 3 steps")
    p.add_argument(
        "--failure-timeout-s",
        type=float,
        default=10.0,
        help="the coordinators' failover.failure_timeout_s (the job's default: 10): a rank "
        "silent this long is declared dead",
    )
    p.add_argument("--serve-coordinator", nargs=4, help=argparse.SUPPRESS)
    p.add_argument("--serve-agents", nargs=5, help=argparse.SUPPRESS)
    p.add_argument("--serve-ranks", nargs=6, help=argparse.SUPPRESS)
    p.add_argument("--old-ranks", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_coordinator:
        site, names, ranks, failure_timeout_s = args.serve_coordinator
        serve_coordinator(site, names.split(","), int(ranks), float(failure_timeout_s))
        return 0
    if args.serve_agents:
        site, address, ranks, host_ranks, folder = args.serve_agents
        serve_agents(site, address, int(ranks), int(host_ranks), folder)
        return 0
    if args.serve_ranks:
        site, address, ranks, host_ranks, calls, folder = args.serve_ranks
        serve_ranks(site, address, int(ranks), int(host_ranks), calls, folder, args.old_ranks)
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
        if args.compare_rev and args.compare_code:
            codes.insert(0, (args.compare_rev, args.compare_code))
        elif args.compare_rev:
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
                    # REV must know every way asked for (agents: since 2026-12-02).
                    for h, how in _ways(hosts, calls):
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
                            failure_timeout_s=args.failure_timeout_s,
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
