"""A flood of long polls against a coordinator (inter/bounds.py ``WaitSlots`` and
``RePolls``; issue 33, row 9): the flooder holds its share of the slots only, its polls
answered at once are paced, and the ranks that train are still answered."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from coordinators import rank_key, start_sites, stop_all, vote_all
from helpers import wait_until

from isthmus.inter.bounds import RePolls
from isthmus.inter.control.coordinator_client import CoordinatorClient
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(90)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_caller_is_answered_at_once_for_a_burst_then_at_its_rate():
    clock = Clock()
    repolls = RePolls(per_s=2.0, burst=3, hold_s=0.0, holds=1, clock=clock)
    assert [repolls.too_fast("a") for _ in range(4)] == [False, False, False, True]
    assert repolls.too_fast("b") is False  # another caller has its own burst
    clock.now += 0.5  # one token back at 2/s
    assert [repolls.too_fast("a") for _ in range(2)] == [False, True]
    clock.now += 60  # never more than the burst
    assert [repolls.too_fast("a") for _ in range(4)] == [False, False, False, True]


def test_only_a_few_polls_are_held_at_once():
    repolls = RePolls(hold_s=5.0, holds=1)
    answers: list[tuple[bool, float]] = []

    def hold() -> None:
        start = time.monotonic()
        held = repolls.hold()
        answers.append((held, time.monotonic() - start))

    callers = [threading.Thread(target=hold) for _ in range(2)]
    for caller in callers:
        caller.start()
    # One takes the one hold; the other, none free, is refused, not held. Refused at
    # once, not after a hold of its own: half the 5 s hold a broken path waits leaves a
    # loaded machine seconds of slack and still tells the two apart.
    wait_until(lambda: answers, "neither caller was answered")
    assert answers[0][0] is False and answers[0][1] < repolls.hold_s / 2, answers
    repolls.release_all()
    for caller in callers:
        caller.join(5)
    assert [held for held, _ in answers] == [False, True]


def poll(stub, generation: int, wait_ms: int):
    return stub.GetMembership(
        pb.GetMembershipRequest(known_generation=generation, wait_ms=wait_ms), timeout=40
    )


def test_a_polling_flood_is_paced_and_the_ranks_still_commit(caplog):
    # Slow heartbeats and a long failure timeout: with the test's fast ones, a beat made
    # late by the flood on a loaded machine made the peer a suspect, and a suspect answers
    # every poll at once, in its slot and unpaced: the flood then cycled through two free
    # slots, nothing was held or refused, and the test failed (CI, 2026-12-01).
    coords = start_sites(2, heartbeat_s=0.5, failure_timeout_s=30.0, rpc_timeout_s=5.0)
    site0 = coords[0]
    channel = grpc.insecure_channel(site0.address)
    stub = pb_grpc.CoordinatorStub(channel)
    held = []
    try:
        generation = site0.generation
        # The flooder takes every slot it may wait in ...
        for _ in range(2 + 3):  # an unregistered caller waits in two slots at most
            held.append(
                stub.GetMembership.future(
                    pb.GetMembershipRequest(known_generation=generation, wait_ms=30_000),
                    timeout=40,
                )
            )
        # ... then asks again as soon as it is answered, from one thread for 2 s.
        answered, refused = 0, 0
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            try:
                poll(stub, generation, 30_000)
                answered += 1
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                refused += 1
        # Unpaced, a loop like this one is answered thousands of times in 2 s on loopback;
        # paced: the burst (20), 5/s after it, and a 1 s hold per poll past that.
        assert answered + refused < 60, (answered, refused)
        # A flooder of more threads than there are holds finds them taken: refused at
        # once, before any state is read.
        codes = []
        # More threads than the holds and the flooder's two slots together, released at
        # once, so some find every hold taken however the scheduler orders them.
        threads_n = site0.repolls.holds + 2 + 4
        start_together = threading.Barrier(threads_n)

        def flood_thread():
            start_together.wait(30)
            for _ in range(3):
                try:
                    # A short wait: a poll that finds a hold free is kept until then. With
                    # 30 s, the holds freed once by news (a late heartbeat on a loaded
                    # machine makes a peer suspect, which answers every poll) let each
                    # thread wait 3 x 30 s and the test ran past its 90 s.
                    poll(stub, generation, 3_000)
                except grpc.RpcError as exc:
                    codes.append(exc.code())

        threads = [threading.Thread(target=flood_thread) for _ in range(threads_n)]
        for t in threads:
            t.start()
        # Meanwhile the ranks vote and the job commits, in its own slots, and a rank's
        # membership poll (with its key) waits in the ranks' share, never paced.
        decisions = vote_all(coords, step=0, generation=generation)
        assert {d.verdict for d in decisions.values()} == {pb.VERDICT_COMMIT}
        rank0 = CoordinatorClient.connect(site0.address, rank_key=rank_key(site0))
        try:
            for _ in range(30):  # past any burst: a flooder would be paced by now
                now = rank0.membership_now(known_generation=0, wait_ms=0, timeout_s=5)
                assert now.generation == generation
        finally:
            rank0.close()
        for t in threads:
            t.join(30)
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
        # Logged once per caller and reason, however many times it happened.
        lines = [r.getMessage() for r in caplog.records if "re-polls faster" in r.getMessage()]
        assert len(lines) == 1 and "GetMembership at 127.0.0.1" in lines[0]
        assert site0.generation == generation  # the flood changed nothing
    finally:
        for call in held:
            call.cancel()
        channel.close()
        stop_all(coords)
