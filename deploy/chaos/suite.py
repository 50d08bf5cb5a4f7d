"""`isthmus chaos`: the fault-injection suite for failover, rejoin and integrity (issue 6).

Each scenario runs a real job on this machine -- one `isthmus site` process per site
(coordinator and ranks), the sites joined by emulated links of the WAN simulator --
and injects its faults while it trains: SIGKILL a site at step k, restart it,
partition a link for t seconds, corrupt chunks at rate p, slow one site down. It
passes when every site expected to survive exits 0 and all of them end with the same
parameter digest after the last step.

    isthmus chaos              # the full suite (several minutes)
    isthmus chaos --quick      # the subset CI runs
    isthmus chaos --only partition --keep runs/

A site is slowed with ISTHMUS_SLOWDOWN=F in its environment: each of its ranks sleeps
(F - 1) x its compute time after every step; ISTHMUS_STEP_FLOOR_S=T makes no step
shorter than T seconds until a site the job lost is back (deploy/rank/faults.py,
StepFloor).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

from isthmus.deploy.chaos.hostile_calls import flood, forge, forge_rejoin
from isthmus.deploy.chaos.judge import (
    FORGER_RECORD,
    ScenarioResult,
    against_baseline,
    fault_free,
    judge,
    metrics_records,
)
from isthmus.deploy.chaos.ports import free_ports
from isthmus.deploy.chaos.scenarios import SCENARIOS, Fault, Scenario
from isthmus.deploy.chaos.sites import NODE1, SiteProcess, node_argvs, site_processes
from isthmus.deploy.config.job import load_config
from isthmus.deploy.launch.local import slow_env
from isthmus.deploy.launch.ranks import AGENT_STOP_SIGNAL
from isthmus.deploy.rank.faults import LANE_THREADS_LOST_ENV
from isthmus.deploy.security.trust import site_security
from isthmus.inter.security import SiteSecurity
from isthmus.sim import Corrupt, Flap, FlowStall, Link, LinkSpec, RelayServer

__all__ = ["SCENARIOS", "Fault", "Scenario", "run_scenario", "run_suite"]

SITE_TIMEOUT_S = 360.0
"""A scenario whose survivors have not all exited this long after its start fails,
naming the first one and its log's tail: within the tests' 400 s limit, which
would show only thread stacks (a scenario takes 10-60 s on 2 cores)."""


def _job_file(scenario: Scenario, work: Path, ports: list[int], witness: str) -> Path:
    names = [f"site{i}" for i in range(scenario.sites)]
    coordinators = ", ".join(f'{n} = "127.0.0.1:{p}"' for n, p in zip(names, ports, strict=True))
    lines = [
        "[job]",
        f"steps = {scenario.steps}",
        "[topology]",
        f"sites = {scenario.sites}",
        f"ranks_per_site = {2 if scenario.two_nodes else 1}",
        "[model]",
        'preset = "tiny"',
        "[train]",
        "batch_size = 4",
        "seq_len = 64",
        "[sync]",
        'codec = "raw+zstd:1"',
        "timeout_s = 60.0",
        "[failover]",
        "failure_timeout_s = 2.0",
        "heartbeat_s = 0.25",
        "quorum_wait_s = 120.0",
        *([f'witness = "{witness}"'] if witness else []),
        "[run]",
        "digest_every = 2",
        # One held-out batch, not 16: no verdict reads the loss, and 16 forward passes
        # of 8 windows cost a 14-step job as much as ten of its steps.
        "eval_batches = 1",
        "tensorboard = false",
        "metrics_port = -1",
        "[cluster]",
        f"coordinators = {{ {coordinators} }}",
    ]
    path = work / "job.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_scenario(
    scenario: Scenario,
    work: Path,
    out: TextIO | None = None,
    overrides: tuple[str, ...] = (),
    script: Path | None = None,
) -> ScenarioResult:
    """Runs one scenario in ``work`` (kept for inspection); returns its result.

    ``overrides`` are ``KEY=VALUE`` settings given to every site (``--set``), e.g.
    ``sync.mode=diloco`` to run the scenario in another sync mode. ``script``: every
    rank runs it (``--script``, deploy/api.py) instead of the built-in trainer.
    """
    work.mkdir(parents=True, exist_ok=True)
    names = [f"site{i}" for i in range(scenario.sites)]
    ports = free_ports(scenario.sites + 1)
    witness_port = ports.pop()  # used only by a scenario with a witness
    witness = f"127.0.0.1:{witness_port}" if scenario.witness else ""
    overrides = (*scenario.settings, *overrides)
    job = _job_file(scenario, work, ports, witness)
    run_dir = work / "run"
    started = time.monotonic()
    relay = RelayServer().start()
    sites: dict[str, SiteProcess] = {}
    helpers: list[SiteProcess] = []
    try:
        if witness:
            argv = [sys.executable, "-m", "isthmus.deploy.cli", "witness", "--config", str(job)]
            argv += ["--listen", witness, *(a for o in overrides for a in ("--set", o))]
            helpers.append(SiteProcess("witness", argv, dict(os.environ), work / "witness"))
            helpers[0].start()
        links, proxies = _emulated_links(relay, names)
        for name in names:
            argv = [sys.executable, "-m", "isthmus.deploy.cli", "site", "--config", str(job)]
            argv += ["--site", name, "--run-dir", str(run_dir), "--quiet"]
            argv += ["--script", str(script)] if script is not None else []
            for peer, url in proxies[name].items():
                argv += ["--set", f"cluster.proxies.{peer}={url}"]
            for setting in overrides:
                argv += ["--set", setting]
            env = _site_env(scenario, name)
            if name not in scenario.two_nodes:
                sites[name] = SiteProcess(name, argv, env, work / name)
                continue
            for node, node_argv in enumerate(node_argvs(argv, work / f"{name}-secret")):
                key = name if node == 0 else f"{name}{NODE1}"
                sites[key] = SiteProcess(key, node_argv, env, work / key.replace("/", "-"))
        for fault in scenario.faults:
            if fault.kind == "corrupt":
                # 16 KiB+ pieces: gradient chunks (crc32), not control messages (TCP's, TLS's).
                impairment = (Corrupt(per_piece=fault.rate, min_piece_bytes=16384),)
                links[fault.link].set_impairments(impairment, impairment)
        for site in sites.values():
            site.start()
        coordinators = {n: f"127.0.0.1:{p}" for n, p in zip(names, ports, strict=True)}
        config = load_config(job, list(overrides))
        if config.data.tokenizer != "bytes":  # the sites' fingerprints carry its hash
            from isthmus.intra.corpus.cache import pin_tokenizer

            pin_tokenizer(config.data, seq_len=config.train.seq_len)
        fingerprint = config.fingerprint()
        # With TLS, hostile calls come with site0's certificate (a site of the job speaking
        # for another); else with the user's job token, which the sites run with.
        credentials = (
            site_security(config.security, "site0") if config.security.require_tls else None
        )
        _inject(scenario, sites, links, coordinators, fingerprint, run_dir, out, credentials)
        # One budget with the injection's wait (_inject), not a second one after it.
        deadline = started + SITE_TIMEOUT_S
        result = judge(scenario, sites, run_dir, deadline, tls=config.security.require_tls)
        result.wall_s = time.monotonic() - started
        return result
    finally:
        for site in [*sites.values(), *helpers]:
            site.kill()
        relay.close()


def _emulated_links(
    relay: RelayServer, names: list[str]
) -> tuple[dict[tuple[str, str], Link], dict[str, dict[str, str]]]:
    """A link between every two sites (1000 km is not the point here: 5 ms, 1 Gbit/s),
    and each site's CONNECT proxy URL to each peer."""
    links: dict[tuple[str, str], Link] = {}
    proxies: dict[str, dict[str, str]] = {n: {} for n in names}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            link = relay.add_link(
                f"{a}-{b}", LinkSpec.symmetric(latency_s=0.005, bandwidth_bps=1e9)
            )
            links[(a, b)] = link
            host, port = link.add_proxy(initiator="a")
            proxies[a][b] = f"http://{host}:{port}"
            host, port = link.add_proxy(initiator="b")
            proxies[b][a] = f"http://{host}:{port}"
    return links, proxies


