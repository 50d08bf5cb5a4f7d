"""The per-rank training program: one process of one site.

Started by a launcher (`isthmus local`, later torchrun or srun) with torchrun's
variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) describing the
*site's* world, plus:

    ISTHMUS_CONFIG       path of the resolved job config (TOML)
    ISTHMUS_SITE         this site's name
    ISTHMUS_COORDINATOR  host:port of this site's coordinator (multi-site jobs)
    ISTHMUS_PROXIES      JSON {peer site: HTTP CONNECT proxy URL} of the emulated links
    ISTHMUS_RUN_DIR      where metrics and results go
    ISTHMUS_SLOWDOWN, ISTHMUS_STEP_FLOOR_S   fault injection (`isthmus chaos`)

It builds the site's mesh, model and FSDP2 trainer; for a multi-site job it starts
its lane, registers with the coordinator, learns its peers (the rank with the same
coordinate in every other site) and hands the trainer a LaneGradientSync. Rank 0
writes one metrics line per step; every rank writes its result at the end.

`run` is the rank's three phases: `set_up` (deploy/rank/startup.py) builds it all,
`train` is the step loop, `tear_down` reports the final digest, writes the rank's
result and closes what setup opened.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import faulthandler
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
import torch.distributed as dist

from isthmus.deploy.config.job import JobConfig, load_config
from isthmus.deploy.rank.checkpointing import save_due, save_if_due
from isthmus.deploy.rank.contract import SCRIPT_ENV
from isthmus.deploy.rank.reporting import DivergenceError
from isthmus.deploy.rank.startup import (
    FaultInjection,
    RankEnv,
    RankParts,
    build_trainer,
    script_ended,
    set_up,
)
from isthmus.inter.data import NonFiniteGradient, QuorumLost, StepOutcome, SyncStats
from isthmus.intra.checkpoint import CheckpointError
from isthmus.intra.checkpoint_failures import describe_os_error
from isthmus.intra.digest import shard_digest as intra_shard_digest
from isthmus.intra.train import StepStats, SyncResult

__all__ = ["LoopState", "RankEnv", "build_trainer", "main", "run", "tear_down", "train"]

log = logging.getLogger("isthmus.rank")

RESERVE_BYTES = 64 << 10
"""Disk space a rank holds back, in a file beside its log, for its last words: on a
full disk its error line would not reach the log, where the launcher reads it, and
the job would stop with an empty reason (issue 33, row 12)."""
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})
"""Failures of the rank's storage, reported in one line rather than as a traceback."""


def run(env: RankEnv, config: JobConfig) -> None:
    """One rank's life: setup, the step loop, teardown."""
    parts = set_up(env, config)
    progress = train(parts, env.faults)
    tear_down(parts, progress)


@dataclass(slots=True)
class LoopState:
    """Where the step loop is."""

    step: int
    """The next step to train."""
    synced: int
    """The last step that ended with replicas equal across sites."""
    started: float
    """``time.perf_counter()`` when the loop began."""
    digest: str = ""
    """The site's parameter digest after the last step run, when one was due."""
    reported_last: bool = False
    """The job's last step was trained and reported here."""


def train(parts: RankParts, faults: FaultInjection) -> LoopState:
    """Trains from ``parts.start`` to the job's last step; returns where it ended.

    Per-step sync: every step's gradients cross (in the trainer's hook). DiLoCo: the
    outer optimizer's rounds, started every H steps, land ``delay`` steps later. A
    step whose sync finds that the job went on without this site pulls the live state
    and goes on from where the job is.
    """
    config = parts.config
    progress = LoopState(step=parts.start, synced=parts.start - 1, started=time.perf_counter())
    plan = parts.plan
    while progress.step < config.job.steps:
        step = progress.step
        if plan is not None:
            plan.before_step(step)  # a ramp may resize this step's batch
        # Micro-batches, global batch: what this step trains (a decision applies next).
        batch = plan.record() if plan is not None else {}
        inputs, targets = parts.batches.batch(step)
        stats, synced = _step(parts, step, inputs, targets)
        if synced is not None and synced.rejoin is not None:
            # The job went on without this site while it was cut off: nothing of this
            # step's sync was applied; take the live state and go on from where the job is.
            assert parts.cross is not None
            progress.step = parts.cross.rejoin(parts.trainer, synced.rejoin)
            progress.synced = progress.step - 1
            continue
        _report_step(parts, faults, progress, step, stats, synced, batch)
        _offer_and_save(parts, step, synced)
        progress.step += 1
    return progress


