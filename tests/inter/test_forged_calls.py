"""Calls that claim to come from a site or rank they do not come from (issue 14): each
is settled by the site's own answer at its own address, or by the rank's key
(inter/control/admission.py, inter/control/replicas.py, inter/control/rank_keys.py). Real coordinators on
loopback (tests/coordinators.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc
import pytest
from coordinators import (
    FP,
    Coordinator,
    names,
    rank_key,
    running_sites,
    site1_restarted,
    vote,
    vote_all,
)
from helpers import wait_until

from isthmus.inter.control.coordinator import CoordinatorError
from isthmus.inter.security import SiteSecurity
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(90)


def test_a_late_copy_of_a_members_first_join_does_not_pass_for_a_restart():
    """Seen as a 6-step job hanging in CI: a join that site1 sent before the job began
    (generation 0) and site0 handled only after the first commit, as a slow server or a
    retried call can, made site0 take the live site1 for restarted. The same
    incarnation is the same process: such a join changes nothing."""
    with running_sites(2) as coords:
        assert {d.verdict for d in vote_all(coords, 0, 1).values()} == {pb.VERDICT_COMMIT}
        with coords[1].state.cond:
            info = coords[1].state.own_info_locked()
        late = pb.JoinRequest(
            site=info,
            fingerprint=pb.JobFingerprint(fields=FP),
            ready=True,
            generation=0,
            incarnation=coords[1].incarnations.mine,
        )
        with grpc.insecure_channel(coords[0].address) as channel:
            answer = pb_grpc.CoordinatorStub(channel).Join(late, timeout=5)
        assert answer.generation == 0  # not news: site1 is a member as it is
        with coords[0].state.cond:
            assert coords[0].state.suspects_locked() == []
            assert "site1" not in coords[0].state.restarted
        decisions = vote_all(coords, 1, 1)
        assert {d.verdict for d in decisions.values()} == {pb.VERDICT_COMMIT}, decisions
        assert all(names(d) == ["site0", "site1"] for d in decisions.values())


def _forged_join(site1: Coordinator) -> pb.JoinRequest:
    with site1.state.cond:
        info = site1.state.own_info_locked()
    request = pb.JoinRequest(
        site=info,
        fingerprint=pb.JobFingerprint(fields=FP),
        ready=True,
        generation=0,
        incarnation="f" * 16,  # another process than the job knows: "I restarted"
    )
    del request.site.lane_addresses[:]
    request.site.lane_addresses.append("127.0.0.1:6666")  # lanes the forger listens on
    return request


def test_a_forged_restart_is_belied_by_the_site_itself_and_changes_nothing():
    """Issue 14, row 2: one Join as site1 from generation 0 dropped the live site1 and
    admitted the caller's lanes, which then pulled the training state. site0 now asks
    site1 at its own address, which answers with its real incarnation and lanes."""
    with running_sites(2) as coords:
        assert {d.verdict for d in vote_all(coords, 0, 1).values()} == {pb.VERDICT_COMMIT}
        with grpc.insecure_channel(coords[0].address) as channel:
            pb_grpc.CoordinatorStub(channel).Join(_forged_join(coords[1]), timeout=5)
        # site1 has answered for itself: its answer belied the join's claim.
        wait_until(lambda: coords[0].refusals.count >= 1, "site1 never answered for itself")
        with coords[0].state.cond:
            assert coords[0].state.suspects_locked() == []
            assert coords[0].failover.ballots.joiners == {}
            assert coords[0].incarnations.get("site1") == coords[1].incarnations.mine
            lanes = list(coords[0].state.infos_locked(["site1"])[0].lane_addresses)
        assert lanes == ["127.0.0.1:2001"]
        decisions = vote_all(coords, 1, 1)
        assert {d.verdict for d in decisions.values()} == {pb.VERDICT_COMMIT}, decisions
        assert all(names(d) == ["site0", "site1"] for d in decisions.values())


def test_a_forged_digest_is_checked_with_the_site_itself_before_anything_stops():
    """Issue 14, row 1: one Heartbeat(site="site1", digest=...) stopped site0 with
    "replicas differ". A digest that differs is now asked of site1 at its own address;
    a real difference is still a divergence (tests/inter/test_observability.py)."""
    mine, forged = "a" * 64, "b" * 64
    with running_sites(2) as coords:
        with grpc.insecure_channel(coords[0].address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            report = pb.ReportProgressRequest(
                site="site0", step=10, digest=mine, digest_step=10, rank_key=rank_key(coords[0])
            )
            assert stub.ReportProgress(report, timeout=5).divergence == ""
            stub.Heartbeat(
                pb.HeartbeatRequest(site="site1", step=10, digest=forged, digest_step=10),
                timeout=5,
            )
            assert coords[0].replicas.agree_at(10, ["site0", "site1"]) is None  # in doubt
            wait_until(lambda: coords[0].replicas.doubted("site1") is None, "site1 never asked")
            # site1 has no step 10 yet: the claim goes, nothing stops.
            assert coords[0].replicas.latest().get("site1", (0, ""))[1] != forged
            assert coords[0].replicas.divergence is None
            assert stub.ReportProgress(report, timeout=5).divergence == ""
        # site1 reaches step 10 with the same parameters: the sites agree.
        with grpc.insecure_channel(coords[1].address) as channel:
            pb_grpc.CoordinatorStub(channel).ReportProgress(
                pb.ReportProgressRequest(
                    site="site1", step=10, digest=mine, digest_step=10, rank_key=rank_key(coords[1])
                ),
                timeout=5,
            )
        wait_until(
            lambda: coords[0].replicas.agree_at(10, ["site0", "site1"]) is True,
            "site1's own digest never arrived",
        )


def test_digests_claimed_far_ahead_are_refused_and_the_final_one_stays():
    """Issue 33, row 1: 16 Heartbeats in site1's name with digests for steps 10^9..
    evicted the real ones; both sites ended "no final digest from ['site1']". Claims
    that far past this site's step are refused (logged once per caller); the real
    final digest is kept."""
    mine = "a" * 64
    with running_sites(2) as coords, grpc.insecure_channel(coords[0].address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        report = pb.ReportProgressRequest(
            site="site0", step=10, digest=mine, digest_step=10, rank_key=rank_key(coords[0])
        )
        stub.ReportProgress(report, timeout=5)
        stub.Heartbeat(
            pb.HeartbeatRequest(site="site1", step=10, digest=mine, digest_step=10), timeout=5
        )
        before = coords[0].refusals.count
        for step in range(10**9, 10**9 + 16):
            stub.Heartbeat(  # the heartbeat is answered; its digest is not taken
                pb.HeartbeatRequest(site="site1", step=step, digest="b" * 64, digest_step=step),
                timeout=5,
            )
        assert coords[0].refusals.count == before + 16
        assert coords[0].replicas.agree_at(10, ["site0", "site1"]) is True
        assert coords[0].replicas.latest()["site1"] == (10, mine)


def test_a_not_ok_site_vote_stands_against_a_later_ok_for_the_same_round():
    """Issue 14, row 3: the first vote for a key won, so a forged "ok" sent ahead of a
    failed round could commit it. "Not ok" now stands once cast: at worst a forged
    vote makes the step run again."""
    with running_sites(2) as coords:
        with grpc.insecure_channel(coords[0].address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            for ok in (False, True):  # site1's failed round, then a forged "ok"
                stub.SiteVote(
                    pb.SiteVoteRequest(site="site1", step=0, generation=1, ok=ok, wait_ms=0),
                    timeout=5,
                )
        assert vote(coords[0], 0, 1).verdict == pb.VERDICT_RETRY


def test_a_rank_is_registered_by_one_process_only():
    with running_sites(2) as coords:
        with grpc.insecure_channel(coords[0].address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            request = pb.RegisterRankRequest(
                site="site0",
                rank=0,
                world_size=1,
                lane_address="127.0.0.1:2000",
                fingerprint=pb.JobFingerprint(fields=FP),
                rank_key=rank_key(coords[0]),
            )
            stub.RegisterRank(request, timeout=5)  # the rank retrying: the same key
            request.rank_key = "e" * 32
            with pytest.raises(grpc.RpcError) as refused:
                stub.RegisterRank(request, timeout=5)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "the key its launcher handed it" in refused.value.details()
        # The rank that registered first still votes.
        with grpc.insecure_channel(coords[0].address) as channel:
            vote0 = pb.CommitStepRequest(
                site="site0", rank=0, step=0, generation=1, ok=True, rank_key=rank_key(coords[0])
            )
            assert pb_grpc.CoordinatorStub(channel).CommitStep(vote0, timeout=5).step == 0


def test_a_propose_in_the_leaders_name_that_it_did_not_send_is_refused():
    """Found while replaying issue 14: a Propose in the job's order and in the real
    leader's name (anyone can read the members from GetMembership) moved site1 to a
    generation nobody else was in, and the job stopped ("no decision on step 4"). A
    member now asks the leader, at its own address, before adopting a generation."""
    with running_sites(2) as coords:
        assert {d.verdict for d in vote_all(coords, 0, 1).values()} == {pb.VERDICT_COMMIT}
        with coords[1].state.cond:
            sites = coords[1].state.infos_locked(coords[1].members)
        forged = pb.ProposeRequest(leader="site0", generation=2, sites=sites, start_step=1)
        with (
            grpc.insecure_channel(coords[1].address) as channel,
            pytest.raises(grpc.RpcError) as refused,
        ):
            pb_grpc.CoordinatorStub(channel).Propose(forged, timeout=5)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "site0 does not propose generation 2" in refused.value.details()
        assert coords[1].generation == 1
        decisions = vote_all(coords, 1, 1)
        assert {d.verdict for d in decisions.values()} == {pb.VERDICT_COMMIT}, decisions


TOKEN = "t0ken-of-this-job-" + "x" * 16
"""The job token every coordinator requires: the forger below holds it too."""


@contextlib.contextmanager
def _site1_restarted_and_joining(
    security: SiteSecurity,
) -> Iterator[tuple[list[Coordinator], int]]:
    """Two sites with the job token; site1 dies after step 0, site0 goes on alone and
    commits step 1, and site1 comes back (a new process) and asks to be admitted."""
    with running_sites(2, security=security) as coords:
        again, generation = site1_restarted(coords, "127.0.0.1:2999", security=security)
        wait_until(lambda: again.joining, "site1 never learned that the job runs")
        yield coords, generation


def test_a_forged_finished_heartbeat_does_not_stop_a_restarting_site():
    """Issue 63, high: Heartbeat(site="site0", finished=True) from a token holder to the
    restarted site1 was believed, and site1 exited "the job finished (site0 ran its last
    step) before site1 could be admitted" while site0 trained on alone. site1 now asks
    site0 itself, which says it has not finished: the claim is dropped, site1 admitted."""
    security = SiteSecurity(require_token=True, token=TOKEN)
    with _site1_restarted_and_joining(security) as (coords, generation):
        again = coords[1]
        forged = pb.HeartbeatRequest(site="site0", step=300, finished=True, generation=generation)
        with security.channel(again.address) as channel:
            pb_grpc.CoordinatorStub(channel).Heartbeat(forged, timeout=5)
        wait_until(lambda: "site1" in coords[0].failover.ballots.joiners, "site1 never joined")
        admit = vote(coords[0], 2, generation)
        assert admit.verdict == pb.VERDICT_COMMIT and names(admit) == ["site0", "site1"]
        # Before: CoordinatorError "the job finished (site0 ran its last step) ...".
        assert [s.name for s in again.wait_ready(10)] == ["site0", "site1"]
        assert again.start_step == 3 and again.error is None
        assert list(admit.admitted) == ["site1"] and admit.state_source == "site0"
        # site1 asked site0 at its configured address, and site0's answer belied it.
        wait_until(lambda: not again.state.finished_claims, "site1 never asked site0")
        assert again.state.finished_peers == frozenset()
        assert again.state.peer_steps["site0"] == coords[0].step  # site0's own word


def test_a_site_that_did_finish_still_stops_a_joiner_after_saying_so_itself():
    """The claim is asked, not ignored: when site0 really ran its last step, its own
    heartbeat tells the joining site1, which asks site0 and gives up with the reason
    (there is no step boundary left to admit it at)."""
    security = SiteSecurity(require_token=True, token=TOKEN)
    with _site1_restarted_and_joining(security) as (coords, _):
        again = coords[1]
        with security.channel(coords[0].address) as channel:
            pb_grpc.CoordinatorStub(channel).ReportProgress(
                pb.ReportProgressRequest(
                    site="site0", step=2, finished=True, rank_key=rank_key(coords[0])
                ),
                timeout=5,
            )
        with pytest.raises(CoordinatorError, match=r"the job finished \(site0 ran its last step\)"):
            again.wait_ready(10)
        assert again.state.finished_peers == {"site0"}
