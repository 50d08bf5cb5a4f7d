"""`isthmus local` fits the host (deploy/launch/quickstart.py): what a GPU quick start
chooses on 1, 2, 4 and 8 GPUs, and that every setting a job names wins."""

from __future__ import annotations

import pytest

from isthmus.deploy.config.job import ConfigError, load_config
from isthmus.deploy.launch.local import gpu_shortage, gpus_needed
from isthmus.deploy.launch.quickstart import GPU_PRESET, fit_to_host, plan_hint

CUDA = ["topology.device=cuda"]  # the host's GPUs are passed in: this machine has none


def fitted(gpus: int, overrides: list[str]):
    notes: list[str] = []
    config = load_config(
        overrides=overrides, fit=lambda c, given: notes.extend(fit_to_host(c, given, gpus))
    )
    return config, notes


@pytest.mark.parametrize(
    "gpus, ranks, share", [(1, 1, True), (2, 1, False), (4, 2, False), (8, 4, False)]
)
def test_a_gpu_quick_start_lays_the_sites_out_on_the_gpus_it_finds(gpus, ranks, share) -> None:
    config, notes = fitted(gpus, CUDA)
    assert config.topology.ranks_per_site == ranks and config.run.share_gpus is share
    assert gpu_shortage("cuda", gpus, gpus_needed(config)) is None  # it starts
    # A model worth a GPU, with that preset's own batch and learning rate, and the
    # sync mode the default 1 Gbit/s link wants; each choice said.
    assert config.model.preset == GPU_PRESET
    assert config.train.batch_size == load_config(overrides=["model.preset=125m"]).train.batch_size
    assert config.sync.mode == "streaming"
    said = "; ".join(notes)
    assert "model.preset=125m" in said and "sync.mode=streaming" in said
    assert ("topology.ranks_per_site" in said or "run.share_gpus" in said) is (gpus != 4)


def test_what_the_job_names_wins_and_is_still_refused_in_one_line() -> None:
    named = [*CUDA, "topology.ranks_per_site=2", "model.preset=small", "sync.mode=step"]
    config, notes = fitted(2, named)
    assert notes == []
    assert (config.topology.ranks_per_site, config.model.preset, config.sync.mode) == (
        2,
        "small",
        "step",
    )
    assert (
        gpu_shortage("cuda", 2, gpus_needed(config))
        == "topology.device = cuda needs 4 GPUs, found 2"
    )
    # A layout of named widths is the job's too: tp=2 is not squeezed onto 1 GPU a site.
    config, notes = fitted(2, [*CUDA, "topology.tp=2"])
    assert config.topology.ranks_per_site == 2 and not any("ranks" in n for n in notes)


def test_a_cpu_job_and_a_fast_link_are_left_alone() -> None:
    config, notes = fitted(0, [])
    assert notes == [] and config.model.preset == "small" and config.sync.mode == "step"
    config, notes = fitted(0, ["topology.device=cpu"])
    assert notes == []
    # At 400 Gbit/s, 1 ms, per-step sync keeps most of the throughput: it stays.
    config, notes = fitted(4, [*CUDA, "wan.bandwidth_mbit=400000", "wan.latency_ms=0.5"])
    assert config.sync.mode == "step" and not any("sync.mode" in n for n in notes)


def test_plan_is_suggested_where_per_step_sync_keeps_under_half() -> None:
    slow = load_config(overrides=[*CUDA, "model.preset=125m"])
    hint = plan_hint(slow)
    assert hint is not None and "isthmus plan --preset 125m" in hint and "1 Gbit/s" in hint
    fast = load_config(
        overrides=[*CUDA, "model.preset=125m", "wan.bandwidth_mbit=400000", "wan.latency_ms=0.5"]
    )
    assert plan_hint(fast) is None
    assert plan_hint(load_config(overrides=[*CUDA, "sync.mode=streaming"])) is None
    assert plan_hint(load_config(overrides=["topology.device=cpu"])) is None


def test_a_fitted_job_is_still_validated() -> None:
    def bad(config, given) -> None:
        config.topology.ranks_per_site = 0

    with pytest.raises(ConfigError, match="ranks_per_site"):
        load_config(overrides=CUDA, fit=bad)
