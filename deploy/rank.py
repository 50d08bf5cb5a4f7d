"""The per-rank training program: one process of one site.

Started by a launcher (`isthmus local`, later torchrun or srun) with torchrun's
variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) describing the
*site's* world, plus:

    ISTHMUS_CONFIG       path of the resolved job config (TOML)
    ISTHMUS_SITE         this site's name
    ISTHMUS_COORDINATOR  host:port of this site's coordinator (multi-site jobs)
    ISTHMUS_PROXIES      JSON {peer site: HTTP CONNECT proxy URL} of the emulated links
    ISTHMUS_RUN_DIR      where metrics and results go

It builds the site's mesh, model and FSDP2 trainer; for a multi-site job it starts
its lane, registers with the coordinator, learns its peers (the rank with the same
coordinate in every other site) and hands the trainer a LaneGradientSync. Rank 0
writes one metrics line per step; every rank writes its result at the end.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import grpc
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from isthmus.deploy.checkpointing import restore, save_due, save_if_due
from isthmus.deploy.config import JobConfig, load_config
from isthmus.deploy.corpus import load_corpus
from isthmus.deploy.cross_site import CrossSite
from isthmus.deploy.evaluation import HeldOutLoss
from isthmus.deploy.reporting import DivergenceError, StepReporter
from isthmus.inter.membership import QuorumLost, RejoinRequired
from isthmus.inter.round import NonFiniteGradient
from isthmus.intra.data import ShardedBatches
from isthmus.intra.digest import shard_digest as intra_shard_digest
from isthmus.intra.flops import scaled_lr
from isthmus.intra.layout import ParallelLayout
from isthmus.intra.model import build_model
from isthmus.intra.outer import OuterConfig, OuterOptimizer
from isthmus.intra.topology import build_site_mesh, mesh_coordinate
from isthmus.intra.train import GradientSync, TrainConfig, Trainer

log = logging.getLogger("isthmus.rank")

SLOWDOWN = float(os.environ.get("ISTHMUS_SLOWDOWN", "1"))
"""Fault injection for `isthmus chaos`: each step's compute takes this many times longer."""
STEP_FLOOR_S = float(os.environ.get("ISTHMUS_STEP_FLOOR_S", "0"))
"""Pacing for `isthmus chaos`: no step is shorter than this, so a job still runs when a
restarted or cut-off site comes back, whatever the hardware."""


@dataclass(kw_only=True, slots=True)
class RankEnv:
    """Where this process sits, read from the environment."""

    site: str
    rank: int
    world_size: int
    run_dir: Path
    coordinator: str
    proxies: dict[str, str]

    @classmethod
    def from_environ(cls) -> RankEnv:
        env = os.environ
        # Under srun without torchrun: take the rank layout from Slurm's variables
        # (torch.distributed's env:// rendezvous reads RANK and WORLD_SIZE too).
        for ours, slurm in (
            ("RANK", "SLURM_PROCID"),
            ("WORLD_SIZE", "SLURM_NTASKS"),
            ("LOCAL_RANK", "SLURM_LOCALID"),
        ):
            if ours not in env and slurm in env:
                env[ours] = env[slurm]
        return cls(
            site=env["ISTHMUS_SITE"],
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            run_dir=Path(env["ISTHMUS_RUN_DIR"]),
            coordinator=env.get("ISTHMUS_COORDINATOR", ""),
            proxies=json.loads(env.get("ISTHMUS_PROXIES", "{}")),
        )


