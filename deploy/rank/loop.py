"""The rank's steps, for the built-in trainer and a user's script alike.

`StepLoop` owns which step comes next (`steps`) and how a step ends (`end_step`): a
step whose sync found the job gone on without this site takes the live state and goes
on from where the job is; any other is paced as the rank's fault injection asks (a
slower site, a floor under each step: `isthmus local --slow`, `isthmus chaos`), recorded
(the digest when due, the metrics line), its state offered to a site the commit
admitted, and a checkpoint saved when due. Then `finish`: the final digest, the rank's
result and everything setup opened closed.

It has two users, so the two cannot drift: `train` below, the built-in trainer's loop
(its gradient path, pipeline and tensor parallel included, stays in intra's `Trainer`),
and the script API's `Context` (deploy/api.py), whose `steps` are these and whose
`step` applies the script's gradients, then ends the step here."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from isthmus.deploy.rank.checkpointing import save_due
from isthmus.deploy.rank.faults import StepFloor
from isthmus.deploy.rank.startup import RankParts
from isthmus.deploy.reports.egress import site_egress, spend_usd
from isthmus.inter.data import StepOutcome, SyncStats
from isthmus.intra.digest import shard_digest as intra_shard_digest
from isthmus.intra.train import StepStats, SyncResult


@dataclass(slots=True)
class LoopState:
    """Where the step loop is."""

    step: int  # the next step to train
    synced: int  # the last step that ended with replicas equal across sites
    started: float  # ``time.perf_counter()`` when the loop began
    digest: str = ""  # the site's parameter digest after the last step run, when due
    reported_last: bool = False  # the job's last step was trained and reported here
    egress_usd: float = 0.0  # what this site's bytes across sites cost so far


@dataclass(kw_only=True, slots=True)
class StepLine:
    """A committed step's measures, as its trainer took them: the part of its metrics
    line that the step loop does not know itself."""

    loss: float
    grad_norm: float
    lr: float
    tokens: int  # the site's, this step
    mfu: float = 0.0
    # More keys of the line (the batch plan's, the held-out loss, a script's own).
    more: dict[str, float] = field(default_factory=dict)


class StepLoop:
    """The steps a rank trains and each step's end (see the module docstring)."""

    def __init__(self, parts: RankParts) -> None:
        self.parts = parts
        self.progress = LoopState(
            step=parts.start, synced=parts.start - 1, started=time.perf_counter()
        )
        self.step_started = self.progress.started  # when the step in progress was handed out
        self._ended = True
        self._finished = False
        self._floor = StepFloor(parts.config.topology.sites, parts.start)

    @property
    def next_step(self) -> int:
        """The step to train next (after a rejoin, the job's)."""
        return self.progress.step

    def steps(self) -> Iterator[int]:
        """The steps to train, from ``parts.start`` (after a rejoin, from where the job is);
        each must end with :meth:`end_step`."""
        parts = self.parts
        total = parts.config.job.steps
        while self.progress.step < total:
            step = self.progress.step
            self.step_started = time.perf_counter()
            # A script's FSDP2 hooks tag the rounds they start with it (the built-in
            # Trainer sets its own again in its step).
            parts.trainer.step_in_progress = step
            parts.env.faults.before_step(step, parts.sync)
            self._ended = False
            yield step
            if not self._ended:
                raise RuntimeError(f"step {step}: call ctx.step() once per step")

    def end_step(
        self,
        synced: StepOutcome | None,
        compute_s: float,
        sync_s: float,
        line: Callable[[torch.Tensor, float], StepLine],
    ) -> bool:
        """Ends the step in progress, whose sync ended as ``synced`` (None: nothing
        crossed). ``line`` gives the step's other measures; called only for a committed
        step, at every rank of the site, it may run the site's collectives. False when
        the job went on without this site: the live state was pulled instead."""
        parts, progress = self.parts, self.progress
        step = progress.step
        self._ended = True
        if synced is not None and synced.rejoin is not None:
            assert parts.cross is not None
            progress.step = parts.cross.rejoin(parts.trainer, synced.rejoin)
            progress.synced = progress.step - 1
            self._floor.rejoined()
            return False
        live_sites, _ = _membership_now(parts, synced.stats if synced is not None else None)
        floor = self._floor.after_step(live_sites)
        slowed = parts.env.faults.pace(step, compute_s, sync_s, floor=floor)
        traffic = _site_traffic(synced.stats if synced is not None else None)
        measured = line(traffic, slowed)
        _record(parts, progress, step, synced, traffic, compute_s, sync_s, measured)
        if synced is not None and synced.offer_state is not None:
            # This site is the source of one the commit admitted: the state after step.
            assert parts.cross is not None
            parts.cross.offer_state(parts.trainer, synced.offer_state, step + 1)
        parts.checkpoints.save_if_due(parts.trainer, step + 1)
        progress.step = step + 1
        return True

    def finish(self) -> None:
        """After the last step (once): the final digest if this site did not report it,
        the rank's result file, and everything setup opened closed."""
        if self._finished:
            return
        self._finished = True
        parts, progress = self.parts, self.progress
        env, config, trainer, metrics = parts.env, parts.config, parts.trainer, parts.metrics
        digest = progress.digest
        if not progress.reported_last:
            # This site joined (or rejoined) with the state after the last step: admitted
            # at the job's last commit (in DiLoCo, its last round). Nothing was left to
            # train; the other sites still wait for its final digest.
            digest = trainer.parameter_digest()
            metrics.report_final_digest(config.job.steps, digest)
        train_s = time.perf_counter() - progress.started
        metrics.close()
        result = {
            "site": env.site,
            "rank": env.rank,
            "digest": digest,
            "shard_digest": intra_shard_digest(trainer.model_parts),
            "train_s": train_s,
            "steps": config.job.steps,
            **metrics.totals,
        }
        (parts.site_dir / f"rank{env.rank}.json").write_text(json.dumps(result))
        dist.barrier()
        if parts.cross is not None:
            parts.cross.close()
        dist.destroy_process_group()


