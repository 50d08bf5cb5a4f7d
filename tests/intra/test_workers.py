"""The multi-process tests' workers (tests/dist_helpers.py): forked from a forkserver
that imported torch, which is safe only while that forkserver is one thread."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from dist_helpers import spawn


def _look(rank: int) -> dict:
    import torch

    parent = os.getppid()  # the forkserver: a worker is its child
    return {
        "parent threads": len(os.listdir(f"/proc/{parent}/task")),
        "torch imported": "torch" in Path(f"/proc/{parent}/maps").read_text(),
        "variable": os.environ.get("ISTHMUS_TEST_WORKER_VARIABLE"),
        "threads": torch.get_num_threads(),
        # CUDA initialised in the forkserver (a GPU machine's test_moe_cuda) cannot be
        # used in a forked worker: torch marks the fork as bad.
        "bad fork": torch.cuda._is_in_bad_fork(),
    }


def test_workers_fork_from_one_thread_and_see_the_tests_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Set after the forkserver may have started (an earlier test's worker): a worker
    # must still see it, as a spawned one did.
    monkeypatch.setenv("ISTHMUS_TEST_WORKER_VARIABLE", "set by the test")
    for r in spawn(_look, 2, tmp_path):
        # A thread in the forkserver (torch's intra-op pool, a gloo or gRPC thread)
        # would be missing in every forked worker, holding whatever lock it held.
        assert r["parent threads"] == 1, r
        assert r["torch imported"], r  # else workers import torch each: the slow path
        assert r["variable"] == "set by the test", r
        assert r["threads"] == 1 and not r["bad fork"], r
