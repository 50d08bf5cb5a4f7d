"""Voting on a round before landing it (LaneGradientSync.vote_ahead): two sites with real
coordinators, real lanes and real memberships on loopback, as deploy/rank/cross_site.py wires
a rank. An outer round with a delay lands steps after it ended; its vote is cast when it
ends, so the site that lands first finds the decision made without the other's finish."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import wait_until
from lanes import inputs, lane_pair, run_all
from memberships import joined_sites

import isthmus.inter.data.sync.membership as membership_module
from isthmus.inter.data.sync.gradient import LaneGradientSync
from isthmus.inter.data.sync.membership import QuorumLost, SiteMembership


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ahead", [True, False])
def test_a_round_voted_ahead_commits_before_the_other_site_lands_it(ahead):
    with joined_sites(decision_timeout_s=3.0) as (syncs, _):
        shards = inputs(2, [3000], seed=5)
        want = (shards[0][0] + shards[1][0]) / 2
        for s, sync in enumerate(syncs):
            sync.start(4, 0, shards[s][0])
            if ahead:
                sync.vote_ahead(4)
        # site1 lands the round while site0 is still training on (no finish yet): only
        # site0's vote cast ahead can make the decision.
        if not ahead:
            with pytest.raises(QuorumLost, match="no decision on step 4"):
                syncs[1].finish(4)
            return
        # Committed is the check: without site0's vote cast ahead there is no decision, and
        # the landing fails after its 3 s (as the branch above asserts), with no clock.
        landed = syncs[1].finish(4)
        assert landed.committed
        assert landed.stats.sites == 2
        assert torch.equal(shards[1][0], want)
        # site0 lands later and finds the same decision.
        assert syncs[0].finish(4).committed
        assert torch.equal(shards[0][0], want)
        # The next round votes the usual way, at finish, and still commits everywhere.
        for s, sync in enumerate(syncs):
            sync.start(5, 0, shards[s][0])
        results = run_all([lambda s=s: syncs[s].finish(5) for s in range(2)])
        assert all(not isinstance(r, BaseException) and r.committed for r in results), results


@pytest.mark.timeout(60)
def test_an_early_vote_that_breaks_is_logged_and_the_round_still_lands(monkeypatch, caplog):
    """vote_ahead is best effort, but an error it did not expect is reported, not lost
    on the lane's worker; the vote at landing then decides as before."""

    tried: list[str] = []

    def broken(self, step, generation):
        tried.append(self.site)
        raise ValueError(f"broken early vote {step}")

    monkeypatch.setattr(SiteMembership, "vote_ahead", broken)
    caplog.set_level("WARNING", logger="isthmus.inter.data.sync.gradient")
    with joined_sites(decision_timeout_s=5.0) as (syncs, _):
        shards = inputs(2, [3000], seed=6)
        want = (shards[0][0] + shards[1][0]) / 2
        for s, sync in enumerate(syncs):
            sync.start(4, 0, shards[s][0])
            sync.vote_ahead(4)
        # Land only once both early votes were tried (a landing first would skip them).
        wait_until(lambda: len(tried) >= 2, "the early votes were never tried")
        assert sorted(tried) == ["site0", "site1"]
        results = run_all([lambda s=s: syncs[s].finish(4) for s in range(2)])
        assert all(not isinstance(r, BaseException) and r.committed for r in results), results
        assert all(torch.equal(shards[s][0], want) for s in range(2))
    failed = [r for r in caplog.records if "early vote on step 4 failed" in r.getMessage()]
    assert len(failed) == 2
    assert all("broken early vote 4" in str(r.exc_info[1]) for r in failed)


@pytest.mark.timeout(30)
def test_vote_ahead_needs_the_steps_rounds_started():
    with lane_pair(2) as ars:
        sync = LaneGradientSync(ars[0])
        try:
            with pytest.raises(RuntimeError, match=r"vote_ahead\(3\) without rounds of step 3"):
                sync.vote_ahead(3)
        finally:
            sync.close()


@pytest.mark.timeout(60)
def test_closing_a_membership_ends_its_watchers_long_poll_at_once(monkeypatch):
    """A rank's last act is closing its membership: the watcher's long poll is cancelled,
    not waited out (it held every rank up to a second at the end of every job)."""
    monkeypatch.setattr(membership_module, "_WATCH_WAIT_MS", 30_000)
    with joined_sites(decision_timeout_s=3.0) as (syncs, _):
        membership = syncs[0].membership
        assert membership is not None
        # The watcher is in its 30 s poll: the call is out and unanswered.
        poll = lambda: membership.poll  # noqa: E731 (the call close() cancels)
        wait_until(lambda: poll() is not None and not poll().done(), "the watcher never polled")
        started = time.monotonic()
        membership.close()
        # Cancelled, not waited out: half the 30 s poll a broken close would wait.
        assert time.monotonic() - started < 15.0
        assert not membership.watcher.is_alive()
