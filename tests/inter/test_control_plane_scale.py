"""What keeps a coordinator's cost per step linear in its site's rank count
(docs/benchmarks.md, "The control plane at scale"; benchmarks/control_plane.py).

Real coordinators on loopback, one site of several ranks played by the test: a rank's
vote wakes the coordinator's waiters only when it is the site's last (each rank keeps
two long polls waiting there), a watcher that knows the generation is not sent every
site's lanes again, and a rank's key is looked up, not compared with every rank's.
"""

from __future__ import annotations

import threading

import grpc
import pytest
from helpers import register_rank

from isthmus.inter.control.coordinator import Coordinator
from isthmus.inter.control.rank_keys import RankKeys
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

FP = {"job.seed": "0"}
RANKS = 8


@pytest.fixture
def site():
    """A one-site job of RANKS ranks, all registered: no peers, so nothing but the
    test's calls moves its state (no heartbeats, no suspects)."""
    coord = Coordinator(site="site0", site_names=["site0"], ranks=RANKS, fingerprint=FP)
    coord.start()
    try:
        for rank in range(RANKS):
            register_rank(
                coord.address,
                "site0",
                FP,
                key=coord.rank_keys.handed(rank),
                rank=rank,
                world_size=RANKS,
            )
        coord.wait_ready(10)
        with grpc.insecure_channel(coord.address) as channel:
            yield coord, pb_grpc.CoordinatorStub(channel)
    finally:
        coord.stop(grace_s=0)


def _vote(coord: Coordinator, stub, rank: int, wait_ms: int) -> pb.Decision:
    request = pb.CommitStepRequest(
        site="site0",
        rank=rank,
        step=0,
        generation=1,
        ok=True,
        wait_ms=wait_ms,
        rank_key=coord.rank_keys.handed(rank),
    )
    return stub.CommitStep(request, timeout=10)


def test_only_the_last_rank_s_vote_wakes_the_waiters(site):
    coord, stub = site
    cond = coord.state.cond
    wakes = []
    notify_all = cond.notify_all

    def counted() -> None:
        wakes.append(threading.current_thread().name)
        notify_all()

    cond.notify_all = counted  # type: ignore[method-assign]
    for rank in range(RANKS - 1):
        assert _vote(coord, stub, rank, wait_ms=0).verdict == pb.VERDICT_PENDING
    # Seven votes, nothing anyone waits for changed: no waiter was woken. Before the
    # fix each vote woke all of them (2 long polls a rank): N x 2N wake-ups a step.
    assert wakes == []
    decision = _vote(coord, stub, RANKS - 1, wait_ms=5_000)
    assert decision.verdict == pb.VERDICT_COMMIT
    assert wakes, "the last vote must wake the site's waiters"
    # A vote sent again once every rank voted still wakes them (a "not ok" stands).
    assert _vote(coord, stub, 0, wait_ms=0).verdict == pb.VERDICT_COMMIT


def test_a_watcher_that_knows_the_generation_is_not_sent_the_lanes_again(site):
    coord, stub = site
    key = coord.rank_keys.handed(3)
    first = stub.GetMembership(pb.GetMembershipRequest(known_generation=0, rank_key=key), timeout=5)
    assert first.generation == 1
    assert [len(info.lane_addresses) for info in first.sites] == [RANKS]
    again = stub.GetMembership(
        pb.GetMembershipRequest(known_generation=1, wait_ms=0, rank_key=key), timeout=5
    )
    assert again.generation == 1 and list(again.sites) == [] and list(again.suspects) == []
    # Anyone else (no key, no generation) still reads the whole membership.
    stranger = stub.GetMembership(pb.GetMembershipRequest(), timeout=5)
    assert [info.name for info in stranger.sites] == ["site0"]


def test_any_rank_s_key_is_found_by_lookup():
    keys = RankKeys.draw("site0", 4096)
    for rank in range(4096):
        assert keys.register(rank, keys.handed(rank)) is None
    assert all(keys.is_any_rank(keys.handed(rank)) for rank in range(0, 4096, 97))
    assert not keys.is_any_rank("f" * 32)
    # First come: a key counts once registered, and a refused one never does.
    first = RankKeys.first_come("site1")
    assert first.register(0, "a" * 32) is None
    assert first.register(0, "b" * 32) is not None
    assert first.is_any_rank("a" * 32) and not first.is_any_rank("b" * 32)
