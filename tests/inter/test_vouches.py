"""Deadlines measured against their owner's own lag (inter/control/vouches.py): which
ranks a host agent vouches for, and which ranks a coordinator finds silent
(inter/control/rank_liveness.py). Pure logic on a clock the test moves: a jump of the
clock between two checks is a stall of their owner (starved of CPU, stopped), which is
never its ranks' silence; a rank silent through checks on time is."""

from __future__ import annotations

import pytest
from helpers import ManualClock

from isthmus.inter.control.rank_liveness import CHECK_S, RankLiveness
from isthmus.inter.control.vouches import LATE_S, OwnTime, Vouches

VOUCH_S = 2.0
SILENCE_S = 10.0


def test_own_time_stands_still_while_its_owner_is_late():
    clock = ManualClock()
    own = OwnTime(clock)
    start = own.now()
    clock.advance(1.0 + LATE_S / 2)
    assert own.on_time(start + 1.0)  # a little late: still on time
    clock.advance(5.0)
    assert not own.on_time(start + 2.0)  # 4.x s late: the owner was away
    assert own.now() == pytest.approx(start + 2.0)  # that time is not its own
    clock.advance(0.5)
    assert own.now() == pytest.approx(start + 2.5)


def test_a_rank_is_vouched_for_while_it_watches_and_vouch_s_after():
    clock = ManualClock()
    vouches = Vouches(VOUCH_S, clock)
    assert vouches.hold("a") and vouches.hold("b")
    assert not vouches.hold("a")  # a second watch of a: nothing new
    assert vouches.keys() == ["a", "b"] and vouches.next_check() is None
    vouches.release("a")
    vouches.release("a")
    vouches.release("b")
    due = vouches.next_check()
    assert due == pytest.approx(vouches.time.now() + VOUCH_S)
    clock.advance(VOUCH_S / 2)
    assert not vouches.hold("b")  # b watches again before its time ran out
    clock.advance(VOUCH_S / 2)
    assert vouches.check(due)  # on time: a, silent for vouch_s, is dropped
    assert vouches.keys() == ["b"] and len(vouches) == 1


def test_a_late_check_drops_no_one_and_looks_again_once_caught_up():
    """The agent starved for 5 s: the ranks' next watches waited in its socket, unread,
    when its check came due. It drops no one then; a rank whose watch was read in the
    meantime stays, one that still has none is dropped at the next check on time."""
    clock = ManualClock()
    vouches = Vouches(VOUCH_S, clock)
    for key in ("live", "dead"):
        vouches.hold(key)
        vouches.release(key)
    due = vouches.next_check()
    clock.advance(VOUCH_S + 5.0)  # the check runs 5 s late
    assert not vouches.check(due)
    assert vouches.keys() == ["dead", "live"]
    again = vouches.next_check()
    assert again == pytest.approx(vouches.time.now() + LATE_S)
    vouches.hold("live")  # its watch, queued while the agent was away, is read
    clock.advance(LATE_S)
    assert vouches.check(again)
    assert vouches.keys() == ["live"]


def _watched(live: RankLiveness, rank: int) -> None:
    """One watcher poll of ``rank`` that ends now."""
    with live.polling([rank], watcher=True):
        pass


def _check_every(clock: ManualClock, live: RankLiveness, seconds: float) -> list[int]:
    """The failover loop's checks, on time, for ``seconds``; the last one's finding."""
    found: list[int] = []
    for _ in range(round(seconds / CHECK_S)):
        clock.advance(CHECK_S)
        found = live.silent()
        if found:
            break
    return found


def test_a_coordinator_that_was_away_declares_no_one_before_it_counted_the_polls():
    """The coordinator starved for longer than the silence: its check runs late, with the
    polls that waited meanwhile still unread. It declares no one; those polls, read next,
    keep their ranks alive, and a rank that truly stopped is declared after the silence
    of the coordinator's own time."""
    clock = ManualClock()
    live = RankLiveness(3, SILENCE_S, clock)
    for rank in range(3):
        _watched(live, rank)
    assert live.silent() == []
    clock.advance(SILENCE_S + 5.0)  # away: the check comes 15 s after the last
    assert live.silent() == []
    _watched(live, 0)  # the polls that waited in its sockets are read
    _watched(live, 1)
    held = live.polling([1], watcher=True)
    held.__enter__()  # rank 1's next poll is held open
    found = _check_every(clock, live, SILENCE_S + 1.0)
    assert found == [2], found  # only rank 2, silent through checks on time
    held.__exit__(None, None, None)


def test_ranks_are_found_silent_after_the_silence_when_the_coordinator_keeps_time():
    clock = ManualClock()
    live = RankLiveness(2, SILENCE_S, clock)
    _watched(live, 0)
    held = live.polling([1], watcher=True)
    held.__enter__()  # rank 1's poll stays in flight
    assert _check_every(clock, live, SILENCE_S - CHECK_S) == []
    assert _check_every(clock, live, 2 * CHECK_S) == [0]
    held.__exit__(None, None, None)


def test_a_rank_whose_agent_is_late_to_poll_but_sends_its_votes_is_alive():
    """The agent's poll ended and it is late to send the next (starved), but the host's
    ballots still come, a batch a step: each is its ranks' beat. A rank of the host that
    neither votes nor is vouched for is declared dead after the silence."""
    clock = ManualClock()
    live = RankLiveness(3, SILENCE_S, clock)
    with live.polling([0, 1, 2], watcher=True):  # the agent's last poll, for all three
        pass
    for _ in range(round(2 * SILENCE_S)):  # a step a second, ranks 0 and 1 voting
        live.voted([0, 1])
        found = _check_every(clock, live, 1.0)
        if found:
            break
    assert found == [2], found