def _report_step(
    parts: RankParts,
    faults: FaultInjection,
    progress: LoopState,
    step: int,
    stats: StepStats,
    synced: StepOutcome | None,
    batch: dict[str, float],
) -> None:
    """After a step that committed: the injected slowdown, the batch plan's measures,
    the digest when due, the held-out loss when due, and the step's line in the metrics."""
    outer, plan, last = parts.outer, parts.plan, parts.config.job.steps - 1
    slowed = faults.pace(step, stats.compute_s, stats.sync_s)
    crosses = synced is not None
    round_stats = synced.stats if synced is not None else None
    traffic = _site_traffic(round_stats)
    if plan is not None:
        plan.after_step(
            step,
            # The site's own work, slowdown and all; the wait for other sites is not.
            compute_s=stats.compute_s + slowed,
            site_sq_norm=float(traffic[4]),
            global_sq_norm=stats.grad_norm**2,
        )
    digest_started = time.perf_counter()
    progress.digest = _digest_if_due(parts, progress, step, crosses)
    # Steady-state throughput leaves digests out (summary.py): a check, not training.
    digest_s = time.perf_counter() - digest_started if progress.digest else 0.0
    # The held-out loss, of the model the sites share (equal everywhere).
    held_out = parts.held_out
    val = held_out.measure(parts.trainer, outer) if held_out.due(step) else None
    parts.metrics.record(
        step_line(
            parts,
            progress,
            round_stats,
            traffic,
            step=step,
            loss=stats.loss,
            grad_norm=stats.grad_norm,
            lr=stats.lr,
            compute_s=stats.compute_s,
            sync_s=stats.sync_s,
            tokens=stats.site_tokens,
            mfu=stats.mfu,
            digest_s=digest_s,
            more={
                **batch,
                **({"val_loss": val[0], "eval_s": val[1]} if val else {}),
                **stats.moe_metrics(),
            },
        ),
        digest=progress.digest,
        finished=step == last,
    )
    progress.reported_last = step == last


def _offer_and_save(parts: RankParts, step: int, synced: StepOutcome | None) -> None:
    """Offer the state after ``step`` to a site the commit admitted, if this one is its
    source; then save a checkpoint when one is due."""
    env, config, sync, outer, plan = parts.env, parts.config, parts.sync, parts.outer, parts.plan
    if synced is not None and synced.offer_state is not None:
        assert parts.cross is not None
        parts.cross.offer_state(parts.trainer, synced.offer_state, step + 1)
    save_if_due(
        parts.trainer,
        sync,
        config,
        env.run_dir,
        env.site,
        step + 1,
        parts.key,
        outer,
        plan,
    )


