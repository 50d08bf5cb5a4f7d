"""Fixtures of the tests of the cross-site layer (tests/conftest.py has job_dir)."""

from __future__ import annotations

import pytest
from fuzzing import COUNTS, Lane

from isthmus.inter.data.lane import server as lane_module
from isthmus.inter.data.lane.server import LaneServer


@pytest.fixture
def lane():
    """Site 0's lane of a two-site job at generation 1, raw codec (a module may have its
    own ``lane``)."""
    server = LaneServer(site_index=0, num_sites=2, codec="raw", generation=1)
    yield server
    server.stop(0)


@pytest.fixture
def fuzz_lane(monkeypatch):
    """The lane the fuzz tests send to (fuzzing.Lane); it must still answer afterwards."""
    # A chunk of a newer generation waits for the lane to move to it (10 s in
    # production); the lane here never moves, so keep that wait short.
    monkeypatch.setattr(lane_module, "_GENERATION_WAIT_S", 0.05)
    server = Lane()
    yield server
    try:
        server.assert_healthy()
    finally:
        server.close()


@pytest.fixture(scope="module")
def report_counts(request):
    """After a fuzz module: print how many inputs of each kind it sent (fuzzing.count)."""
    yield
    total = sum(COUNTS.values())
    if not total:
        return
    line = f"fuzz: {total} inputs: " + ", ".join(f"{k} {v}" for k, v in sorted(COUNTS.items()))
    COUNTS.clear()  # the next module counts its own
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n{line}")
