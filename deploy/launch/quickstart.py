"""`isthmus local` fits the host it runs on: on GPUs the sites share out the GPUs, train
a model worth a GPU, and sync by Streaming DiLoCo where the planning model says per-step
sync would keep under half the throughput. A setting the job names (file, ``--set`` or
flag) is never changed, and what the host cannot run is refused (``gpu_shortage``). Only
`isthmus local` fits: every site of it starts from this one resolved config; `isthmus
site` runs exactly what its file says."""

from __future__ import annotations

from isthmus.deploy.config.job import JobConfig, apply_preset_training

__all__ = ["GPU_PRESET", "PLAN_HINT_BELOW", "fit_to_host", "plan_hint", "step_sync_efficiency"]

GPU_PRESET = "125m"
"""The model a GPU quick start trains when none is named."""
PLAN_HINT_BELOW = 0.5
"""Predicted per-step scaling efficiency under which streaming is chosen (or, with
sync.mode named, `isthmus plan` is suggested)."""
_WIDTHS = ("topology.pp", "topology.cp", "topology.tp", "topology.ep")


def fit_to_host(config: JobConfig, given: set[str], gpus: int) -> list[str]:
    """Fits what ``config`` left unset (not in ``given``) to a host of ``gpus`` GPUs, in
    place; returns one note per choice, for the user. Nothing changes off CUDA."""
    if config.device_type != "cuda" or gpus < 1:
        return []
    notes = []
    sites, ranks = config.topology.sites, config.topology.ranks_per_site
    free_layout = "topology.ranks_per_site" not in given and not given & set(_WIDTHS)
    if free_layout and isinstance(ranks, int) and sites * ranks != gpus:
        if gpus >= sites:
            config.topology.ranks_per_site = gpus // sites
            notes.append(
                f"{sites} sites x {gpus // sites} GPU(s) on this host's {gpus} GPUs "
                "(topology.ranks_per_site)"
            )
        elif "run.share_gpus" not in given:
            config.topology.ranks_per_site = 1
            config.run.share_gpus = True
            notes.append(
                f"{sites} sites x 1 GPU, taking turns on this host's {gpus} GPU(s) "
                "(run.share_gpus; for correctness, not speed)"
            )
    # A config.json (model.hf_config, model.init_from) says the model: no preset swap.
    chosen = {"model.dim", "model.n_layers", "model.hf_config", "model.init_from"}
    if "model.preset" not in given and not given & chosen:
        config.model.preset = GPU_PRESET
        apply_preset_training(config, given)  # its own batch, length, learning rate
        notes.append(f"model.preset={GPU_PRESET}, a model worth a GPU")
    if "sync.mode" not in given and sites > 1:
        kept = step_sync_efficiency(config)
        if kept is not None and kept < PLAN_HINT_BELOW:
            config.sync.mode = "streaming"
            notes.append(
                f"sync.mode=streaming: per-step sync would keep ~{kept:.0%} of the sites' "
                f"throughput on this {_link(config)} link (isthmus plan)"
            )
    return notes


def plan_hint(config: JobConfig) -> str | None:
    """A line suggesting `isthmus plan` when the job syncs every step over a link on
    which the planning model predicts under half of the sites' throughput; else None."""
    if config.sync.mode != "step" or config.topology.sites < 2 or config.device_type != "cuda":
        return None
    kept = step_sync_efficiency(config)
    if kept is None or kept >= PLAN_HINT_BELOW:
        return None
    return (
        f"note: per-step sync is predicted to keep ~{kept:.0%} of the sites' throughput on "
        f"this {_link(config)} link; `isthmus plan --preset {config.model.preset}` shows "
        "what would keep more (sync.mode=streaming suits slow links)"
    )


def step_sync_efficiency(config: JobConfig) -> float | None:
    """The planning model's scaling efficiency of per-step sync for this job, as `isthmus
    plan --preset` computes it; None for a preset the planning model does not know."""
    from isthmus.deploy.config.job import ConfigError
    from isthmus.deploy.config.planning import codec_ratio, preset_input
    from isthmus.sim.plan import predict

    ranks = config.topology.ranks_per_site
    per_site = max(ranks) if isinstance(ranks, list) else ranks
    seq = config.train.seq_len
    try:
        inputs = preset_input(
            config.model.preset,
            seq_len=seq,
            bandwidth_bps=config.wan.bandwidth_mbit * 1e6,
            rtt_s=2 * config.one_way_latency_s,
            sites=config.topology.sites,
            devices_per_site=per_site,
            tokens_per_step=float(config.train.batch_size * seq * per_site * config.topology.sites),
            codec_ratio=codec_ratio(config.sync.codec),
        )
    except ConfigError:
        return None
    return predict(inputs).scaling_efficiency


def _link(config: JobConfig) -> str:
    gbit = config.wan.bandwidth_mbit / 1000
    return f"{gbit:g} Gbit/s, {2 * config.one_way_latency_s * 1000:.0f} ms"