def train(loop: StepLoop) -> None:
    """The built-in trainer's loop: each step's batch (as the batch plan sizes it), the
    ``Trainer``'s step (its gradients cross in its hook; DiLoCo's rounds, started every H
    steps, land ``delay`` steps later), then the step's end through ``loop``."""
    parts = loop.parts
    plan = parts.plan
    for step in loop.steps():
        if plan is not None:
            plan.before_step(step)  # a ramp may resize this step's batch
        # Micro-batches, global batch: what this step trains (a decision applies next).
        batch = plan.record() if plan is not None else {}
        inputs, targets = parts.batches.batch(step)
        stats, synced = _step(parts, step, inputs, targets)
        line = partial(_step_line, parts, stats, batch)
        loop.end_step(synced, stats.compute_s, stats.sync_s, line)


def _step_line(
    parts: RankParts,
    stats: StepStats,
    batch: dict[str, float],
    traffic: torch.Tensor,
    slowed: float,
) -> StepLine:
    """A built-in step that committed: the batch plan's measures, the held-out loss
    when due, and what its metrics line says of them."""
    step, outer, plan = stats.step, parts.outer, parts.plan
    if plan is not None:
        plan.after_step(
            step,
            # The site's own work, slowdown and all; the wait for other sites is not.
            compute_s=stats.compute_s + slowed,
            site_sq_norm=float(traffic[5]),
            global_sq_norm=stats.grad_norm**2,
        )
    # The held-out loss, of the model the sites share (equal everywhere).
    held_out = parts.held_out
    val = held_out.measure(parts.trainer, outer) if held_out.due(step) else None
    return StepLine(
        loss=stats.loss,
        grad_norm=stats.grad_norm,
        lr=stats.lr,
        tokens=stats.site_tokens,
        mfu=stats.mfu,
        more={
            **batch,
            **({"val_loss": val[0], "eval_s": val[1]} if val else {}),
            **stats.moe_metrics(),
        },
    )


