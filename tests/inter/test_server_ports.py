"""A port that an isthmus server holds is its own (issue 63): gRPC sets SO_REUSEPORT by
default, and a second coordinator once bound a live one's port beside it, to take half
its connections; the next quick start then failed both sites with a bare "Deadline
Exceeded". Every server (coordinator, lane, witness) now binds without it, and one that
cannot bind says why in one line."""

from __future__ import annotations

import pytest
from coordinators import coordinator, stop_all
from helpers import assert_one_line_error, run_cli

from isthmus.inter.control.witness import WitnessServer
from isthmus.inter.data.lane.server import LaneServer

pytestmark = pytest.mark.timeout(60)

IN_USE = "address already in use"


def test_a_second_coordinator_on_a_live_ones_port_is_refused_naming_why():
    first = coordinator("site0", ["site0", "site1"])
    first.set_peers({"site1": "127.0.0.1:1"})
    first.start()
    try:
        port = int(first.address.rpartition(":")[2])
        with pytest.raises(OSError, match=f"could not bind 127.0.0.1:{port}: {IN_USE}"):
            coordinator("site0", ["site0", "site1"], port=port)
    finally:
        stop_all([first])


def test_a_second_lane_or_witness_on_a_live_ones_port_is_refused_naming_why():
    lane = LaneServer(site_index=0, num_sites=2, codec="raw", bulk=False)

    witness = WitnessServer(site_names=["site0", "site1"], fingerprint={}, failure_timeout_s=1)
    witness.start()
    try:
        lane_port = int(lane.address.rpartition(":")[2])
        with pytest.raises(OSError, match=IN_USE):
            LaneServer(site_index=1, num_sites=2, codec="raw", port=lane_port, bulk=False)
        witness_port = int(witness.address.rpartition(":")[2])
        with pytest.raises(OSError, match=IN_USE):
            WitnessServer(
                site_names=["site0", "site1"],
                fingerprint={},
                failure_timeout_s=1,
                port=witness_port,
            )
    finally:
        lane.stop()
        witness.stop()


def test_a_site_whose_coordinator_port_is_taken_says_so_in_one_line(tmp_path):
    holder = coordinator("site0", ["site0", "site1"])
    holder.set_peers({"site1": "127.0.0.1:1"})
    holder.start()
    try:
        taken = holder.address
        result = run_cli(
            "site", "--site", "site0", "--run-dir", str(tmp_path / "run"),
            "--set", f"cluster.coordinators.site0={taken}",
            "--set", "cluster.coordinators.site1=127.0.0.1:1",
            timeout=120,
        )  # fmt: skip
        assert_one_line_error(result, f"could not bind {taken}: {IN_USE}")
    finally:
        stop_all([holder])
