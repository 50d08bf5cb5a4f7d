"""A first Join in a site's name is settled with that site at its configured address
(inter/control/admission.py; issue 33, row 2). Real coordinators on loopback, joined
through an emulated link's proxies as ``isthmus local`` joins them; the forger calls
site0 directly, as any local process can."""

from __future__ import annotations

import time

import grpc
import pytest
from coordinators import FP, coordinator, linked_pair, register, stop_all
from helpers import wait_until

from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc
from isthmus.sim import RelayServer

pytestmark = pytest.mark.timeout(60)
FAKE_LANE = "127.0.0.1:9"


def forged_join(address: str, incarnation: str = "f" * 16) -> pb.JoinResponse:
    """A Join in site1's name, ready, with fake lanes and the job's fingerprint."""
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.CoordinatorStub(channel).Join(
            pb.JoinRequest(
                site=pb.SiteInfo(name="site1", index=1, lane_addresses=[FAKE_LANE]),
                fingerprint=pb.JobFingerprint(fields=FP),
                ready=True,
                incarnation=incarnation,
            ),
            timeout=5,
        )


def test_a_join_in_a_site_s_name_before_it_starts_admits_nothing(caplog):
    relay = RelayServer().start()
    link, proxies = linked_pair(relay)
    names = ["site0", "site1"]
    site0, site1 = (coordinator(name, names) for name in names)
    try:
        site0.set_peers({"site1": site1.address}, proxies["site0"])
        site1.set_peers({"site0": site0.address}, proxies["site1"])
        joins: list[int] = []  # site0's rounds of joins (each asks site1, which is not up)
        rounds = site0.peer_loop  # counted, not changed
        join_round = rounds.join_round
        rounds.join_round = lambda stubs: (join_round(stubs), joins.append(1))
        site0.start()
        register(site0, lane="127.0.0.1:2000")  # site0 is ready; site1 has not started
        for _ in range(3):
            # Answered (a join cannot be told from the site's own until the site is
            # asked), but nothing is taken from it: no generation, no lanes, no liveness.
            assert forged_join(site0.address).generation == 0
        after = len(joins)  # a whole round begun after the forged joins: site0 joined site1
        wait_until(lambda: len(joins) >= after + 2, "site0 stopped joining site1")
        with site0.state.cond:
            assert site0.generation == 0
            assert "site1" not in site0.state.ready_sites
            assert "site1" not in site0.state.last_seen
        assert site0.refusals.count == 0  # not settled yet: site1 has not answered

        # The real site1 starts: site0 admits it with the lanes site1 itself names.
        site1.start()
        register(site1, lane="127.0.0.1:2001")
        sites = {info.name: list(info.lane_addresses) for info in site0.wait_ready(20)}
        assert sites == {"site0": ["127.0.0.1:2000"], "site1": ["127.0.0.1:2001"]}
        assert site0.incarnations.get("site1") == site1.incarnations.mine
        # The forged claims, contradicted by site1's answer: counted (one per connection
        # they came on: gRPC may reuse one for all three), logged once for their host,
        # with the caller's address.
        wait_until(lambda: site0.refusals.count >= 1, "the forged joins were never settled")
        assert 1 <= site0.refusals.count <= 3
        lines = [r.getMessage() for r in caplog.records if "does not confirm" in r.getMessage()]
        assert len(lines) == 1 and "site1's name" in lines[0] and "127.0.0.1" in lines[0]

        # After the job runs, a forged join in a member's name changes nothing either.
        generation, refused = site0.generation, site0.refusals.count
        forged_join(site0.address, incarnation="e" * 16)
        # site1's next answer belies it (a refusal) and nothing else changes.
        wait_until(lambda: site0.refusals.count > refused, "the forged join was never settled")
        with site0.state.cond:
            assert site0.generation == generation and site0.state.suspects_locked() == []
            assert list(site0.state.ready_sites["site1"].lane_addresses) == ["127.0.0.1:2001"]
    finally:
        stop_all([site0, site1])
        relay.close()


def test_two_sites_starting_at_once_join_each_other_without_waiting():
    """Both sites' first joins cross: each asks the other at its address from its own
    peer loop (never from a handler), so neither waits on the other."""
    relay = RelayServer().start()
    link, proxies = linked_pair(relay)
    names = ["site0", "site1"]
    # A long RPC deadline: a join that waited on the other's from inside a handler would
    # hold both handlers until it ran out, 10 s, which no load comes near in this test.
    coords = [coordinator(name, names, rpc_timeout_s=10.0) for name in names]
    try:
        for c, other in zip(coords, reversed(coords), strict=True):
            c.set_peers({other.site: other.address}, proxies[c.site])
        for c in coords:
            c.start()
        start = time.monotonic()
        for i, c in enumerate(coords):
            register(c, lane=f"127.0.0.1:{2000 + i}")
        for c in coords:
            c.wait_ready(10)
        # A join round every 0.2 s, one more round trip to settle: well under a second
        # here. Crossed joins that waited on each other wait out the 10 s deadline; half
        # of it tells them apart with seconds to spare on a loaded machine.
        assert time.monotonic() - start < 5.0
        for c in coords:
            assert c.refusals.count == 0  # a site's own joins are never taken for forged
    finally:
        stop_all(coords)
        relay.close()