def _record(
    parts: RankParts,
    progress: LoopState,
    step: int,
    synced: StepOutcome | None,
    traffic: torch.Tensor,
    compute_s: float,
    sync_s: float,
    measured: StepLine,
) -> None:
    """A committed step's digest when due and its line in the metrics (metrics.jsonl,
    TensorBoard, the coordinator's progress); ``traffic`` is ``_site_traffic``'s."""
    digest_started = time.perf_counter()
    progress.digest = _digest_if_due(parts, progress, step, synced is not None)
    # Steady-state throughput leaves digests out (summary.py): a check, not training.
    digest_s = time.perf_counter() - digest_started if progress.digest else 0.0
    last = parts.config.job.steps - 1
    outer = parts.outer
    round_stats = synced.stats if synced is not None else None
    live_sites, generation = _membership_now(parts, round_stats)
    line = {
        "site": parts.env.site,
        "step": step,
        "loss": measured.loss,
        "grad_norm": measured.grad_norm,
        "lr": measured.lr,
        "compute_s": compute_s,
        "sync_s": sync_s,
        "tokens": measured.tokens,
        "mfu": measured.mfu,
        "bytes_sent": int(traffic[0]),
        "raw_bytes": int(traffic[1]),
        "corrupt_chunks": int(traffic[2]),
        "nonfinite_chunks": int(traffic[3]),
        "stalled_flows": int(traffic[4]),
        "elapsed_s": time.perf_counter() - progress.started,
        # What the optimizer step waited for the cross-site sync (the part
        # not hidden behind backward), and how long the rounds ran.
        "exposed_sync_s": round_stats.wait_s if round_stats else 0.0,
        "sync_busy_s": round_stats.sync_s if round_stats else 0.0,
        "hidden_sync_s": max(0.0, round_stats.sync_s - round_stats.wait_s) if round_stats else 0.0,
        "links": _links(parts),
        "digest_s": digest_s,
        **measured.more,
        "live_sites": live_sites,
        "generation": generation,
        "retries": round_stats.retries if round_stats else 0,
        "outer_steps": outer.outer_steps if outer is not None else 0,
    }
    _count_egress(parts, progress, line)
    if parts.cross is not None and parts.cross.pulled is not None:  # goodput's rejoins
        line["state_pull_s"], line["state_pull_bytes"] = parts.cross.pulled
        parts.cross.pulled = None
    parts.metrics.record(line, digest=progress.digest, finished=step == last)
    progress.reported_last = step == last


def _count_egress(parts: RankParts, progress: LoopState, line: dict) -> None:
    """Adds the step's egress to the site's spend, and says once when it passes the budget."""
    wan, site = parts.config.wan, parts.env.site
    if parts.metrics.file is None or not (wan.egress_usd_per_gb or wan.egress_prices):
        return
    peers = [s for s in parts.config.site_names if s != site]
    sent = {f"{site}->{p}": b for p, b in site_egress(line, peers).items()}
    before, progress.egress_usd = progress.egress_usd, progress.egress_usd + spend_usd(sent, wan)
    budget = wan.egress_budget_usd
    if budget and before <= budget < progress.egress_usd:
        spent = f"${progress.egress_usd:.2f} passed wan.egress_budget_usd ${budget:.2f}"
        logging.getLogger("isthmus.rank").warning(
            "[%s step %d] egress %s", site, line["step"], spent
        )


