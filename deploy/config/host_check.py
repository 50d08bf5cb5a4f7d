"""What one host can run: the launchers' check that a job fits this machine (its cores,
memory, GPUs and open files) before any process starts (``host_problem``). The rules are
pure functions of ``HostFacts``, so tests give them any host."""

from __future__ import annotations

import math
import os
import resource
from dataclasses import dataclass
from typing import TYPE_CHECKING

from isthmus.inter.data import descriptors_needed

if TYPE_CHECKING:
    from isthmus.deploy.config.job import JobConfig

__all__ = ["HostFacts", "host_problem"]

GIB = 1 << 30
CPU_RANKS_FLOOR = 8
CPU_RANKS_PER_CORE = 4
"""CPU ranks a host runs without ``--oversubscribe``: max(8, 4 x its cores).

Each CPU rank is a process with its own torch, gloo and lane threads; the launcher
gives each ``cores // ranks`` OMP threads (at least 1), so past one rank a core they
time-share. The default job (2 sites x 2 ranks) runs at 2 a core on the 2-core CI
machine and its tests run 2 x 4 = 8 ranks there, slowly but well; past ~4 a core the
collectives' and heartbeats' timeouts start to fire from starvation, not faults. The
floor of 8 keeps those jobs on 1- and 2-core machines. 100,000 ranks (issue 33, row
13) launched for 90 s until killed."""
RANK_MEMORY_FLOOR = 256 << 20
"""Host memory a rank process takes before any model: measured 300-520 MB resident
per rank of the tiny preset (torch, gloo, gRPC) on the CPU machines; 256 MiB is below
all of them, so a refusal on it is never a guess."""
STATE_BYTES_PER_PARAM = 16
"""fp32 parameter, gradient and AdamW's two moments: what a site holds for every
parameter however FSDP2 shards it (mixed precision adds to it, never less)."""


@dataclass(frozen=True, slots=True)
class HostFacts:
    """What this host offers a job (``HostFacts.here``), so the rules below are pure."""

    cores: int  # this process may run on (its affinity, e.g. a container's cpuset)
    memory_bytes: int
    gpus: int = 0  # CUDA devices, when the job runs on CUDA
    gpu_memory_bytes: int = 0  # of the smallest of them
    open_files: int = 1 << 20  # the hard RLIMIT_NOFILE, which ranks inherit

    @classmethod
    def here(cls, cuda: bool) -> HostFacts:
        """This host's facts; ``cuda`` asks for the GPUs' too (imports torch)."""
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        gpus, gpu_memory = 0, 0
        if cuda:
            import torch

            gpus = torch.cuda.device_count()
            sizes = [torch.cuda.get_device_properties(i).total_memory for i in range(gpus)]
            gpu_memory = min(sizes, default=0)
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        return cls(
            cores=cores,
            memory_bytes=memory,
            gpus=gpus,
            gpu_memory_bytes=gpu_memory,
            open_files=1 << 20 if hard == resource.RLIM_INFINITY else hard,
        )


def _gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB" if n >= GIB else f"{n / (1 << 20):,.0f} MiB"


def host_problem(
    config: JobConfig, host: HostFacts, site_ranks: list[int], cuda: bool
) -> str | None:
    """Why this host cannot run these sites of the job, or None. ``site_ranks``: the ranks
    of each site this launcher starts here, each site holding a full copy of the state.

    Only clearly absurd sizes are refused (a typo's extra zeros): more CPU ranks than
    ``CPU_RANKS_PER_CORE`` a core unless ``run.oversubscribe``, more sites and connections
    than the host's hard limit on open files lets a lane hold, and sizes whose lower bound
    of memory (never an estimate that could be high) exceeds what the host or a GPU has.
    Too few GPUs for the ranks are ``gpu_shortage``'s (deploy/launch/local.py)."""
    ranks, sites = sum(site_ranks), len(site_ranks)
    limit = max(CPU_RANKS_FLOOR, CPU_RANKS_PER_CORE * host.cores)
    if not cuda and ranks > limit and not config.run.oversubscribe:
        return (
            f"{ranks} CPU ranks on a host of {host.cores} cores: more than "
            f"max({CPU_RANKS_FLOOR}, {CPU_RANKS_PER_CORE} x cores) = {limit}, which would "
            "starve each other; use fewer ranks (--ranks-per-site, --sites), or pass "
            "--oversubscribe (run.oversubscribe=true) to run them anyway"
        )
    files = descriptors_needed(config.topology.sites - 1, config.lane_connections)
    if files > host.open_files:
        return (
            f"each rank may hold {files} open files ({config.topology.sites} sites x "
            f"{config.lane_connections} sync.connections: its lane's connections to and "
            f"from every other site) and this host's hard limit is {host.open_files}: raise "
            "it (ulimit -Hn, LimitNOFILE=, a container's nofile) or use fewer sync.connections"
        )
    model, t, tr = config.resolved_model(), config.topology, config.train
    state = STATE_BYTES_PER_PARAM * model.num_params
    # One micro-batch's logits at one rank (fp32 on the CPU, at least bf16 on GPUs): the
    # cross-entropy takes them whole. A micro-batch is train.batch_size sequences, cut
    # by the pipeline's micro-batches, and its logits by cp (tokens) and tp (vocab).
    micro = config.parallel_config(cuda=cuda).num_microbatches(t.pp) if t.pp > 1 else 1
    sequences = math.ceil(tr.batch_size / micro)
    logits = sequences * (tr.seq_len // t.cp) * (model.vocab_size // t.tp) * (2 if cuda else 4)
    state_on_host = not cuda or config.parallel.offload
    on_host = ranks * RANK_MEMORY_FLOOR + (sites * state if state_on_host else 0)
    on_host += 0 if cuda else ranks * logits
    sizes = (
        f"model.preset={config.model.preset} ({model.num_params:,} parameters), "
        f"train.batch_size={tr.batch_size}, train.seq_len={tr.seq_len}"
    )
    if on_host > host.memory_bytes:
        return (
            f"this job needs at least {_gib(on_host)} of memory for {ranks} ranks of "
            f"{sites} site(s) ({sizes}: {_gib(RANK_MEMORY_FLOOR)} a rank process"
            + (
                f", {_gib(state)} of parameters, gradients and AdamW state a site"
                if state_on_host
                else ""
            )
            + (f", {_gib(logits)} of logits a rank" if not cuda else "")
            + f"), and this host has {_gib(host.memory_bytes)}"
        )
    if cuda and host.gpu_memory_bytes:
        # The largest site spreads its state the thinnest.
        per_gpu = (0 if config.parallel.offload else state / max(site_ranks)) + logits
        if per_gpu > host.gpu_memory_bytes:
            return (
                f"each GPU needs at least {_gib(per_gpu)} ({sizes}: parameters, gradients "
                f"and AdamW state of {_gib(state)} a site over its ranks, and "
                f"{_gib(logits)} of one micro-batch's logits), and this host's GPUs have "
                f"{_gib(host.gpu_memory_bytes)}"
            )
    return None
