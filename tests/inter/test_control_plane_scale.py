"""What keeps a coordinator's cost per step linear in its site's rank count
(docs/benchmarks.md, "The control plane at scale"; benchmarks/control_plane.py).

Real coordinators on loopback, one site of several ranks played by the test: a rank's
vote wakes the coordinator's waiters only when it is the site's last (each rank keeps
two long polls waiting there), a long poll waits for its own news and not for every
transition's, a watcher that knows the generation is not sent every site's lanes again
(nor a voter that has them its COMMIT's), a rank's key is looked up, not compared with
every rank's, and one call carries the votes of a host's ranks.
"""

from __future__ import annotations

import threading

import grpc
import pytest
from helpers import register_rank, wait_until

from isthmus.inter.control.coordinator import Coordinator, CoordinatorSettings
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
    coord = Coordinator(
        CoordinatorSettings(site="site0", site_names=["site0"], ranks=RANKS, fingerprint=FP)
    )
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


def _vote(
    coord: Coordinator, stub, rank: int, wait_ms: int, *, sites_known: bool = False
) -> pb.Decision:
    request = pb.CommitStepRequest(
        site="site0",
        rank=rank,
        step=0,
        generation=1,
        ok=True,
        wait_ms=wait_ms,
        rank_key=coord.rank_keys.handed(rank),
        sites_known=sites_known,
    )
    return stub.CommitStep(request, timeout=10)


def _host_vote(coord: Coordinator, stub, ranks, *, step: int = 0, ok: bool = True, **kw):
    def key(rank: int) -> str:  # key<rank>=...: another key than the one handed out
        return kw.pop(f"key{rank}") if f"key{rank}" in kw else coord.rank_keys.handed(rank)

    ballots = [pb.RankBallot(rank=r, ok=ok, rank_key=key(r)) for r in ranks]
    request = pb.CommitHostStepRequest(
        site="site0", step=step, generation=1, ballots=ballots, wait_ms=kw.pop("wait_ms", 0)
    )
    return stub.CommitHostStep(request, timeout=10)


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


def test_a_long_poll_is_woken_by_its_own_news_only(site):
    """A vote waits for its step's decision and a watcher for the membership: a
    transition that is neither (a peer's heartbeat, another step's decision) wakes
    neither, and each is answered as soon as its news comes."""
    coord, stub = site
    with grpc.insecure_channel(coord.address) as channel:
        poll = pb_grpc.CoordinatorStub(channel).GetMembership.future(
            pb.GetMembershipRequest(
                known_generation=1, wait_ms=20_000, rank_key=coord.rank_keys.handed(0)
            ),
            timeout=30,
        )
        vote = pb_grpc.CoordinatorStub(channel).CommitStep.future(
            pb.CommitStepRequest(
                site="site0",
                rank=0,
                step=0,
                generation=1,
                ok=True,
                wait_ms=20_000,
                rank_key=coord.rank_keys.handed(0),
            ),
            timeout=30,
        )
        st = coord.state
        # Both wait on their own event: nothing waits on the state's condition but
        # the failover loop, however many ranks keep long polls there.
        wait_until(lambda: len(st.decision_news) == 1, "the vote never waited")
        for _ in range(3):
            with st.cond:
                st.cond.notify_all()  # what a peer's heartbeat does
        assert not poll.done() and not vote.done()
        for rank in range(1, RANKS):  # the site's last vote decides the step
            assert _vote(coord, stub, rank, wait_ms=0).verdict in (
                pb.VERDICT_PENDING,
                pb.VERDICT_COMMIT,
            )
        assert vote.result(timeout=10).verdict == pb.VERDICT_COMMIT
        assert not poll.done(), "a decision is no membership news"
        with st.cond:  # a new generation: membership news, the watcher answers
            sites = st.infos_locked(["site0"])
            st.adopt_generation_locked(2, sites, start_step=1, state_source="", leader="site0")
        assert poll.result(timeout=10).generation == 2


def test_a_voter_that_has_the_sites_gets_its_commit_without_them(site):
    coord, stub = site
    for rank in range(RANKS - 1):
        _vote(coord, stub, rank, wait_ms=0)
    lean = _vote(coord, stub, RANKS - 1, wait_ms=5_000, sites_known=True)
    assert lean.verdict == pb.VERDICT_COMMIT and lean.generation == 1
    assert list(lean.sites) == []
    # Without the flag (an older rank, or the tests' own voters) it names them.
    full = _vote(coord, stub, 0, wait_ms=0)
    assert full.verdict == pb.VERDICT_COMMIT and [i.name for i in full.sites] == ["site0"]
    assert lean.step == full.step and lean.reason == full.reason


def test_one_call_votes_for_a_host_s_ranks(site):
    coord, stub = site
    first = _host_vote(coord, stub, range(RANKS // 2))
    assert first.verdict == pb.VERDICT_PENDING
    decision = _host_vote(coord, stub, range(RANKS // 2, RANKS), wait_ms=5_000)
    assert decision.verdict == pb.VERDICT_COMMIT and decision.step == 0
    assert coord.failover.committed_steps == 1


@pytest.mark.parametrize(
    ("ranks", "keys", "code"),
    [
        ([0, 1, 1], {}, grpc.StatusCode.INVALID_ARGUMENT),  # a rank twice
        ([], {}, grpc.StatusCode.INVALID_ARGUMENT),  # nobody
        ([0, RANKS], {f"key{RANKS}": "a" * 32}, grpc.StatusCode.INVALID_ARGUMENT),  # no rank
        ([0, 1, 2], {"key2": "f" * 32}, grpc.StatusCode.PERMISSION_DENIED),  # a wrong key
    ],
)
def test_a_host_vote_with_one_bad_ballot_is_refused_whole(site, ranks, keys, code):
    coord, stub = site
    with pytest.raises(grpc.RpcError) as refused:
        _host_vote(coord, stub, ranks, ok=False, **keys)
    assert refused.value.code() == code
    with coord.state.cond:
        assert coord.failover.ballots.rank_votes == {}  # not even the good ballots
    # The same ranks' own votes still count.
    assert _host_vote(coord, stub, range(RANKS), wait_ms=5_000).verdict == pb.VERDICT_COMMIT
