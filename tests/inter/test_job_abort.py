"""A job-level abort on real coordinators on loopback (inter/control/abort.py): a rank's
script raised, its coordinator hears it (AbortJob) and every peer learns it from that
site's own answers; a call without the rank's key, or a malformed one, changes nothing."""

from __future__ import annotations

import time

import grpc
import pytest
from coordinators import rank_key, start_sites, stop_all
from helpers import wait_until

from isthmus.inter.control.abort import JobAbort
from isthmus.inter.control.coordinator_client import CoordinatorClient

pytestmark = pytest.mark.timeout(60)


def test_a_scripts_error_reaches_every_site_from_the_raising_sites_answers():
    coords = start_sites(3)
    site0, site1, site2 = coords
    try:
        client = CoordinatorClient.connect(site1.address, rank_key=rank_key(site1))
        refused = []
        for call in (
            dict(site="site1", rank=0, reason="x.py: ValueError: a", key="k" * 32),  # not its key
            dict(site="site0", rank=0, reason="x.py: ValueError: a", key=rank_key(site1)),
            dict(site="site1", rank=5, reason="x.py: ValueError: a", key=rank_key(site1)),
        ):
            client.rank_key = call.pop("key")
            with pytest.raises(grpc.RpcError) as err:
                client.abort_job(**call, timeout_s=5)
            refused.append(err.value.code().name)
        assert refused == ["PERMISSION_DENIED", "INVALID_ARGUMENT", "INVALID_ARGUMENT"]
        assert all(c.aborted is None for c in coords)  # refused: nothing changed

        client.rank_key = rank_key(site1)
        started = time.monotonic()
        client.abort_job(site="site1", rank=0, reason="x.py: ValueError: bad\nbatch", timeout_s=5)
        client.close()
        line = "site1 rank 0: x.py: ValueError: bad batch"
        assert site1.aborted == line and site1.aborted_here
        # Each peer hears it in its next heartbeat to site1 (every 0.1 s here).
        wait_until(lambda: site0.aborted == line and site2.aborted == line, "peers heard")
        assert not site0.aborted_here and not site2.aborted_here
        assert site1.tell_peers_of_abort() == []
        assert time.monotonic() - started < 5
        # An abort is not a failure of the membership: nobody failed over.
        assert all(c.error is None and c.generation == 1 for c in coords)
    finally:
        stop_all(coords)


def test_a_peer_speaks_only_for_its_own_ranks_and_the_first_abort_stands():
    abort = JobAbort("site0", ["site1", "site2"], time.monotonic)
    assert not abort.learn("site1", "site2 rank 0: x.py: E")  # another site's name
    assert not abort.learn("site1", "site1 rank 0: " + "e" * 700)  # not one short line
    assert not abort.learn("site9", "site9 rank 0: x.py: E")  # not a peer
    assert abort.line is None and abort.answer_for("site1") == ""
    assert abort.learn("site2", "site2 rank 1: x.py: E")
    assert not abort.raise_here(0, "y.py: F")  # the first abort stands
    assert abort.line == "site2 rank 1: x.py: E" and not abort.here
    assert abort.answer_for("site1") == ""  # only the raising site answers with it
