"""The typed client a rank calls its coordinator with (inter/control/coordinator_client.py),
against real coordinators on loopback: registration, membership, progress reports,
and the errors each raises."""

from __future__ import annotations

import grpc
import pytest
from coordinators import FP, coordinator, stop_all
from helpers import wait_until

from isthmus.inter.control.coordinator import Coordinator
from isthmus.inter.control.coordinator_client import CoordinatorClient, Progress, Verdict

pytestmark = pytest.mark.timeout(60)
D1, D2 = "a" * 64, "b" * 64


def two_sites() -> list[Coordinator]:
    names = ["site0", "site1"]
    coords = [coordinator(name, names) for name in names]
    for c in coords:
        c.set_peers({o.site: o.address for o in coords if o is not c})
        c.start()
    return coords


def rank0(coord: Coordinator, lane: str) -> CoordinatorClient:
    """A client playing rank 0 of ``coord``'s site, registered with its lane."""
    client = CoordinatorClient.connect(coord.address, rank_key=coord.rank_keys.handed(0))
    client.register_rank(
        site=coord.site, rank=0, world_size=1, lane_address=lane, fingerprint=FP, timeout_s=5
    )
    return client


def test_registered_ranks_learn_the_membership():
    coords = two_sites()
    clients = [rank0(c, f"127.0.0.1:{3000 + i}") for i, c in enumerate(coords)]
    try:
        for membership in [client.wait_membership(20) for client in clients]:
            assert membership.generation >= 1
            assert [s.name for s in membership.sites] == ["site0", "site1"]
            lanes = [list(s.lane_addresses) for s in membership.sites]
            assert lanes == [["127.0.0.1:3000"], ["127.0.0.1:3001"]]
            # A job that starts here: no state to pull.
            assert (membership.start_step, membership.state_source) == (0, "")
    finally:
        for client in clients:
            client.close()
        stop_all(coords)


def test_a_refused_registration_raises_with_the_coordinators_reason():
    coord = coordinator("site0", ["site0"])
    coord.start()
    client = CoordinatorClient.connect(coord.address, rank_key=coord.rank_keys.handed(0))
    other = CoordinatorClient.connect(coord.address, rank_key="other-key-of-rank0")
    register = {"site": "site0", "rank": 0, "world_size": 1, "lane_address": "", "timeout_s": 5}
    try:
        with pytest.raises(grpc.RpcError) as info:
            client.register_rank(**register, fingerprint={"job.seed": "1"})
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "job.seed" in info.value.details()
        # A job of one site: the rank registers its key without a lane.
        client.register_rank(**register, fingerprint=FP)
        with pytest.raises(grpc.RpcError) as info:
            other.register_rank(**register, fingerprint=FP)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "the key its launcher handed it" in info.value.details()
    finally:
        client.close()
        other.close()
        stop_all([coord])


def test_progress_needs_a_registered_key_and_returns_the_divergence():
    coords = two_sites()
    clients = [rank0(c, f"127.0.0.1:{3000 + i}") for i, c in enumerate(coords)]
    stranger = CoordinatorClient.connect(coords[0].address, rank_key="key-of-no-rank-at-all")
    try:
        for c in coords:
            c.wait_ready(20)
        report = Progress(site="site0", step=10, loss=2.5, tokens=100, digest=D1, digest_step=10)
        assert clients[0].report_progress(report, timeout_s=5) == ""
        assert coords[0].step == 10 and coords[0].replicas.latest()["site0"] == (10, D1)
        with pytest.raises(grpc.RpcError) as info:
            stranger.report_progress(Progress(site="site0", step=11), timeout_s=5)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert coords[0].step == 10
        # site1 digests step 10 differently: site0 hears of it by heartbeat.
        report = Progress(site="site1", step=10, digest=D2, digest_step=10)
        assert clients[1].report_progress(report, timeout_s=5) == ""
        wait_until(lambda: coords[0].replicas.divergence, "divergence never detected")
        divergence = clients[0].report_progress(Progress(site="site0", step=11), timeout_s=5)
        assert "replicas differ after step 10" in divergence
    finally:
        for client in [*clients, stranger]:
            client.close()
        stop_all(coords)


def test_a_membership_that_never_comes_times_out():
    """site1 never comes up: the wait ends after its timeout (and the one long poll
    in flight, held 5 s by the coordinator) with the rank's error."""
    coord = coordinator("site0", ["site0", "site1"])
    coord.set_peers({"site1": "127.0.0.1:9"})
    coord.start()
    client = CoordinatorClient.connect(coord.address)
    try:
        with pytest.raises(TimeoutError, match="no job membership after 1s"):
            client.wait_membership(1)
    finally:
        client.close()
        stop_all([coord])


def test_a_rank_s_waiting_votes_go_on_its_vote_stream_and_a_vote_ahead_by_call():
    coords = two_sites()
    clients = [rank0(c, f"127.0.0.1:{3100 + i}") for i, c in enumerate(coords)]
    try:
        generation = min(client.wait_membership(20).generation for client in clients)
        vote = {"rank": 0, "generation": generation, "ok": True, "timeout_s": 10}
        # site1 votes ahead (no wait, a call); site0 waits for the decision on its stream.
        ahead = clients[1].commit_step(site="site1", step=0, wait_ms=0, **vote)
        assert ahead.verdict == Verdict.PENDING
        assert coords[1].host_sessions.free == coords[1].host_sessions.slots
        decision = clients[0].commit_step(site="site0", step=0, wait_ms=5_000, **vote)
        assert decision.verdict == Verdict.COMMIT and decision.step == 0
        assert coords[0].host_sessions.free == coords[0].host_sessions.slots - 1  # open
        # The same stream carries the next step's vote; closing the client ends it.
        clients[1].commit_step(site="site1", step=1, wait_ms=0, **vote)
        again = clients[0].commit_step(site="site0", step=1, wait_ms=5_000, **vote)
        assert again.verdict == Verdict.COMMIT and again.step == 1
        assert coords[0].host_sessions.free == coords[0].host_sessions.slots - 1
        clients[0].close()
        sessions = coords[0].host_sessions
        wait_until(lambda: sessions.free == sessions.slots, "the vote stream closed")
    finally:
        for client in clients:
            client.close()
        stop_all(coords)