def step_line(
    parts: RankParts,
    progress: LoopState,
    round_stats: SyncStats | None,
    traffic: torch.Tensor,
    *,
    step: int,
    loss: float,
    grad_norm: float,
    lr: float,
    compute_s: float,
    sync_s: float,
    tokens: int,
    mfu: float,
    digest_s: float,
    more: dict,
) -> dict:
    """A step's metrics line (metrics.jsonl, TensorBoard, the coordinator's progress):
    the built-in trainer's and a script's (deploy/api.py) alike. ``tokens`` are the
    site's; ``traffic`` is ``_site_traffic``'s; ``more`` adds keys."""
    outer = parts.outer
    live_sites, generation = _membership_now(parts, round_stats)
    return {
        "site": parts.env.site,
        "step": step,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": lr,
        "compute_s": compute_s,
        "sync_s": sync_s,
        "tokens": tokens,
        "mfu": mfu,
        "bytes_sent": int(traffic[0]),
        "raw_bytes": int(traffic[1]),
        "corrupt_chunks": int(traffic[2]),
        "nonfinite_chunks": int(traffic[3]),
        "elapsed_s": time.perf_counter() - progress.started,
        # What the optimizer step waited for the cross-site sync (the part
        # not hidden behind backward), and how long the rounds ran.
        "exposed_sync_s": round_stats.wait_s if round_stats else 0.0,
        "sync_busy_s": round_stats.sync_s if round_stats else 0.0,
        "digest_s": digest_s,
        **more,
        "live_sites": live_sites,
        "generation": generation,
        "retries": round_stats.retries if round_stats else 0,
        "outer_steps": outer.outer_steps if outer is not None else 0,
    }


def _step(
    parts: RankParts, step: int, inputs: torch.Tensor, targets: torch.Tensor
) -> tuple[StepStats, StepOutcome | None]:
    """Trains ``step`` (and, in the outer modes, runs its outer step).

    Returns:
        The step's stats, and how its cross-site sync ended: the step's own (per-step
        sync), the outer round's that landed after it (outer modes), or None when
        nothing crossed. A sync that did not commit (rejoin) applied nothing.
    """
    stats = parts.trainer.step(step, inputs, targets)
    outer = parts.outer
    if outer is None:
        return stats, _lane_outcome(stats.sync)
    t_outer = time.perf_counter()
    landed = outer.step(step)
    if (
        (landed is None or landed.committed)
        and outer.in_flight
        and save_due(parts.config, step + 1)
    ):
        landed = outer.finish()  # a checkpoint holds no round in flight
    stats.sync_s = time.perf_counter() - t_outer
    return stats, _lane_outcome(landed)


def _lane_outcome(result: SyncResult | None) -> StepOutcome | None:
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
    """Site totals of what crossed the WAN this step (every rank has its own lane):
    bytes sent, raw bytes, corrupt and non-finite chunks, and the squared norm of the
    site's own mean gradient when it was measured (its ranks' shards add up to it;
    a tensor-parallel replica of a norm weight counts tp times). A collective of the
    site."""
    traffic = torch.tensor(
        [rs.bytes_sent, rs.raw_bytes, rs.corrupt_chunks, rs.nonfinite_chunks, rs.local_sq_norm]
        if rs
        else [0, 0, 0, 0, 0],
        dtype=torch.float64,
    )
    dist.all_reduce(traffic)
    return traffic


def _digest_if_due(parts: RankParts, progress: LoopState, step: int, crosses: bool) -> str:
    """The site's digest after ``step`` when one is due, else "" (every rank joins the
    digest's gather; sites compare them, invariant 1).

    Replicas are equal only after a step that synced (every step, or one where a
    DiLoCo round landed: then with a delay only the anchors are, until the last step):
    digest the first of those at or past each multiple of ``run.digest_every``.
    """
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


def tear_down(parts: RankParts, progress: LoopState) -> None:
    """After the last step: the final digest if this site did not report it, the rank's
    result file, and the lane, coordinator channel and process group closed."""
    env, config, trainer, metrics = parts.env, parts.config, parts.trainer, parts.metrics
    digest = progress.digest
    if not progress.reported_last:
        # This site joined (or rejoined) with the state after the last step: admitted at
        # the job's last commit (in DiLoCo, its last round). Nothing was left to train;
        # the other sites still wait for its final digest.
        digest = trainer.parameter_digest()
        metrics.report_final_digest(config.job.steps, digest)
    train_s = time.perf_counter() - progress.started
    metrics.close()
    shard_digest = intra_shard_digest(trainer.model_parts)
    result = {
        "site": env.site,
        "rank": env.rank,
        "digest": digest,
        "shard_digest": shard_digest,
        "train_s": train_s,
        "steps": config.job.steps,
        **metrics.totals,
    }
    (parts.site_dir / f"rank{env.rank}.json").write_text(json.dumps(result))
    dist.barrier()
    if parts.cross is not None:
        parts.cross.close()
    dist.destroy_process_group()


