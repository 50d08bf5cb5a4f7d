"""A site on two nodes under Slurm against the same site started with `isthmus site`
(issue 59): seconds from the launch to the first committed step, and steps/s after it.

As root, starts the Slurm test's cluster on this machine (tests/slurm_cluster.py: four
slurmd nodes, each in its own network and UTS namespace, two sites of two nodes joined
by an emulated link) and runs the multi-node test's job (tests/deploy/test_slurm.py:
its job.toml and its sbatch flags) two ways, alternating (slurm first, then ABBA):

- slurm: deploy/slurm/site-multinode.sbatch submitted unchanged with sbatch, once a site;
- direct: on the same nodes, the command line each Slurm task ran (read from /proc while
  it ran: `isthmus site ... --nodes 2 --node-rank K`), with that task's environment less
  Slurm's own variables, started in the node's namespaces as slurmd starts a task, with
  a run folder and a rank secret of its own made as the template makes them.

Per run and site: to launcher (sbatch, or the direct start, to the start of the site's
first `isthmus site` process: /proc's start time, to 5 ms), to first step (to the
write of the first line of the site's metrics.jsonl: the file's mtime less rank 0's
elapsed_s since that line) and steps/s (rank 0's elapsed_s from the line of step
--warmup to the one before the last, which also digests and evaluates).

    sudo python3 benchmarks/slurm_multinode.py [--repeats 3] [--steps 40] [--warmup 5] \
        [--out benchmarks/results/slurm_multinode.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import secrets
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from isthmus.deploy.commands.certs import write_certs

# tests/ is no package: its folders go on sys.path as pytest puts them, so that the
# cluster, the job file and the sbatch flags are the Slurm test's own, not copies.
TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "deploy")]
import test_slurm  # noqa: E402
from slurm_cluster import DONE_STATES, SlurmCluster, missing_tools  # noqa: E402

SITES = test_slurm.SITES
POLL_S = 0.25  # the timestamps are the files' and processes' own: polling sets no precision
TICKS = os.sysconf("SC_CLK_TCK")
SLURM_ENV = ("SLURM", "SRUN_", "PMI_")
"""Prefixes of what Slurm adds to a task's environment: the direct run goes without."""


def _lines(path: Path) -> list[dict]:
    """metrics.jsonl's whole lines (one being written is left out)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def _launchers(run_dirs: set[str], found: dict[tuple[str, int], dict]) -> None:
    """Add to ``found`` the `isthmus site --node-rank K` processes whose --run-dir is in
    ``run_dirs``: (site, K) -> argv from `site` on, environment, start (epoch seconds).
    The earliest of a key is the launcher (a process it forks keeps its command line)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
            if "--node-rank" not in argv or argv[argv.index("--run-dir") + 1] not in run_dirs:
                continue
            environ = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")[:-1]
            ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        except (OSError, ValueError, IndexError):
            continue  # not ours (no --run-dir: a shell around one), or just ended
        start = time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - (ticks + 0.5) / TICKS)
        argv = argv[argv.index("site") :]  # the interpreter and the entry point may differ
        key = (argv[argv.index("--site") + 1], int(argv[argv.index("--node-rank") + 1]))
        env = dict(e.split("=", 1) for e in environ)
        if key not in found or start < found[key]["start"]:
            found[key] = {"argv": argv, "env": env, "start": start}


def _until(done: Callable[[], bool], ended: Callable[[], bool], folder: Path) -> None:
    """Poll ``done`` until it holds; fail if ``ended()`` (asked every 5 s: for Slurm a
    query of slurmctld, kept off the steps' CPU) or the job's deadline passed."""
    deadline, polls = time.monotonic() + test_slurm.JOB_TIMEOUT_S, 0
    while not done():
        polls += 1
        if polls % 20 == 0 and (ended() or time.monotonic() > deadline):
            raise RuntimeError(f"the run ended early or hung:\n{SlurmCluster.job_logs(folder)}")
        time.sleep(POLL_S)


