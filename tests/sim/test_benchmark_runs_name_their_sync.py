"""The GPU benchmarks' runs say their sync mode: on a GPU host `isthmus local` fits
what a job leaves unset, and picks streaming where the plan predicts per-step sync
under 50 % (deploy/launch/quickstart.py). A per-step curve that left the mode unset
then synced once, at its end (the first two-site 125m figures on 2× H200,
2026-11-29)."""

from __future__ import annotations

import argparse
import sys

from helpers import ROOT

from isthmus.deploy.config.job import load_config
from isthmus.deploy.launch.quickstart import fit_to_host

sys.path.insert(0, str(ROOT / "benchmarks"))
import scaling_curve  # noqa: E402

# The job of `gpu_runs.sh dense-sites`: 125m, 2 sites x 1 GPU, 10 Gbit/s over 1000 km.
LINK = ["wan.distance_km=1000", "wan.bandwidth_mbit=10000", "topology.device=cuda"]


def fitted(sets: list[str]):
    return load_config(None, overrides=sets, fit=lambda c, given: fit_to_host(c, given, gpus=2))


def curve_args(*overrides: str) -> argparse.Namespace:
    return scaling_curve.parse_args(
        ["--out", "unused", "--preset", "125m", "--ranks-per-site", "1", "--codec", "int8"]
        + [x for o in (*LINK, *overrides) for x in ("--set", o)]
    )


def _sets(args: argparse.Namespace, sites: int) -> list[str]:
    argv = scaling_curve.run_args(args, sites, 16)
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]


def test_the_quick_start_would_pick_streaming_for_this_job():
    # What the benchmark guards against: left unset, the mode is fitted away from step.
    unset = [s for s in _sets(curve_args(), 2) if not s.startswith("sync.mode=")]
    assert fitted(unset).sync.mode == "streaming"


def test_a_curve_runs_per_step_sync_unless_told_otherwise():
    assert fitted(_sets(curve_args(), 2)).sync.mode == "step"
    told = fitted(_sets(curve_args("sync.mode=diloco"), 2))
    assert told.sync.mode == "diloco"