def _site_env(scenario: Scenario, name: str) -> dict[str, str]:
    """A site's environment: the scenario's step floor and the faults its ranks inject."""
    env = {**os.environ, "no_grpc_proxy": "none.invalid", "PYTHONUNBUFFERED": "1"}
    env["ISTHMUS_STEP_FLOOR_S"] = str(scenario.pace_s)
    for fault in scenario.faults:
        if fault.kind == "slow" and fault.site == name:
            env.update(slow_env(fault.rate, fault.at_step))
        if fault.kind == "lane-threads" and fault.site == name:
            env[LANE_THREADS_LOST_ENV] = str(fault.at_step)
    return env


def _progress(run_dir: Path, names: list[str]) -> int:
    """Steps completed by the furthest site."""
    last = [(metrics_records(run_dir / "sites" / n / "metrics.jsonl") or [{}])[-1] for n in names]
    return max((record.get("step", -1) + 1 for record in last), default=0)


def _inject(
    scenario,
    sites,
    links,
    coordinators,
    fingerprint,
    run_dir: Path,
    out: TextIO | None,
    credentials: SiteSecurity | None,
) -> None:
    kinds = ("kill", "restart", "partition", "flood", "forge", "forge-rejoin", "stall-flow")
    pending = [f for f in scenario.faults if f.kind in (*kinds, "node-silent", "agent-kill")]
    deadline = time.monotonic() + SITE_TIMEOUT_S
    survivors = [sites[n] for n in scenario.survivors]
    names = [n for n in sites if NODE1 not in n]
    progress = functools.partial(_progress, run_dir, list(sites))
    restart_when_down: list[str] = []
    while time.monotonic() < deadline:
        _restart_the_failed(sites, restart_when_down)
        if not restart_when_down and all(
            s.process is not None and s.process.poll() is not None for s in survivors
        ):
            return
        done = _progress(run_dir, names)
        for fault in [f for f in pending if done >= f.at_step]:
            pending.remove(fault)
            if out is not None:
                print(f"  [{scenario.name}] step {done}: {fault.kind} {fault.site}", file=out)
            if fault.kind in ("kill", "restart"):
                sites[fault.site].kill()
                if fault.kind == "restart":
                    time.sleep(fault.duration_s)
                    sites[fault.site].start()
            elif fault.kind == "node-silent":
                node = sites[f"{fault.site}{NODE1}"]
                node.signal_group(signal.SIGSTOP)
                time.sleep(fault.duration_s)
                node.signal_group(signal.SIGCONT)
                restart_when_down.append(fault.site)
            elif fault.kind == "agent-kill":
                node = sites[f"{fault.site}{NODE1}"]
                assert node.process is not None
                node.process.send_signal(AGENT_STOP_SIGNAL)  # the launcher, not its ranks
            elif fault.kind == "partition":
                dark = (Flap(duration_s=fault.duration_s),)
                links[fault.link].set_impairments(dark, dark)
                links[fault.link].reset()  # open connections notice at once
            elif fault.kind == "stall-flow":
                # A bulk flow's frames (64 KiB), not a gRPC channel's pings and votes.
                stall = (FlowStall(count=1, duration_s=fault.duration_s, min_bytes=1 << 16),)
                links[fault.link].set_impairments(stall, stall)
            elif fault.kind == "flood":
                _in_thread(flood, coordinators[fault.site], fault.duration_s, credentials)
            elif fault.kind == "forge-rejoin":
                record = run_dir / FORGER_RECORD
                _in_thread(
                    forge_rejoin,
                    coordinators[fault.site],
                    coordinators["site1"],
                    fault.duration_s,
                    record=record,
                    credentials=credentials,
                    progress=progress,
                )
            elif fault.kind == "forge":
                _in_thread(
                    forge,
                    coordinators[fault.site],
                    fingerprint,
                    done,
                    fault.duration_s,
                    victims_coordinator=coordinators["site1"],
                    credentials=credentials,
                    progress=progress,
                )
        time.sleep(0.1)