def run(env: RankEnv, config: JobConfig) -> None:
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dev = config.device_type
    layout = ParallelLayout.for_ranks(
        config.topology.ranks_per_site, pp=config.topology.pp, tp=config.topology.tp
    )
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # On GPUs NCCL carries the tensors and gloo the few CPU-side collectives
    # (the per-step traffic totals), in one process group.
    dist.init_process_group(
        "cuda:nccl,cpu:gloo" if dev == "cuda" else "gloo",
        timeout=timedelta(seconds=config.sync.timeout_s),
    )
    mesh = build_site_mesh(layout, dev)
    pp_i, dp_i, tp_i = mesh_coordinate(mesh)
    # Lanes pair ranks by rank number: with one layout everywhere and row-major rank
    # order (tp innermost), equal ranks sit at equal (pp, dp, tp) coordinates.
    assert env.rank == (pp_i * layout.dp + dp_i) * layout.tp + tp_i, (env.rank, pp_i, dp_i, tp_i)
    sites = config.site_names
    site_index = sites.index(env.site)

    sync = cross = None
    # A rank uses its site's certificate, and its launcher's token for the run if any.
    security = config.site_security(env.site, os.environ.get("ISTHMUS_RUN_TOKEN"))
    if len(sites) > 1:
        cross = CrossSite.start(
            site=env.site,
            rank=env.rank,
            world_size=env.world_size,
            coordinator=env.coordinator,
            proxies=env.proxies,
            config=config,
            security=security,
        )
        sync = cross.sync

    # DiLoCo and Streaming DiLoCo: each site steps alone, an outer optimizer syncs.
    streaming = config.sync.mode == "streaming"
    diloco = streaming or config.sync.mode == "diloco"
    trainer = build_trainer(config, mesh, layout, len(sites), cuda=dev == "cuda", sync=sync)
    outer = None
    if diloco and sync is not None:
        assert cross is not None
        outer = cross.outer = OuterOptimizer(
            trainer,
            sync,
            OuterConfig(
                inner_steps=config.sync.inner_steps,
                lr=config.sync.outer_lr,
                momentum=config.sync.outer_momentum,
                delay=config.sync.outer_delay,
                # DiLoCo is Streaming DiLoCo with one fragment and the eager merge.
                fragments=config.sync.fragments if streaming else 1,
                alpha=config.sync.fragment_alpha if streaming else None,
            ),
            total_steps=config.job.steps,
            begin_step=sync.begin_step,
        )
    corpus, split = load_corpus(config)
    held_out = HeldOutLoss(corpus, split, config)
    # Shards are numbered site-major, so the union over sites and dp ranks is the
    # global batch that one site with sites*dp ranks would see (ShardedBatches);
    # the tp and pp ranks of one replica read the same batch.
    batches = ShardedBatches(
        corpus,
        seq_len=config.train.seq_len,
        batch_size=config.train.batch_size,
        seed=config.job.seed,
        shard_index=site_index * layout.dp + dp_i,
        num_shards=len(sites) * layout.dp,
        spans=split.train,
    )
    site_dir = env.run_dir / "sites" / env.site
    site_dir.mkdir(parents=True, exist_ok=True)
    metrics = StepReporter(
        env.site,
        site_dir / "metrics.jsonl" if env.rank == 0 else None,
        env.coordinator,
        env.run_dir / "tensorboard" / env.site if config.run.tensorboard else None,
        security=security,
    )
    if cross is None:
        metrics.register_alone(env.rank, env.world_size, config.fingerprint())
    # With a job token, checkpoint manifests are signed and checked with it (not with a
    # launcher's token for one run: the next run's would differ).
    token = security.token if security is not None and config.security.require_token else None
    key = token.encode() if token else None
    # 0 unless resuming
    start = restore(trainer, sync, config, env.run_dir, env.site, key, outer=outer)
    if cross is not None:
        # A site joining a running job starts from a live peer's state (invariant 3).
        start = cross.catch_up(trainer) or start
    dist.barrier()
    started = time.perf_counter()
    last = config.job.steps - 1
    step = start
    digest = ""
    synced = start - 1  # the last step that ended with replicas equal across sites
    reported_last = False
    while step < config.job.steps:
        inputs, targets = batches.batch(step)
        # Per-step sync: every step's gradients cross (in the trainer's hook). DiLoCo:
        # the outer optimizer's rounds, started every H steps, land `delay` steps later.
        per_step = sync is not None and outer is None
        if per_step:
            sync.begin_step(step)
        landed = False
        try:
            stats = trainer.step(step, inputs, targets)
            if outer is not None:
                t_outer = time.perf_counter()
                landed = outer.step(step)
                if outer.in_flight and save_due(config, step + 1):
                    outer.finish()  # a checkpoint holds no round in flight
                    landed = True
                stats.sync_s = time.perf_counter() - t_outer
        except RejoinRequired as exc:
            # The job went on without this site while it was cut off: nothing of this
            # step's sync was applied; take the live state and go on from where the job is.
            assert cross is not None
            step = cross.rejoin(trainer, exc.decision)
            synced = step - 1
            continue
        if SLOWDOWN > 1:  # fault injection (isthmus chaos): a site F times slower
            time.sleep((SLOWDOWN - 1) * stats.compute_s)
        if STEP_FLOOR_S > 0:
            time.sleep(max(0.0, STEP_FLOOR_S - stats.compute_s - stats.sync_s))
        crosses = per_step or landed
        round_stats = sync.last_step_stats if crosses else None
        live_sites, generation = 1, 0
        if round_stats is not None:
            live_sites, generation = round_stats.sites, round_stats.generation
        elif cross is not None:  # a step that did not cross (DiLoCo): the membership now
            membership = cross.sync.membership
            live_sites, generation = len(membership.sites), membership.generation
        # Site totals of what crossed the WAN this step (every rank has its own lane).
        rs = round_stats
        traffic = torch.tensor(
            [rs.bytes_sent, rs.raw_bytes, rs.corrupt_chunks, rs.nonfinite_chunks]
            if rs
            else [0, 0, 0, 0],
            dtype=torch.float64,
        )
        dist.all_reduce(traffic)
        # Every rank joins the digest's gather; sites compare them (invariant 1).
        # Replicas are equal only after a step that synced (every step, or one where a
        # DiLoCo round landed: then with a delay only the anchors are, until the last
        # step): digest the first of those at or past each multiple of `every`.
        every = config.run.digest_every
        digest_started = time.perf_counter()
        due = step == last or (every and (step + 1) // every > (synced + 1) // every)
        digest = ""
        if sync is None or crosses:
            synced = step
            if due and outer is not None and not outer.replicas_equal_on_landing and step != last:
                digest = outer.anchor_digest()  # parameters differ by local progress
            elif due:
                digest = trainer.parameter_digest()
        # Steady-state throughput leaves digests out (summary.py): a check, not training.
        digest_s = time.perf_counter() - digest_started if digest else 0.0
        # The held-out loss, of the model the sites share (equal everywhere).
        val = held_out.measure(trainer, outer) if held_out.due(step) else None
        metrics.record(
            {
                "site": env.site,
                "step": step,
                "loss": stats.loss,
                "grad_norm": stats.grad_norm,
                "lr": stats.lr,
                "compute_s": stats.compute_s,
                "sync_s": stats.sync_s,
                "tokens": stats.site_tokens,
                "mfu": stats.mfu,
                "bytes_sent": int(traffic[0]),
                "raw_bytes": int(traffic[1]),
                "corrupt_chunks": int(traffic[2]),
                "nonfinite_chunks": int(traffic[3]),
                "elapsed_s": time.perf_counter() - started,
                # What the optimizer step waited for the cross-site sync (the part
                # not hidden behind backward), and how long the rounds ran.
                "exposed_sync_s": round_stats.wait_s if round_stats else 0.0,
                "sync_busy_s": round_stats.sync_s if round_stats else 0.0,
                "digest_s": digest_s,
                **({"val_loss": val[0], "eval_s": val[1]} if val else {}),
                "live_sites": live_sites,
                "generation": generation,
                "retries": round_stats.retries if round_stats else 0,
                "outer_steps": outer.outer_steps if outer is not None else 0,
            },
            digest=digest,
            finished=step == last,
        )
        reported_last = step == last
        if cross is not None:
            cross.offer_if_asked(trainer, step + 1)
        save_if_due(trainer, sync, config, env.run_dir, env.site, step + 1, key, outer)
        step += 1
    if not reported_last:
        # This site joined (or rejoined) with the state after the last step: admitted at
        # the job's last commit (in DiLoCo, its last round). Nothing was left to train;
        # the other sites still wait for its final digest.
        digest = trainer.parameter_digest()
        metrics.report_final_digest(config.job.steps, digest)
    train_s = time.perf_counter() - started
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
    (site_dir / f"rank{env.rank}.json").write_text(json.dumps(result))
    dist.barrier()
    if cross is not None:
        cross.close()
    dist.destroy_process_group()


def build_trainer(
    config: JobConfig,
    mesh: DeviceMesh,
    layout: ParallelLayout,
    num_sites: int,
    *,
    cuda: bool,
    sync: GradientSync | None = None,
) -> Trainer:
    """The rank's model and trainer as the job config says (also what
    benchmarks/torchft_workers.py trains with). Per-step sync: ``sync`` averages every
    gradient across sites, and the learning rate scales with the global dp width. In
    the outer modes the trainer keeps its steps in the site (``sync`` is not used: the
    outer optimizer crosses) and its learning rate scales with the site's dp only, the
    batch its optimizer sees."""
    per_step = config.sync.mode == "step"
    return Trainer(
        build_model(config.resolved_model(), seed=config.job.seed),
        mesh,
        TrainConfig(
            lr=scaled_lr(
                config.train.lr,
                num_sites * layout.dp if per_step else layout.dp,
                config.train.lr_scaling,
                config.train.lr_reference_dp,
            ),
            warmup_steps=min(config.train.warmup_steps, config.job.steps),
            weight_decay=config.train.weight_decay,
            grad_clip=config.train.grad_clip or None,
            total_steps=config.job.steps,
        ),
        parallel=config.parallel_config(cuda=cuda),
        sync=sync if per_step else None,
    )


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
    try:
        run(env, config)
    except grpc.RpcError as exc:
        print(f"error: [{env.site}/{env.rank}] {exc.details()}", file=sys.stderr)
        return 1
    except (DivergenceError, QuorumLost, NonFiniteGradient) as exc:
        print(f"error: [{env.site}/{env.rank}] {exc}", file=sys.stderr)
        return 1
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
