"""A rank's cross-site sync opened with one call (inter/data/sync/rank.py), as deploy opens
it: real coordinators, real lanes on loopback. Opened, each rank's lane is in the
joined generation at its place; the membership's one ``adopt`` moves lane, peers and
rounds to another; its watcher raises the rank's abort signal for a silent site; an open
that the coordinator refuses leaves nothing listening; close ends everything it started."""

from __future__ import annotations

import dataclasses
import socket

import grpc
import pytest
import torch
from coordinators import coordinator, rank_key
from helpers import listening_on, wait_until
from lanes import inputs, run_all
from memberships import opened_sites, settings

from isthmus.inter.control.coordinator_client import CoordinatorClient
from isthmus.inter.data import Generation, RankSyncSettings, open_rank_sync
from isthmus.inter.data.round.context import Members


@pytest.mark.timeout(60)
def test_an_opened_rank_is_in_the_joined_generation_and_adopts_the_next_in_one_call():
    with opened_sites(2, decision_timeout_s=10.0) as (opened, _):
        joined = Generation.of(opened[0].joined)
        assert joined.names == ["site0", "site1"]
        for index, rank_sync in enumerate(opened):
            # One write at start-up: the joined generation, this site at its place.
            assert rank_sync.membership.current == joined
            assert rank_sync.lane.members == Members(joined.number, index, 2, ("site0", "site1"))
        # The next generation names the sites the other way round: each rank's one call
        # moves its lane (the chunks it takes), its place and its peers.
        swapped = Generation(joined.number + 1, tuple(reversed(joined.sites)))
        for rank_sync in opened:
            rank_sync.membership.adopt(swapped)
        assert [r.lane.members.site_index for r in opened] == [1, 0]
        assert all(r.membership.generation == swapped.number for r in opened)
        data = inputs(2, [5000], seed=3)
        want = data[0][0] + data[1][0]
        results = run_all(
            [
                lambda s=s: opened[s].sync.allreduce.allreduce(
                    data[s], step=1, group=0, average=False
                )
                for s in range(2)
            ]
        )
        assert not any(isinstance(r, BaseException) for r in results), results
        assert torch.equal(data[0][0], want) and torch.equal(data[1][0], want)
        # A generation without this site is refused in one line, and changes nothing.
        alone = Generation(swapped.number + 1, (swapped.sites[0],))
        with pytest.raises(ValueError, match="site0 is not a member of generation"):
            opened[0].membership.adopt(alone)
        assert opened[0].lane.members.generation == swapped.number
        assert opened[0].membership.current == swapped


@pytest.mark.timeout(60)
def test_the_watcher_reports_a_silent_site_to_the_rounds_abort_signal():
    with opened_sites(2, decision_timeout_s=10.0) as (opened, coords):
        abort = opened[0].membership.abort
        assert not abort.is_set()
        coords[1].stop(grace_s=0)  # site1 falls silent; site0's coordinator notices
        wait_until(abort.is_set, "the watcher reported site1", 15.0)
        assert "site1 fell silent" in abort.reason


@pytest.mark.timeout(60)
def test_close_ends_the_watcher_and_the_lane():
    with opened_sites(2, decision_timeout_s=10.0) as (opened, _):
        rank_sync = opened[0]
        port = int(rank_sync.lane.address.rsplit(":", 1)[1])
        assert listening_on(port)
        rank_sync.close()
        assert not rank_sync.membership.watcher.is_alive()
        wait_until(lambda: not listening_on(port), "the lane stopped listening", 5.0)


@pytest.mark.timeout(60)
def test_an_open_the_coordinator_refuses_leaves_no_lane_listening():
    names = ["site0", "site1"]
    coord = coordinator("site0", names)
    coord.set_peers({"site1": "127.0.0.1:1"}, None)  # never reached: the refusal comes first
    coord.start()
    client = CoordinatorClient.connect(coord.address, rank_key=rank_key(coord))
    with socket.socket() as probe:  # a free port, named so that it can be checked after
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    other_job = dataclasses.replace(
        settings("site0", names, timeout_s=5.0, decision_timeout_s=5.0),
        fingerprint={"job.seed": "1"},
        lane_port=port,
    )
    try:
        with pytest.raises(grpc.RpcError) as refused:
            open_rank_sync(other_job, client)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert not listening_on(port)
    finally:
        client.close()
        coord.stop()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"site": "site9"}, "site 'site9' is not one of"),
        ({"rank": 1}, r"rank 1 not in \[0, 1\)"),
        ({"chunk_bytes": 6}, "chunk_bytes must be a positive multiple of 4"),
        ({"transport": "pigeon"}, "transport must be one of"),
        ({"codec": "int9"}, "int9"),
    ],
)
def test_bad_settings_are_refused_before_anything_opens(change, message):
    good = settings("site0", ["site0", "site1"], timeout_s=5.0, decision_timeout_s=5.0)
    with pytest.raises(ValueError, match=message):
        RankSyncSettings(
            **{**{f.name: getattr(good, f.name) for f in dataclasses.fields(good)}, **change}
        )


@pytest.mark.timeout(60)
def test_the_watchers_waits_are_spread_so_a_sites_watches_come_apart(monkeypatch):
    """A site's ranks start together; watches that all asked the same wait were answered
    together, and sent again together, for good (1,024 at once at 1,024 ranks). Each asks
    75-100 % of the wait instead."""
    from isthmus.inter.data.sync import membership as membership_module

    monkeypatch.setattr(membership_module, "_WATCH_WAIT_MS", 200)
    asked: list[int] = []
    real = CoordinatorClient.membership_now

    def membership_now(self, *, known_generation, wait_ms, timeout_s, on_call=None):
        asked.append(wait_ms)
        return real(
            self,
            known_generation=known_generation,
            wait_ms=wait_ms,
            timeout_s=timeout_s,
            on_call=on_call,
        )

    monkeypatch.setattr(CoordinatorClient, "membership_now", membership_now)
    with opened_sites(2, decision_timeout_s=10.0):
        wait_until(lambda: len(asked) >= 12, "the watchers never asked again", 20.0)
    assert all(150 <= ms <= 200 for ms in asked), asked
    assert len(set(asked)) > len(asked) // 2, asked  # spread, not one wait for all