def measure(
    folder: Path, run_dirs: dict, t0: dict, steps: int, warmup: int, ended: Callable[[], bool]
) -> tuple[dict, dict]:
    """Poll until each site's metrics.jsonl holds a line, catching the launchers, then
    until it holds the last. Returns each site's figures, and the launchers."""
    first: dict[str, float] = {}
    launchers: dict[tuple[str, int], dict] = {}
    paths = {s: folder / run_dirs[s] / "sites" / s / "metrics.jsonl" for s in SITES}

    def started() -> bool:
        if len(launchers) < 2 * len(SITES):  # a scan of /proc costs CPU the ranks want
            _launchers(set(run_dirs.values()), launchers)
        for site in set(SITES) - set(first):
            # stat, read, stat: the mtime is then the write of the last line read.
            before = paths[site].stat().st_mtime_ns if paths[site].exists() else 0
            lines, after = _lines(paths[site]), paths[site].stat() if paths[site].exists() else None
            if lines and after and after.st_mtime_ns == before:
                first[site] = after.st_mtime - (lines[-1]["elapsed_s"] - lines[0]["elapsed_s"])
        return len(first) == len(SITES) and len(launchers) == 2 * len(SITES)

    _until(started, ended, folder)
    _until(lambda: all(len(_lines(p)) == steps for p in paths.values()), ended, folder)
    figures = {}
    for site in SITES:
        lines = _lines(paths[site])
        a, b = lines[warmup], lines[-2]
        start = min(v["start"] for (s, _), v in launchers.items() if s == site)
        figures[site] = {
            "to_launcher_s": round(start - t0[site], 3),
            "to_first_step_s": round(first[site] - t0[site], 3),
            "steps_per_s": round((b["step"] - a["step"]) / (b["elapsed_s"] - a["elapsed_s"]), 3),
            "digest": lines[-1]["digest"],  # the same job: the same parameters
        }
    return figures, launchers


def _identical(outs: list[Path]) -> None:
    """Node 0 of each site compared the sites' final digests, and says so."""
    for out in outs:
        assert "replicas            identical" in out.read_text(), out.read_text()[-3000:]


def run_slurm(
    cluster: SlurmCluster, folder: Path, job: Path, steps: int, warmup: int
) -> tuple[dict, dict]:
    """The multi-node test's job: its two sbatch submissions, as the test makes them."""
    export = f"ALL,ISTHMUS_JOB={job},ISTHMUS_DEVICE=cpu,ISTHMUS_RANKS_PER_NODE=1"
    t0, jobs = {}, {}
    for site in SITES:
        t0[site] = time.time()
        jobs[site] = test_slurm.submit(
            cluster, "site-multinode.sbatch", folder, site, "--nodes=2", "--ntasks-per-node=1",
            f"--export={export},ISTHMUS_SITE={site}",
        )  # fmt: skip
    run_dirs = {site: f"runs/{job_id}" for site, job_id in jobs.items()}  # the template's

    def ended() -> bool:
        return any(cluster.state(j)[0] in DONE_STATES for j in jobs.values())

    # To the last step before cluster.wait, which asks slurmctld twice a second.
    figures, launchers = measure(folder, run_dirs, t0, steps, warmup, ended)
    cluster.wait(list(jobs.values()), folder, test_slurm.JOB_TIMEOUT_S)
    _identical([folder / f"{s}.out" for s in SITES])
    return figures, launchers


def run_direct(cluster: SlurmCluster, folder: Path, tasks: dict, steps: int, warmup: int) -> dict:
    """The Slurm tasks' command lines and environments (less Slurm's) on their nodes."""
    run_dir = "runs/direct"
    (folder / run_dir).mkdir(parents=True)
    t0, procs = {}, []
    try:
        for site in SITES:
            t0[site] = time.time()
            # As the template: a fresh 0600 secret, 32 random bytes in hex, no newline.
            secret = f"{run_dir}/rank-secret-{site}"
            with open(folder / secret, "x", opener=lambda p, f: os.open(p, f, 0o600)) as out:
                out.write(secrets.token_hex(32))
            for k, node in enumerate(n for n in cluster.nodes if n.site == site):
                argv, env = list(tasks[(site, k)]["argv"]), tasks[(site, k)]["env"]
                for flag, value in (("--run-dir", run_dir), ("--rank-secret-file", secret)):
                    argv[argv.index(flag) + 1] = value
                env = {key: v for key, v in env.items() if not key.startswith(SLURM_ENV)}
                with (folder / f"{site}-node{k}.out").open("w") as out:
                    procs.append(
                        subprocess.Popen(
                            node.as_node(f"exec isthmus {shlex.join(argv)}"), cwd=folder,
                            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                        )
                    )  # fmt: skip
        run_dirs = dict.fromkeys(SITES, run_dir)

        def ended() -> bool:
            return any(p.poll() for p in procs)

        figures, _ = measure(folder, run_dirs, t0, steps, warmup, ended)
        codes = [p.wait(test_slurm.JOB_TIMEOUT_S) for p in procs]
        assert codes == [0] * len(procs), f"{codes}\n{SlurmCluster.job_logs(folder)}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    _identical([folder / f"{s}-node0.out" for s in SITES])
    return figures