class ScriptError(Exception):
    """The user's script raised: its traceback is in the rank's log, its last line here."""


def run_script(argv: list[str]) -> None:
    """Runs the user's script (``--script PATH ARGS``) as this rank, as torchrun would:
    ``__main__``, ``sys.argv`` its own; it trains through ``isthmus.deploy.api``. What
    it raises ends the rank with the traceback's last line (the job's one error line);
    a script that returns without ``ctx.finish()`` is torn down here."""
    import runpy
    import traceback

    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise ScriptError(f"{argv[0]} exited with {exc.code}") from None
    except Exception as exc:
        traceback.print_exc()
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        raise ScriptError(f"{argv[0]}: {last}") from None
    script_ended()


def die_with_launcher() -> None:
    """Ask Linux to SIGKILL this rank when its launcher dies: no orphans, ever."""
    launcher = os.environ.get("ISTHMUS_LAUNCHER_PID")
    if not launcher:
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != int(launcher):  # the launcher died before the prctl took hold
        sys.exit(143)


class LastWords:
    """The rank's one error line, delivered to its log even when the disk is full: a
    reserve of ``RESERVE_BYTES`` taken at start is given back just before the line is
    written (and at exit). Where the run folder has no ``logs/`` (a launcher of its
    own), nothing is reserved."""

    def __init__(self, env: RankEnv) -> None:
        self.prefix = f"[{env.site}/{env.rank}]"
        self.reserve: Path | None = env.run_dir / "logs" / f".{env.site}-rank{env.rank}.reserve"
        try:
            self.reserve.write_bytes(bytes(RESERVE_BYTES))  # zeros: real blocks, not a hole
        except OSError:  # no logs/ here, or already full: nothing held back
            self.release()
            self.reserve = None

    def say(self, text: str) -> int:
        """Print ``error: [site/rank] text`` to stderr (the rank's log); returns 1."""
        line = f"error: {self.prefix} {text}"
        try:
            print(line, file=sys.stderr, flush=True)
        except OSError:  # the log's disk is full: free the reserve, then say it once more
            self.release()
            with contextlib.suppress(OSError):
                print(line, file=sys.stderr, flush=True)
        return 1

    def release(self) -> None:
        if self.reserve is not None:
            with contextlib.suppress(OSError):
                self.reserve.unlink(missing_ok=True)


def main() -> int:
    die_with_launcher()
    env = RankEnv.from_environ()
    config = load_config(os.environ["ISTHMUS_CONFIG"])
    logging.basicConfig(
        level=config.run.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [{env.site}/{env.rank}] %(name)s: %(message)s",
    )
    # The launcher stops ranks with SIGTERM; exit quietly rather than with a traceback.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # `kill -USR1` prints every thread's stack to the rank's log: how a stuck rank is read.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    last_words = LastWords(env)
    script = os.environ.get(SCRIPT_ENV)
    try:
        if script:
            run_script(json.loads(script))
        else:
            run(env, config)
    except ScriptError as exc:
        return last_words.say(str(exc))
    except grpc.RpcError as exc:
        return last_words.say(str(exc.details()))
    except (DivergenceError, QuorumLost, NonFiniteGradient, CheckpointError) as exc:
        return last_words.say(str(exc))
    except OSError as exc:
        if exc.errno not in DISK_ERRNOS:
            raise
        # "no space left on device (ENOSPC) writing /run/x": a failed write() names no
        # file, so then the run folder.
        return last_words.say(describe_os_error(exc, f"a file under {env.run_dir}"))
    finally:
        last_words.release()
    return 0


if __name__ == "__main__":
    code = main()
    # Everything the rank owes is written and closed (its result file, metrics, lanes,
    # process group). Python's own teardown of torch, gloo and gRPC state took ~2 s
    # more per rank on a 2-core machine, and every launcher waited for it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
