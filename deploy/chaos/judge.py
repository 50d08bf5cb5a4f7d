"""The chaos suite's judge: did a scenario's survivors finish with identical replicas,
and did each of its faults leave the mark it must (deploy/chaos/suite.py runs them)?

A fault that must be seen (a corrupt chunk counted, a flood turned away, a forged call
found out) is read from what the sites wrote: their metrics, their launchers' output and
their ranks' logs, as an operator would read them.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from isthmus.deploy.chaos.hostile_calls import missed_forgeries, missed_rejoin_forgeries
from isthmus.deploy.chaos.scenarios import Scenario
from isthmus.deploy.chaos.sites import NODE1, SiteProcess
from isthmus.deploy.reports.goodput import goodput
from isthmus.deploy.reports.summary import merge_steps

__all__ = ["FORGER_RECORD", "ScenarioResult", "judge", "metrics_records"]

FORGER_RECORD = "forger.json"
"""What ``forge-rejoin``'s caller was answered, in the run folder, for the judge."""


@dataclass
class ScenarioResult:
    name: str
    ok: bool
    wall_s: float
    why: str = ""
    digests: dict[str, str] = field(default_factory=dict)
    generations: int = 1
    retries: int = 0
    min_live_sites: int = 0
    corrupt_chunks: int = 0
    stalled_flows: int = 0
    """Bulk connections the survivors left past a frame's deadline (metrics.jsonl)."""
    rejoined: list[str] = field(default_factory=list)
    micro_batches: dict[str, list[int]] = field(default_factory=dict)
    """Each survivor's micro-batches per rank, step by step (train.accumulate, balanced)."""
    goodput: dict = field(default_factory=dict)
    """The survivors' steps merged, as a run's summary has it (deploy/reports/goodput.py)."""
    final_loss: float = 0.0  # the survivors' merged last step's


