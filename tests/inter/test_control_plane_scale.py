"""What keeps a coordinator's cost per step linear in its site's rank count
(docs/benchmarks/control-plane.md, "The control plane at scale"; benchmarks/control_plane.py).

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
from helpers import in_threads, register_rank, wait_until

from isthmus.inter.control.coordinator import Coordinator, CoordinatorSettings
from isthmus.inter.control.host_session import HostSession
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
    first = stub.GetMembership(pb.GetMembershipRequest(known_generation=0, rank_key=key), 5)
    assert first.generation == 1
    assert [len(info.lane_addresses) for info in first.sites] == [RANKS]
    again = stub.GetMembership(
        pb.GetMembershipRequest(known_generation=1, wait_ms=0, rank_key=key), timeout=5
    )
    assert again.generation == 1 and list(again.sites) == [] and list(again.suspects) == []
    # Anyone else (no key, no generation) still reads the whole membership.
    stranger = stub.GetMembership(pb.GetMembershipRequest(), 5)
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
    assert coord.state.committed_steps == 1


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


# -- a host agent's votes on one stream (HostSession) ------------------------------------


def _ballots(coord: Coordinator, ranks, *, step: int, wait_ms: int, **keys):
    return pb.CommitHostStepRequest(
        site="site0",
        step=step,
        generation=1,
        ballots=[
            pb.RankBallot(rank=r, ok=True, rank_key=keys.get(f"key{r}", coord.rank_keys.handed(r)))
            for r in ranks
        ],
        wait_ms=wait_ms,
        sites_known=True,
    )


def _two_hosts_vote(coord: Coordinator, hosts, step: int) -> list[pb.Decision]:
    """Both hosts of the site vote on ``step`` at once (each waits for the other's)."""
    halves = [range(RANKS // 2), range(RANKS // 2, RANKS)]
    answers: list = [None, None]

    def vote(i: int) -> None:
        answers[i] = hosts[i].vote(_ballots(coord, halves[i], step=step, wait_ms=5_000))

    in_threads(vote, range(2), 15)
    return answers


def test_a_host_session_carries_every_step_s_votes_on_one_stream(site):
    coord, stub = site
    with HostSession(stub) as first, HostSession(stub) as second:
        for step in range(3):
            answers = _two_hosts_vote(coord, [first, second], step)
            assert [a.verdict for a in answers] == [pb.VERDICT_COMMIT] * 2
            assert [a.step for a in answers] == [step, step]
            assert [list(a.sites) for a in answers] == [[], []]  # sites_known: lean
        # A wait that passes without a decision is PENDING; the same stream goes on.
        pending = first.vote(_ballots(coord, range(RANKS // 2), step=3, wait_ms=50))
        assert pending.verdict == pb.VERDICT_PENDING
        assert first.unary_votes == second.unary_votes == 0
        assert coord.host_sessions.free == RANKS - 2  # two sessions open
    assert coord.state.committed_steps == 3
    wait_until(lambda: coord.host_sessions.free == RANKS, "the sessions closed")


def test_a_bad_ballot_ends_the_session_and_records_nothing(site):
    coord, stub = site
    with HostSession(stub) as host:
        bad = _ballots(coord, [0, 1, 2], step=0, wait_ms=0, key2="f" * 32)
        with pytest.raises(grpc.RpcError) as refused:
            host.vote(bad)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert host.unary_votes == 0  # refused for what it says, not retried by a call
        with coord.state.cond:
            assert coord.failover.ballots.rank_votes == {}
        # The next vote opens another stream and counts.
        good = host.vote(_ballots(coord, range(RANKS), step=0, wait_ms=5_000))
        assert good.verdict == pb.VERDICT_COMMIT and host.unary_votes == 0


def test_without_a_session_slot_a_host_votes_by_call(site):
    coord, stub = site
    # Strangers' streams that never send a vote hold every slot (one a rank).
    idle = threading.Event()
    squatters = [stub.HostSession(iter(idle.wait, True)) for _ in range(RANKS)]
    try:
        wait_until(lambda: coord.host_sessions.free == 0, "every slot held")
        with HostSession(stub) as host:
            decision = host.vote(_ballots(coord, range(RANKS), step=0, wait_ms=5_000))
            assert decision.verdict == pb.VERDICT_COMMIT and host.unary_votes == 1
            # A slot freed: the next vote goes on a stream again.
            squatters.pop().cancel()
            wait_until(lambda: coord.host_sessions.free == 1, "a slot freed")
            decision = host.vote(_ballots(coord, range(RANKS), step=1, wait_ms=5_000))
            assert decision.verdict == pb.VERDICT_COMMIT and host.unary_votes == 1
    finally:
        for call in squatters:
            call.cancel()
    assert coord.state.committed_steps == 2


def test_a_session_s_wait_holds_its_session_slot_only(site):
    coord, stub = site
    answers: list = []
    with HostSession(stub) as host:
        waiting = threading.Thread(
            target=lambda: answers.append(
                host.vote(_ballots(coord, range(RANKS // 2), step=0, wait_ms=10_000))
            )
        )
        waiting.start()

        def half_voted() -> bool:
            with coord.state.cond:
                return len(coord.failover.ballots.rank_votes.get((0, 1), {})) == RANKS // 2

        wait_until(half_voted, "the session's ballots recorded")
        # Its wait is bounded by the session's slot: no long poll slot is taken.
        assert coord.long_polls.free == coord.long_polls.slots
        assert coord.host_sessions.free == RANKS - 1
        decision = _host_vote(coord, stub, range(RANKS // 2, RANKS), wait_ms=5_000)
        waiting.join(10)
    assert decision.verdict == pb.VERDICT_COMMIT
    assert [a.verdict for a in answers] == [pb.VERDICT_COMMIT]


def test_a_coordinator_that_stops_ends_its_sessions(site):
    coord, stub = site
    host = HostSession(stub, rpc_slack_s=2.0)
    ended: list = []

    def vote() -> None:
        try:
            ended.append(host.vote(_ballots(coord, range(RANKS // 2), step=0, wait_ms=30_000)))
        except (grpc.RpcError, TimeoutError) as exc:
            ended.append(exc)

    waiting = threading.Thread(target=vote, daemon=True)
    waiting.start()
    wait_until(lambda: coord.host_sessions.free == RANKS - 1, "the session open")
    coord.stop(grace_s=0)
    waiting.join(10)
    host.close()
    # The vote ended with the coordinator (its wait answered PENDING, or the stream
    # cancelled), not when its 30 s passed.
    assert not waiting.is_alive() and len(ended) == 1
    assert not isinstance(ended[0], pb.Decision) or ended[0].verdict == pb.VERDICT_PENDING