def _in_thread(target: Callable, *args, **kwargs) -> None:
    threading.Thread(target=target, args=args, kwargs=kwargs, daemon=True).start()


def _restart_the_failed(sites: dict[str, SiteProcess], restart_when_down: list[str]) -> None:
    """A site of ``restart_when_down`` that left the job and one of whose launchers failed
    is ended and all started again, as srun's --kill-on-bad-exit ends the job's step and a
    requeue starts it again (its first node's launcher can outlive the site's leaving, its
    rank held in a collective with the lost node's)."""
    for name in list(restart_when_down):
        codes = [s.process.poll() if s.process else None for s in site_processes(sites, name)]
        if all(code == 0 for code in codes):  # never left: the judge says so
            restart_when_down.remove(name)
        if not any(code not in (None, 0) for code in codes):
            continue
        restart_when_down.remove(name)
        for site in site_processes(sites, name):
            site.kill()
        for site in site_processes(sites, name):
            site.start()


def run_suite(
    *,
    quick: bool = False,
    only: list[str] | None = None,
    keep: Path | None = None,
    repeat: int = 1,
    overrides: tuple[str, ...] = (),
    out=sys.stdout,
) -> list[ScenarioResult]:
    """Runs the chosen scenarios one after another, ``repeat`` rounds of them (a race
    shows only now and then); prints a table as it goes and, after several rounds,
    how often each scenario passed. ``overrides`` go to every site (``--set``)."""
    if repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {repeat}")
    chosen = [s for s in SCENARIOS if (not quick or s.quick) and (not only or s.name in only)]
    unknown = set(only or ()) - {s.name for s in SCENARIOS}
    if unknown:
        raise ValueError(
            f"unknown scenario(s) {sorted(unknown)}; known: {[s.name for s in SCENARIOS]}"
        )
    load_config(None, list(overrides))  # a bad setting fails here, in one line, not per site
    unfit = unfit_scenarios(chosen, overrides, named=bool(only))
    root = keep or Path(tempfile.mkdtemp(prefix="isthmus-chaos-"))
    results = []
    print(f"{'scenario':<14} {'result':<6} {'wall s':>7} {'gens':>4} {'retries':>7} "
          f"{'min live':>8} {'corrupt':>7} {'stalled':>7} {'goodput':>7}  rejoined", file=out)  # fmt: skip
    for name, why in unfit.items():
        print(f"{name:<14} {'skip':<6}  with these settings: {why}", file=out)
    chosen = [s for s in chosen if s.name not in unfit]
    for attempt in range(1, repeat + 1):
        for scenario in chosen:
            where = scenario.name if repeat == 1 else f"{scenario.name}-{attempt}"
            r = run_scenario(scenario, root / where, out=None, overrides=overrides)
            results.append(r)
            print(
                f"{r.name:<14} {'ok' if r.ok else 'FAIL':<6} {r.wall_s:7.1f} {r.generations:4d} "
                f"{r.retries:7d} {r.min_live_sites:8d} {r.corrupt_chunks:7d} {r.stalled_flows:7d} "
                f"{r.goodput.get('goodput_share', 0.0):7.0%}  {','.join(r.rejoined) or '-'}",
                file=out,
                flush=True,
            )
            if not r.ok:
                print(f"  why: {r.why} (logs: {root / where})", file=out)
            elif scenario.fault_free_baseline:
                base = run_scenario(
                    fault_free(scenario), root / f"{where}-baseline", None, overrides
                )
                print(against_baseline(r, base), file=out, flush=True)
    if repeat > 1:
        print(pass_counts(results), file=out)
    (root / "chaos.json").write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    print(f"results: {root / 'chaos.json'}", file=out)
    return results


def unfit_scenarios(
    chosen: list[Scenario], overrides: tuple[str, ...], *, named: bool
) -> dict[str, str]:
    """The chosen scenarios whose own settings the job's ``overrides`` cannot take
    (slow-balance re-balances per-step sync's micro-batches, so no outer mode runs it),
    each with the configuration's one-line refusal: the suite skips them, saying why.
    ValueError when one was ``named`` (``--only``)."""
    unfit = {}
    for scenario in chosen:
        try:
            load_config(None, [*scenario.settings, *overrides])
        except ValueError as exc:
            if named:
                raise ValueError(f"scenario {scenario.name}: {exc}") from None
            unfit[scenario.name] = str(exc)
    return unfit


def pass_counts(results: list[ScenarioResult]) -> str:
    """One line: how many runs of each scenario passed, in the order they ran."""
    counts: dict[str, list[int]] = {}
    for r in results:
        passed, runs = counts.setdefault(r.name, [0, 0])
        counts[r.name] = [passed + r.ok, runs + 1]
    return "passed: " + ", ".join(f"{name} {p}/{n}" for name, (p, n) in counts.items())