def metrics_records(path: Path) -> list[dict]:
    """A metrics.jsonl's lines; one being written (not yet whole) is skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def judge(
    scenario: Scenario, sites: Mapping[str, SiteProcess], run_dir: Path, deadline: float, tls: bool
) -> ScenarioResult:
    """Waits (until ``deadline``, monotonic) for the survivors' launchers to exit 0,
    then reads what they wrote. ``wall_s`` is left for the caller to fill."""
    result = ScenarioResult(scenario.name, ok=False, wall_s=0.0)
    launchers = [key for name in scenario.survivors for key in (name, f"{name}{NODE1}")]
    for name in [key for key in launchers if key in sites]:
        process = sites[name].process
        assert process is not None
        try:
            code = process.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
        if code != 0:
            result.why = f"{name} exited with {code}: ...{sites[name].tail()}"
            return result
    per_site = {}
    for name in scenario.survivors:
        summary = json.loads((run_dir / "sites" / name / "summary.json").read_text())
        result.digests[name] = summary["digests"][name]
        per_site[name] = metrics_records(run_dir / "sites" / name / "metrics.jsonl")
        _read_metrics(scenario, result, name, per_site[name])
    merged = merge_steps(per_site)
    result.goodput, result.final_loss = goodput(merged), merged[-1]["loss"] if merged else 0.0
    if len(set(result.digests.values())) != 1:
        result.why = f"survivors' digests differ: {result.digests}"
    elif scenario.expect_generations and result.generations < 2:
        result.why = "the membership never changed"
    else:
        marks = _Marks(scenario, result, sites, run_dir, tls)
        result.why = next((why for fault in scenario.faults if (why := marks.missed(fault))), "")
        if not result.why and scenario.expect_rebalance:
            result.why = marks.rebalance()
    result.ok = not result.why
    return result


def _read_metrics(
    scenario: Scenario, result: ScenarioResult, name: str, records: list[dict]
) -> None:
    result.generations = max([result.generations] + [r.get("generation", 1) for r in records])
    result.retries += sum(r.get("retries", 0) for r in records)
    lives = [r.get("live_sites", scenario.sites) for r in records]
    result.min_live_sites = min([*lives, result.min_live_sites or scenario.sites])
    result.corrupt_chunks += sum(r.get("corrupt_chunks", 0) for r in records)
    result.stalled_flows += sum(r.get("stalled_flows", 0) for r in records)
    result.micro_batches[name] = [r.get("micro_batches", 1) for r in records]
    steps = [r.get("step", 0) for r in records]
    if steps and steps != list(range(steps[0], steps[0] + len(steps))) or steps[:1] > [0]:
        result.rejoined.append(name)  # its steps jump: it pulled a live peer's state


@dataclass
class _Marks:
    """The mark each kind of fault must leave; ``missed`` says why one is missing."""

    scenario: Scenario
    result: ScenarioResult
    sites: Mapping[str, SiteProcess]
    run_dir: Path
    tls: bool

    def missed(self, fault) -> str:
        check: Callable[..., str] | None = getattr(self, "_" + fault.kind.replace("-", "_"), None)
        return check(fault) if check is not None else ""

    def rank_log(self, site: str, rank: int = 0) -> str:
        try:
            return (self.run_dir / "logs" / f"{site}-rank{rank}.log").read_text(errors="replace")
        except OSError:
            return ""

    def rebalance(self) -> str:
        slowed = [f.site for f in self.scenario.faults if f.kind == "slow"]
        batches = self.result.micro_batches
        moved = [batches.get(n, [0])[-1] < batches.get(n, [0])[0] for n in slowed]
        if moved and all(moved):
            return ""
        return f"the slowed site kept its micro-batches: {batches}"

    def _corrupt(self, fault) -> str:
        result = self.result
        if not self.tls:
            return "" if result.corrupt_chunks else "no corrupt chunk was counted"
        # Under TLS a flipped bit ends its connection (MAC): lanes leave it, send again.
        if not result.stalled_flows or result.retries:
            return f"under TLS {result.stalled_flows} connections left, {result.retries} retries"
        return ""

    def _stall_flow(self, fault) -> str:
        if not self.result.stalled_flows:
            return "no stalled flow was counted (metrics.jsonl's stalled_flows)"
        if self.result.retries:
            return f"a stalled flow cost {self.result.retries} retried step(s): it was waited out"
        return ""

    def _flood(self, fault) -> str:
        if "slots busy" not in self.sites[fault.site].text():
            return "the flood was never turned away (no 'slots busy' in the site's log)"
        # Turned away for want of a slot, or before one: no pass granted to a peer site,
        # or (with TLS) a certificate that names no peer of the flooded site.
        if ": PushChunks stream " not in self.rank_log(fault.site):
            return "the lane's streams were never turned away (nothing in its rank's log)"
        return ""

    def _lane_threads(self, fault) -> str:
        if "new threads take over" not in self.rank_log(fault.site):
            return "the lane never lost its codec threads mid-round (nothing in its rank's log)"
        return ""

    def _agent_kill(self, fault) -> str:
        if "host agent stopped" in self.sites[f"{fault.site}{NODE1}"].text() and (
            "calling the coordinator" in self.rank_log(fault.site, 1)
        ):
            return ""
        return "the second node's agent never stopped, or its rank never went around it"

    def _forge(self, fault) -> str:
        if self.result.generations > 1:
            return "a forged call changed the membership"
        victims = self.sites["site1"].text()
        return missed_forgeries(self.sites[fault.site].text(), victims, self.rank_log(fault.site))

    def _forge_rejoin(self, fault) -> str:
        if "site1" not in self.result.rejoined:
            return "site1 never rejoined (its steps never jumped to site0's)"
        return missed_rejoin_forgeries(self.sites["site1"].text(), self.run_dir / FORGER_RECORD)


def fault_free(scenario: Scenario) -> Scenario:
    """The same job without its faults (nothing to judge but equal replicas)."""
    return replace(scenario, name=f"{scenario.name}-baseline", faults=(), expect_generations=False)


def against_baseline(result: ScenarioResult, baseline: ScenarioResult) -> str:
    """One line: goodput and final loss against the fault-free run's. The runs follow one
    another, so on a shared machine their tokens/s may meet different loads; each run's
    share of time not lost (against its own healthy step) is printed beside them."""
    rate, base = (r.goodput.get("goodput_tokens_per_s", 0.0) for r in (result, baseline))
    share, base_share = (r.goodput.get("goodput_share", 0.0) for r in (result, baseline))
    lost = ", ".join(f"{c} {s:.1f} s" for c, s in result.goodput.get("lost_s", {}).items() if s)
    return (
        f"  {result.name}: goodput {rate:,.0f} tokens/s, {rate / base:.0%} of the fault-free "
        f"run's {base:,.0f}; time not lost {share:.0%} against {base_share:.0%} (lost: "
        f"{lost or 'none'}); final loss {result.final_loss:.4f} against "
        f"{baseline.final_loss:.4f} ({result.final_loss / baseline.final_loss - 1:+.1%})"
        if base and baseline.final_loss
        else f"  {result.name}: the fault-free run measured nothing to compare with"
    )