def _links(parts: RankParts) -> dict[str, dict]:
    """Rank 0's lane's link to each peer site since its last line (``RankSync.links``),
    with the achieved rate's share of wan.bandwidth_mbit (docs/measure.md, "Links, live")."""
    if parts.cross is None or parts.metrics.file is None:
        return {}
    links = parts.cross.link.links()
    for figures in links.values():
        gbit = figures["gbit_s"]
        figures["line_share"] = gbit * 1e3 / parts.config.wan.bandwidth_mbit if gbit else None
    return links


def _step(
    parts: RankParts, step: int, inputs: torch.Tensor, targets: torch.Tensor
) -> tuple[StepStats, StepOutcome | None]:
    """Trains ``step`` (and its outer step): its stats, and how its sync ended (the step's
    own, the outer round that landed after it, or None when nothing crossed)."""
    stats = parts.trainer.step(step, inputs, targets)
    outer = parts.outer
    if outer is None:
        return stats, lane_outcome(stats.sync)
    t_outer = time.perf_counter()
    landed = outer_step(parts, step)
    stats.sync_s = time.perf_counter() - t_outer
    return stats, landed


def outer_step(parts: RankParts, step: int) -> StepOutcome | None:
    """The outer modes' step after the site's own ``step`` (DiLoCo, streaming): the
    round due now starts, the one due lands; before a checkpoint, a round still in
    flight lands too (a checkpoint holds none). None when nothing crossed."""
    outer = parts.outer
    assert outer is not None
    landed = outer.step(step)
    if (
        (landed is None or landed.committed)
        and outer.in_flight
        and save_due(parts.config, step + 1)
    ):
        landed = outer.finish()  # a checkpoint holds no round in flight
    return lane_outcome(landed)


def lane_outcome(result: SyncResult | None) -> StepOutcome | None:
    """The lane's outcome behind intra's ``SyncResult`` (a job's sync is the lane's)."""
    assert result is None or isinstance(result, StepOutcome), result
    return result


def _membership_now(parts: RankParts, round_stats: SyncStats | None) -> tuple[int, int]:
    """The live sites and the generation after a step: its round's, or (a step that
    did not cross, in DiLoCo) the rank's membership now; (1, 0) for one site."""
    if round_stats is not None:
        return round_stats.sites, round_stats.generation
    if parts.cross is not None:
        membership = parts.cross.link.membership  # the one sync.membership holds, never None
        return len(membership.sites), membership.generation
    return 1, 0


def _site_traffic(rs: SyncStats | None) -> torch.Tensor:
    """Site totals of what crossed the WAN this step (a collective; every rank has its own
    lane): bytes sent, raw bytes, corrupt and non-finite chunks, stalled bulk connections,
    and the squared norm of the site's own mean gradient when it was measured (its ranks'
    shards add up to it; a tensor-parallel replica of a norm weight counts tp times)."""
    traffic = torch.tensor(
        [
            *(rs.bytes_sent, rs.raw_bytes, rs.corrupt_chunks, rs.nonfinite_chunks),
            *(rs.stalled_flows, rs.local_sq_norm),
        ]
        if rs
        else [0] * 6,
        dtype=torch.float64,
    )
    dist.all_reduce(traffic)
    return traffic


def _digest_if_due(parts: RankParts, progress: LoopState, step: int, crosses: bool) -> str:
    """The site's digest after ``step`` when one is due, else "" (every rank joins the
    gather; sites compare them, invariant 1). Replicas are equal only after a step that
    synced (every step, or one where a DiLoCo round landed: then with a delay only the
    anchors are, until the last step): digest the first of those at or past each
    multiple of ``run.digest_every``."""
    config, outer = parts.config, parts.outer
    last = config.job.steps - 1
    every = config.run.digest_every
    due = step == last or (every and (step + 1) // every > (progress.synced + 1) // every)
    if not (parts.sync is None or crosses):
        return ""
    progress.synced = step
    if due and outer is not None and not outer.replicas_equal_on_landing and step != last:
        return outer.anchor_digest()  # parameters differ by local progress
    if due:
        return parts.trainer.parameter_digest()
    return ""
