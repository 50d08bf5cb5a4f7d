"""A rank's setup: where it sits, what it was told, and everything it builds before
its first step (the steps, their ends and the teardown are deploy/rank/loop.py's
`StepLoop`, for the built-in trainer and a script's `api.Context` alike).

`set_up` joins the site's torch.distributed world, builds the mesh, model and FSDP2
trainer and, for a multi-site job, opens the rank's lane, registers it with the
site's coordinator and hands the trainer a LaneGradientSync (or the outer optimizer
one, in the outer modes); then it loads the data, restores a checkpoint or pulls a
running job's state, and waits for the site's other ranks."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from isthmus.deploy.batch.plan import BatchPlan
from isthmus.deploy.config.job import JobConfig
from isthmus.deploy.rank.checkpointing import SiteCheckpoints
from isthmus.deploy.rank.contract import AGENT_ENV, STORE_ENV
from isthmus.deploy.rank.cross_site import CrossSite, shard_layout
from isthmus.deploy.rank.evaluation import HeldOutLoss
from isthmus.deploy.rank.faults import FaultInjection
from isthmus.deploy.rank.reporting import StepReporter
from isthmus.deploy.security.trust import checkpoint_key, site_security
from isthmus.inter.data import LaneGradientSync
from isthmus.inter.security import SiteSecurity
from isthmus.intra.corpus.batches import ShardedBatches
from isthmus.intra.corpus.cache import load_corpus
from isthmus.intra.flops import scaled_lr
from isthmus.intra.layout import ParallelLayout
from isthmus.intra.model import build_model
from isthmus.intra.outer import OuterConfig, OuterOptimizer
from isthmus.intra.topology import build_site_mesh, mesh_coordinate
from isthmus.intra.train import GradientSync, TrainConfig, Trainer

_SCRIPT_END: list[Callable[[], None]] = []


def at_script_end(hook: Callable[[], None]) -> None:
    """Run ``hook`` when the user's script returns (deploy/api.py registers its teardown
    of a context the script left open). Kept here, not in rank/program.py, because the
    program runs as ``__main__``: a script importing it would get a second module, and a
    second, empty list of hooks."""
    _SCRIPT_END.append(hook)


def script_ended() -> None:
    """Run the hooks :func:`at_script_end` registered, once each."""
    while _SCRIPT_END:
        _SCRIPT_END.pop(0)()


@dataclass(kw_only=True, slots=True)
class RankEnv:
    """Where this process sits, read from the environment."""

    site: str
    rank: int
    world_size: int
    run_dir: Path
    coordinator: str
    proxies: dict[str, str]
    host_agent: str = ""  # where the host's agent listens (:data:`AGENT_ENV`); "" for none
    faults: FaultInjection = field(default_factory=FaultInjection)

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
            host_agent=env.get(AGENT_ENV, ""),
            faults=FaultInjection.from_environ(env),
        )


@dataclass(kw_only=True, slots=True)
class RankParts:
    """What a rank built: everything its `StepLoop` uses. `set_up` builds it for the
    built-in trainer; a script's ``api.Context.attach`` builds one around the script's
    model (no batches, no held-out loss: those are the script's)."""

    env: RankEnv
    config: JobConfig
    trainer: Trainer
    cross: CrossSite | None  # lane, membership and state offers; None in a job of one site
    sync: LaneGradientSync | None
    outer: OuterOptimizer | None  # DiLoCo's (or streaming's); None with per-step sync
    batches: ShardedBatches
    held_out: HeldOutLoss
    metrics: StepReporter
    site_dir: Path
    checkpoints: SiteCheckpoints
    start: int  # the first step to train: 0, a checkpoint's, or a running job's
    plan: BatchPlan | None = None  # the global batch's size over time and its split


def join_site(env: RankEnv, config: JobConfig) -> tuple[DeviceMesh, tuple[int, int, int, int]]:
    """Joins the site's torch.distributed world (every rank's first act, a script's too)
    and builds its mesh; returns it and this rank's ``(pp, dp, cp, tp)`` in it."""
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dev = config.device_type
    layout = config.site_layout(env.site)
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # On GPUs NCCL carries the tensors and gloo the few CPU-side collectives
    # (the per-step traffic totals), in one process group. Ranks of one host meet in a
    # FileStore in their launcher's 0700 folder (deploy/launch/ranks.py); only ranks spread
    # over hosts (Slurm multi-node) use env:// and its TCPStore.
    store_path = os.environ.get(STORE_ENV)
    meet: dict = {}
    if store_path:
        store = dist.FileStore(store_path, env.world_size)
        meet = {"store": store, "rank": env.rank, "world_size": env.world_size}
    dist.init_process_group(
        "cuda:nccl,cpu:gloo" if dev == "cuda" else "gloo",
        timeout=timedelta(seconds=config.sync.timeout_s),
        **meet,
    )
    mesh = build_site_mesh(layout, dev)
    pp_i, dp_i, cp_i, tp_i = mesh_coordinate(mesh)
    # Lanes pair ranks by rank number: with one layout everywhere and row-major rank
    # order (tp innermost), equal ranks sit at equal (pp, dp, cp, tp) coordinates.
    where = ((pp_i * layout.dp + dp_i) * layout.cp + cp_i) * layout.tp + tp_i
    assert env.rank == where, (env.rank, pp_i, dp_i, cp_i, tp_i)
    return mesh, (pp_i, dp_i, cp_i, tp_i)


def security_of(env: RankEnv, config: JobConfig) -> SiteSecurity | None:
    """A rank uses its site's certificate, and its launcher's token for the run if any."""
    return site_security(config.security, env.site, os.environ.get("ISTHMUS_RUN_TOKEN"))


def join_job(env: RankEnv, config: JobConfig, security: SiteSecurity | None) -> CrossSite | None:
    """Opens the rank's lane and joins the job; None for a job of one site."""
    if len(config.site_names) > 1:
        return CrossSite.start(
            site=env.site,
            rank=env.rank,
            world_size=env.world_size,
            coordinator=env.coordinator,
            host_agent=env.host_agent,
            # A rank that srun started (site-multinode.sbatch) has no launcher of ours to
            # name the emulated links: it takes the job file's, as its coordinator does.
            proxies=env.proxies
            if "ISTHMUS_PROXIES" in os.environ
            else {s: u for s, u in config.cluster.proxies.items() if s != env.site and u},
            config=config,
            security=security,
        )
    return None


def set_up(env: RankEnv, config: JobConfig) -> RankParts:
    """Builds the rank (module docstring); returns once the site's ranks are all ready."""
    dev = config.device_type
    layout = config.site_layout(env.site)
    mesh, (_, dp_i, _, _) = join_site(env, config)
    sites = config.site_names
    site_index = sites.index(env.site)
    security = security_of(env, config)
    cross = join_job(env, config, security)
    sync = cross.sync if cross is not None else None

    # The global batch in micro-batches (accumulate x dp per site), numbered site-major.
    units, accumulate = config.site_units(), config.site_accumulate[site_index]
    trainer = build_trainer(
        config, mesh, layout, sum(units), cuda=dev == "cuda", sync=sync, accumulate=accumulate
    )
    outer = outer_optimizer(config, trainer, cross)
    if cross is not None and len(set(config.site_ranks)) > 1:
        # Sites of different sizes pair their ranks by the elements they hold.
        cross.sync.set_layout(*shard_layout(config, trainer, outer))
    if cross is not None:
        # Each site's gradient counts by the micro-batches it processed.
        cross.sync.set_site_units(dict(zip(sites, units, strict=True)))
    vocab, seq_len = config.resolved_model().vocab_size, config.train.seq_len
    corpus, split = load_corpus(config.data, seq_len=seq_len, vocab=vocab)
    held_out = HeldOutLoss(corpus, split, config.run, config.job, seq_len=config.train.seq_len)
    # Shards are numbered site-major, so the union over sites and dp ranks is the
    # global batch that one site with all their dp ranks would see (ShardedBatches);
    # the tp and pp ranks of one replica read the same batch.
    batches = ShardedBatches(
        corpus,
        seq_len=config.train.seq_len,
        batch_size=config.train.batch_size,
        seed=config.job.seed,
        shard_index=sum(units[:site_index]) + dp_i * accumulate,
        num_shards=sum(units),
        units=accumulate,
        spans=split.train,
    )
    # The global batch's size over time and its split between the sites.
    plan = BatchPlan(
        train=config.train,
        topology=config.topology,
        site=site_index,
        dp_index=dp_i,
        rank=env.rank,
        trainer=trainer,
        batches=batches,
        sync=sync,
    )
    if cross is not None:
        cross.plan = plan
    site_dir, metrics = open_metrics(env, config, security, alone=cross is None)
    # Manifests are signed and checked with the job's token, or the user's (never with a
    # launcher's token for one run: the next run's would differ).
    key = checkpoint_key(config.security, config.checkpoint)
    checkpoints = SiteCheckpoints(config, env.run_dir, env.site, key, sync, outer, plan)
    start = checkpoints.restore(trainer)  # 0 unless resuming
    if cross is not None:
        # A site joining a running job starts from a live peer's state (invariant 3).
        start = cross.catch_up(trainer) or start
    dist.barrier()
    return RankParts(
        env=env,
        config=config,
        trainer=trainer,
        cross=cross,
        sync=sync,
        outer=outer,
        batches=batches,
        held_out=held_out,
        metrics=metrics,
        site_dir=site_dir,
        checkpoints=checkpoints,
        start=start,
        plan=plan,
    )


def open_metrics(
    env: RankEnv, config: JobConfig, security: SiteSecurity | None, *, alone: bool
) -> tuple[Path, StepReporter]:
    """The site's folder in the run and the rank's metrics reporter (rank 0 writes
    metrics.jsonl); a job of one site (``alone``) registers with its coordinator here."""
    site_dir = env.run_dir / "sites" / env.site
    site_dir.mkdir(parents=True, exist_ok=True)
    metrics = StepReporter(
        env.site,
        site_dir / "metrics.jsonl" if env.rank == 0 else None,
        env.coordinator,
        env.run_dir / "tensorboard" / env.site if config.run.tensorboard else None,
        security=security,
    )
    if alone:
        metrics.register_alone(env.rank, env.world_size, config.fingerprint())
    return site_dir, metrics


def outer_optimizer(
    config: JobConfig, trainer: Trainer, cross: CrossSite | None
) -> OuterOptimizer | None:
    """DiLoCo and streaming's outer optimizer (also ``cross.outer``, which carries it in the
    rank's state); None with per-step sync or one site."""
    streaming = config.sync.mode == "streaming"
    if not (streaming or config.sync.mode == "diloco") or cross is None:
        return None
    sync = cross.sync
    cross.outer = OuterOptimizer(
        trainer,
        sync,
        OuterConfig(
            inner_steps=config.sync.inner_steps,
            lr=config.sync.outer_lr,
            lr_ramp=config.sync.outer_lr_ramp,
            momentum=config.sync.outer_momentum,
            delay=config.sync.outer_delay,
            # DiLoCo is Streaming DiLoCo with one fragment and the eager merge.
            fragments=config.sync.fragments if streaming else 1,
            alpha=config.sync.fragment_alpha if streaming else None,
        ),
        total_steps=config.job.steps,
    )
    return cross.outer


def build_trainer(
    config: JobConfig,
    mesh: DeviceMesh,
    layout: ParallelLayout,
    units_total: int,
    *,
    cuda: bool,
    sync: GradientSync | None = None,
    accumulate: int = 1,
) -> Trainer:
    """The rank's model and trainer as the job config says (benchmarks/torchft_workers.py
    trains it too). Per-step sync: ``sync`` averages every gradient across sites and the
    learning rate scales with ``units_total``, the global batch in micro-batches. The
    outer modes keep the steps in the site: the rate scales with the site's dp only."""
    per_step = config.sync.mode == "step"
    model = build_model(config.resolved_model(), seed=config.job.seed)
    if config.model.init_from:  # every rank reads the whole file, before sharding
        from isthmus.intra.hf_layout import load_weights

        load_weights(model, config.model.init_from)
    return Trainer(
        model,
        mesh,
        TrainConfig(
            lr=scaled_lr(
                config.train.lr,
                units_total if per_step else layout.dp * accumulate,
                config.train.lr_scaling,
                config.train.lr_reference_dp,
            ),
            warmup_steps=min(config.train.warmup_steps, config.job.steps),
            weight_decay=config.train.weight_decay,
            grad_clip=config.train.grad_clip or None,
            # Sites of different sizes sum the squares of their shards in different orders.
            portable_clip=len(set(config.site_ranks)) > 1,
            total_steps=config.job.steps,
            accumulate=accumulate,
        ),
        parallel=config.parallel_config(cuda=cuda),
        sync=sync if per_step else None,
    )