def _spread(runs: list[dict], mode: str, site: str, figure: str) -> str:
    values = [r["sites"][site][figure] for r in runs if r["mode"] == mode]
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each way")
    parser.add_argument("--steps", type=int, default=40, help="steps of each run")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of steps/s")
    results = Path(__file__).parent / "results"
    parser.add_argument("--out", type=Path, default=results / "slurm_multinode.json")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < args.warmup + 3:
        parser.error("--repeats must be >= 1 and --steps >= --warmup + 3")
    if os.geteuid() != 0 or missing_tools():
        parser.error(f"run as root with Slurm's tools installed (missing: {missing_tools()})")
    runs: list[dict] = []
    tasks: dict = {}
    print(f"{'run':>4} {'way':>7} {'site':>6} {'load':>5} {'to launcher s':>14} "
          f"{'to first step s':>16} {'steps/s':>8}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="slurm-bench-") as tmp:
        folder = Path(tmp)
        write_certs(folder / "certs", list(SITES))
        (folder / "cluster").mkdir()
        cluster = SlurmCluster(folder / "cluster", test_slurm.SPEC)
        try:
            cluster.start()
            job = test_slurm.write_job(
                folder / "job.toml", cluster, folder / "certs", 'lane_host = "0.0.0.0"',
                steps=args.steps,
            )  # fmt: skip
            for r in range(args.repeats):
                # slurm first (the direct run replays its tasks), then ABBA: each way
                # runs as often after the other as before it.
                for mode in ("slurm", "direct")[:: 1 if r % 2 == 0 else -1]:
                    where = folder / f"{mode}-{r + 1}"
                    where.mkdir()
                    load = os.getloadavg()[0]  # other work on the machine, for the spread
                    if mode == "slurm":
                        figures, tasks = run_slurm(cluster, where, job, args.steps, args.warmup)
                    else:
                        figures = run_direct(cluster, where, tasks, args.steps, args.warmup)
                    runs.append({"repeat": r + 1, "mode": mode, "load_1m": load, "sites": figures})
                    for site, f in figures.items():
                        print(f"{r + 1:>4} {mode:>7} {site:>6} {load:>5.1f} "
                              f"{f['to_launcher_s']:>14.2f} {f['to_first_step_s']:>16.2f} "
                              f"{f['steps_per_s']:>8.2f}", flush=True)  # fmt: skip
        finally:
            cluster.stop()
    digests = {f["digest"] for r in runs for f in r["sites"].values()}
    print(f"\nfinal digests: {len(digests)} distinct across every run of both ways")
    print(f"median [min-max] of {args.repeats} runs each way")
    print(f"{'':>16} {'site':>6} {'slurm':>20} {'direct':>20}")
    for figure in ("to_launcher_s", "to_first_step_s", "steps_per_s"):
        for site in SITES:
            print(f"{figure:>16} {site:>6} {_spread(runs, 'slurm', site, figure):>20} "
                  f"{_spread(runs, 'direct', site, figure):>20}")  # fmt: skip
    task = tasks[(SITES[0], 0)]
    slurm_vars = sorted(k for k in task["env"] if k.startswith(SLURM_ENV))
    # What else the task had that this shell has not (sbatch's --export, the test's PATH,
    # a login environment if Slurm loaded one): the direct run had it too.
    beyond = sorted(
        k for k in set(task["env"]) - set(slurm_vars) if os.environ.get(k) != task["env"][k]
    )
    record = {
        "date": datetime.date.today().isoformat(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "steps": args.steps,
        "warmup": args.warmup,
        "task_argv": task["argv"],
        "direct_env_dropped": slurm_vars,
        "task_env_beyond_submitter": beyond,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
