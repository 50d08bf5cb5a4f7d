"""The coordinator's state transitions one by one (inter/control/state.py).

Pure logic, no servers: a real `CoordinatorState` (and `Ballots`) driven through each
named transition, checked for what it changes, what it leaves alone, and that it
wakes a real thread waiting on the state's condition (the partition scenario once
deadlocked in code that changed this state from four modules without a name).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest
from helpers import ManualClock

from isthmus.inter.control.ballots import Ballots
from isthmus.inter.control.settings import CoordinatorSettings
from isthmus.inter.control.state import Adoption, CoordinatorState
from isthmus.proto import coordinator_pb2 as pb

pytestmark = pytest.mark.timeout(30)

NAMES = ["site0", "site1", "site2"]


def make_state(
    site: str = "site1", *, ranks: int = 1, failure_timeout_s: float = 10.0, clock=time.monotonic
):
    settings = CoordinatorSettings(
        site=site,
        site_names=NAMES,
        ranks=ranks,
        fingerprint={},
        failure_timeout_s=failure_timeout_s,
    )
    return CoordinatorState(settings, clock)


def info(name: str, lane: str | None = None) -> pb.SiteInfo:
    index = NAMES.index(name)
    return pb.SiteInfo(
        name=name,
        index=index,
        lane_addresses=[lane or f"127.0.0.1:{2000 + index}"],
        coordinator_address=f"127.0.0.1:{3000 + index}",
    )


def running(site: str = "site1") -> CoordinatorState:
    """A state at generation 1 with every site, formed the way a coordinator forms it."""
    state = make_state(site)
    with state.cond:
        state.register_lane_locked(0, "127.0.0.1:2001")
        for name in NAMES:
            if name != site:
                state.admit_locked(info(name))
    assert state.generation == 1
    return state


def adopt(state: CoordinatorState, generation: int, members, **kw) -> Adoption:
    options = {"start_step": 0, "state_source": "", "leader": members[0], **kw}
    with state.cond:
        return state.adopt_generation_locked(generation, [info(m) for m in members], **options)


# -- formation and admission -----------------------------------------------------------


def test_generation_1_forms_once_every_lane_and_every_peer_is_ready():
    state = make_state()
    with state.cond:
        state.admit_locked(info("site0"))
        state.register_lane_locked(0, "127.0.0.1:2001")
        assert state.generation == 0  # site2 has not said it is ready
        state.admit_locked(info("site2"))
    assert state.generation == 1
    assert state.members == NAMES
    assert state.running


def test_admit_keeps_a_ready_site_only_once_and_the_first_info_stands():
    state = make_state()
    with state.cond:
        assert state.admit_locked(info("site0", lane="127.0.0.1:1111"))
        assert not state.admit_locked(info("site0", lane="127.0.0.1:6666"))
        assert list(state.ready_sites) == ["site0"]
        assert list(state.ready_sites["site0"].lane_addresses) == ["127.0.0.1:1111"]
        assert [i.name for i in state.infos_locked(NAMES)] == ["site0", "site1"]


def test_admit_refuses_a_site_that_is_no_peer():
    state = make_state()
    with state.cond, pytest.raises(ValueError, match="not a peer"):
        state.admit_locked(info("site1"))  # this site itself
    assert state.ready_sites == {}


def test_a_site_that_learns_the_job_runs_waits_to_be_admitted_instead_of_forming_one():
    state = make_state()
    with state.cond:
        state.register_lane_locked(0, "127.0.0.1:2001")
        assert state.await_admission_locked(4)
        assert not state.await_admission_locked(4)  # once
        for name in ("site0", "site2"):
            state.admit_locked(info(name))
    assert state.generation == 0 and state.joining and not state.excluded
    assert not state.running


def test_await_admission_is_no_news_to_a_member_of_a_running_job():
    state = running()
    with state.cond:
        assert not state.await_admission_locked(7)
    assert not state.joining


def test_told_ready_is_recorded_per_peer():
    state = make_state()
    with state.cond:
        state.mark_told_ready_locked("site0")
        state.mark_told_ready_locked("site0")
    assert state.told_ready == frozenset({"site0"})


# -- adopting a generation -----------------------------------------------------------------


def test_adopting_a_newer_generation_changes_the_members_and_clears_joining():
    state = running()
    with state.cond:
        state.exclude_locked("cut off")
    outcome = adopt(state, 3, ["site0", "site1"], start_step=9, leader="site0")
    assert outcome is Adoption.ADOPTED  # no state source: it does not pull the state
    assert state.generation == 3
    assert state.members == ["site0", "site1"]
    assert state.start_step == 9
    assert not state.joining and not state.excluded and state.running


def test_adopting_takes_the_members_lanes_from_the_proposal():
    state = running()
    moved = info("site0", lane="127.0.0.1:7777")
    with state.cond:
        state.adopt_generation_locked(
            2, [moved, info("site1")], start_step=0, state_source="", leader="site0"
        )
        lanes = list(state.infos_locked(["site0"])[0].lane_addresses)
    assert lanes == ["127.0.0.1:7777"]


@pytest.mark.parametrize("generation", [1, 2])
def test_an_older_or_equal_generation_is_ignored(generation):
    state = running()
    adopt(state, 2, ["site0", "site1", "site2"], start_step=5)
    outcome = adopt(state, generation, ["site0", "site1"], start_step=1)
    assert outcome is Adoption.STALE
    assert state.generation == 2
    assert state.members == NAMES
    assert state.start_step == 5


def test_a_left_out_site_admitted_back_is_readmitted_and_runs_from_the_start_step():
    state = running()
    with state.cond:
        state.commit_locked(3)
        state.exclude_locked("cut off")
    outcome = adopt(state, 5, NAMES, start_step=21, state_source="site0")
    assert outcome is Adoption.READMITTED
    assert state.committed_steps == 21  # the state it pulls has 21 steps applied
    assert state.state_source == "site0"


def test_a_member_that_was_not_left_out_is_not_readmitted():
    state = running()
    assert adopt(state, 2, NAMES, start_step=21, state_source="site0") is Adoption.ADOPTED
    assert state.committed_steps == 0


# -- exclusion, suspicion, commits, failure ----------------------------------------------------


def test_exclude_sets_excluded_and_joining_and_is_idempotent(caplog):
    state = running()
    caplog.set_level(logging.INFO, logger="isthmus.inter.control")
    with state.cond:
        assert state.exclude_locked("site0 is at generation 4 without this site")
        assert not state.exclude_locked("again")
    assert state.excluded and state.joining and not state.running
    assert state.generation == 1 and state.members == NAMES  # it keeps what it knew
    lines = [r.getMessage() for r in caplog.records if "joining again" in r.getMessage()]
    assert lines == ["[site1] site0 is at generation 4 without this site: joining again"]


def test_a_restarted_member_is_suspected_at_once_until_a_generation_takes_it_back():
    state = running()
    with state.cond:
        for name in NAMES:
            state.heard_from_locked(name)
        assert state.suspects_locked() == []
        state.suspect_locked("site2")
        assert state.suspects_locked() == ["site2"]
    adopt(state, 2, NAMES)
    with state.cond:
        assert state.suspects_locked() == []
    assert state.restarted == frozenset()


def test_a_silent_member_is_suspected_after_the_failure_timeout_and_not_before():
    clock = ManualClock()
    state = make_state(failure_timeout_s=0.2, clock=clock)
    state.mark_started()
    adopt(state, 1, NAMES)
    with state.cond:
        state.heard_from_locked("site0")
        assert state.suspects_locked() == []  # nobody silent for long yet
    clock.advance(0.19)
    with state.cond:
        assert state.suspects_locked() == []  # silent for just under the timeout: not yet
    clock.advance(0.02)
    with state.cond:
        state.heard_from_locked("site0")
        assert state.suspects_locked() == ["site2"]  # never this site itself


def test_commit_moves_the_next_step_forward_only():
    state = running()
    with state.cond:
        state.commit_locked(4)
        assert state.committed_steps == 5
        state.commit_locked(2)  # a late, older commit
    assert state.committed_steps == 5


def test_a_heartbeat_saying_a_peer_finished_is_a_claim_until_the_peer_answers():
    """Issue 63: a heartbeat in site0's name said it finished; only site0's own answer
    (the peer loop's heartbeat to it) says whether it did."""
    state = running()
    with state.cond:
        state.heartbeat_locked("site0", True, "ipv4:10.0.0.9:4242")
        state.heartbeat_locked("nobody", True, "ipv4:10.0.0.9:4242")  # no peer: not kept
    assert state.finished_claims == {"site0"} and state.finished_peers == frozenset()
    assert state.peer_steps == {}  # the heartbeat's step is not taken either
    with state.cond:
        belied = state.peer_progress_locked("site0", 141, False)
    assert belied == "ipv4:10.0.0.9:4242"  # site0 runs step 141: the claim was forged
    assert state.finished_claims == frozenset() and state.finished_peers == frozenset()
    assert state.peer_steps == {"site0": 141}
    with state.cond:
        state.heartbeat_locked("site0", True, "ipv4:127.0.0.1:5000")
        assert state.peer_progress_locked("site0", 300, True) is None  # it did finish
    assert state.finished_peers == {"site0"} and state.finished_claims == frozenset()


def test_the_first_error_stands():
    state = make_state()
    state.fail("site0 refused the join")
    state.fail("timed out")
    assert state.error == "site0 refused the join"


# -- every transition wakes a waiting thread ---------------------------------------------------


def _stage(state: CoordinatorState, name: str) -> Callable[[], None]:
    """The transition ``name`` on ``state`` (called by the test with nothing held)."""

    def locked(method: str, *args, **kw) -> Callable[[], None]:
        def run() -> None:
            with state.cond:
                getattr(state, method)(*args, **kw)

        return run

    return {
        "admit": locked("admit_locked", info("site0")),
        "register_lane": locked("register_lane_locked", 0, "127.0.0.1:2001"),
        "exclude": locked("exclude_locked", "cut off"),
        "suspect": locked("suspect_locked", "site2"),
        "commit": locked("commit_locked", 7),
        "adopt_generation": locked(
            "adopt_generation_locked",
            9,
            [info("site0"), info("site1")],
            start_step=3,
            state_source="",
            leader="site0",
        ),
        "await_admission": locked("await_admission_locked", 4),
        "fail": lambda: state.fail("boom"),
        "stop": state.stop,
        "wake": state.wake,
    }[name]


@pytest.mark.parametrize(
    "transition",
    [
        "admit",
        "register_lane",
        "exclude",
        "suspect",
        "commit",
        "adopt_generation",
        "await_admission",
        "fail",
        "stop",
        "wake",
    ],
)
def test_each_transition_wakes_a_thread_waiting_on_the_condition(transition):
    fresh = transition in ("admit", "register_lane", "await_admission")
    state = make_state() if fresh else running()
    change = _stage(state, transition)
    waiting = threading.Event()
    woken: list[bool] = []

    def waiter() -> None:
        with state.cond:
            waiting.set()  # the lock is released only inside wait(): the change comes after
            woken.append(state.cond.wait(timeout=5.0))  # False: timed out, nobody woke it

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    assert waiting.wait(5.0)
    change()
    thread.join(6.0)
    # wait() says True only when notified, False once its 5 s ran out: a transition that
    # forgot to notify fails here whatever the machine's load, with no clock to read.
    assert woken == [True], f"{transition} did not wake the waiter"


def test_a_stale_adoption_changes_nothing_that_waiters_would_see():
    state = running()
    before = (state.generation, state.members, state.start_step, dict(state.ready_sites))
    assert adopt(state, 1, ["site0", "site1"], start_step=8) is Adoption.STALE
    assert (state.generation, state.members, state.start_step, dict(state.ready_sites)) == before


# -- ballots: votes and decisions ---------------------------------------------------------------


def test_a_not_ok_site_vote_stands_against_a_later_ok():
    ballots = Ballots(running("site0"))
    with ballots.state.cond:
        ballots.vote_site_locked((4, 1), "site1", False, [])
        ballots.vote_site_locked((4, 1), "site1", True, ["site2"])
    assert ballots.site_votes[(4, 1)]["site1"] == (False, frozenset({"site2"}))


def test_a_rank_vote_counts_once_every_rank_voted_and_until_decided():
    state = make_state(ranks=2)
    ballots = Ballots(state)
    with state.cond:
        ballots.vote_rank_locked((0, 1), 0, True)
        assert ballots.voted_locked(2) == []
        ballots.vote_rank_locked((0, 1), 1, True)
        assert ballots.voted_locked(2) == [(0, 1)]
        ballots.decide_locked((0, 1), pb.Decision(step=0, verdict=pb.VERDICT_COMMIT, generation=1))
        assert ballots.voted_locked(2) == []


def test_a_commit_decision_commits_its_step_and_a_retry_does_not():
    state = running()
    ballots = Ballots(state)
    with state.cond:
        ballots.decide_locked((3, 1), ballots.retry_locked(3, "a round failed"))
        assert state.committed_steps == 0
        ballots.decide_locked((3, 1), pb.Decision(step=3, verdict=pb.VERDICT_COMMIT, generation=1))
    assert state.committed_steps == 4


def test_old_decisions_and_votes_are_dropped_a_few_steps_on():
    state = running()
    ballots = Ballots(state)
    with state.cond:
        ballots.vote_rank_locked((0, 1), 0, True)
        ballots.decide_locked((0, 1), pb.Decision(step=0, verdict=pb.VERDICT_COMMIT, generation=1))
        ballots.decide_locked((9, 1), pb.Decision(step=9, verdict=pb.VERDICT_COMMIT, generation=1))
    assert (0, 1) not in ballots.decisions and (0, 1) not in ballots.rank_votes
    assert (9, 1) in ballots.decisions


def test_a_site_admitted_back_hands_older_votes_a_rejoin_and_drops_its_joiners():
    state = running("site0")
    ballots = Ballots(state)
    with state.cond:
        ballots.add_joiner_locked(info("site2"))
        state.exclude_locked("cut off")
        outcome = ballots.adopt_locked(
            pb.ProposeRequest(
                generation=4,
                sites=[info(n) for n in NAMES],
                start_step=21,
                state_source="site1",
                leader="site1",
            )
        )
        assert outcome is Adoption.READMITTED
        rejoin = ballots.readmitted_locked((20, 1))
        assert rejoin is not None and rejoin.verdict == pb.VERDICT_REJOIN
        assert rejoin.state_step == 20 and rejoin.state_source == "site1"
        assert ballots.readmitted_locked((21, 4)) is None  # a vote of the new generation
    assert ballots.joiners == {}


def test_a_stale_adoption_keeps_the_joiners_waiting():
    state = running("site0")
    ballots = Ballots(state)
    with state.cond:
        ballots.add_joiner_locked(info("site2"))
        outcome = ballots.adopt_locked(
            pb.ProposeRequest(generation=1, sites=[info(n) for n in NAMES], leader="site0")
        )
    assert outcome is Adoption.STALE
    assert list(ballots.joiners) == ["site2"]
    assert ballots.rejoin is None
