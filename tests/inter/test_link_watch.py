"""The links watched live (inter/data/transport/link_watch.py) on real lanes over loopback:
each peer site's bulk connections read once a round, through TCP_INFO."""

from __future__ import annotations

import pytest
import torch
from lanes import inputs, lane_pair, run_all

from isthmus.inter.data.transport.link_watch import LinkWatch

pytestmark = pytest.mark.timeout(60)


def rounds(ars, step: int, size: int = 50_000) -> list:
    data = inputs(2, [size], seed=step)
    res = run_all([lambda s=s: ars[s].allreduce(data[s], step, 0, False) for s in range(2)])
    assert not any(isinstance(r, BaseException) for r in res), res
    assert torch.equal(data[0][0], data[1][0])
    return res


def test_a_bulk_link_reports_what_it_moved_its_rtt_window_and_retransmits() -> None:
    watches = [LinkWatch(), LinkWatch()]
    with lane_pair(2, "raw", transport="bulk", connections=2, watches=watches) as ars:
        for step in range(3):
            stats = rounds(ars, step)
            for site in range(2):
                peer = f"site{1 - site}"
                link = watches[site].sample([peer, "site9"])[peer]  # site9: never sent to
                assert link["transport"] == "bulk" and link["flows"] == 2
                # Frames' bytes: each payload and its header, acknowledged.
                assert link["bytes"] >= stats[site].bytes_sent > 0
                assert link["wire_s"] > 0 and link["gbit_s"] > 0
                assert link["rtt_ms"] > 0 and 0 < link["min_rtt_ms"] <= link["rtt_ms"] * 10
                assert link["cwnd_bytes"] > 0 and link["retrans"] >= 0
                assert sum(f["bytes"] for f in link["per_flow"]) == link["bytes"]
                assert all(f["retrans"] >= 0 for f in link["per_flow"])
        # Nothing moved since the last sample: no bytes, no rate, no time on the wire.
        idle = watches[0].sample(["site1"])["site1"]
        assert idle["bytes"] == 0 and idle["gbit_s"] is None and idle["wire_s"] == 0


def test_the_link_counts_every_byte_across_a_dropped_connection() -> None:
    watches = [LinkWatch(), LinkWatch()]
    with lane_pair(2, "raw", transport="bulk", watches=watches) as ars:
        sent = [0, 0]
        for step in range(3):
            for ar in ars if step else ():  # this round dials again: a new socket
                ar.server.bulk.drop_connections()
            for site, stat in enumerate(rounds(ars, step)):
                sent[site] += stat.bytes_sent
        for site in range(2):
            link = watches[site].sample([f"site{1 - site}"])[f"site{1 - site}"]
            assert link["bytes"] >= sent[site] and link["retrans"] >= 0


def test_a_grpc_link_has_no_socket_figures() -> None:
    watches = [LinkWatch(), LinkWatch()]
    with lane_pair(2, "raw", transport="grpc", watches=watches) as ars:
        rounds(ars, 0)
        link = watches[0].sample(["site1"])["site1"]
    assert link["transport"] == "grpc"
    assert all(link[k] is None for k in ("bytes", "gbit_s", "rtt_ms", "cwnd_bytes", "retrans"))
