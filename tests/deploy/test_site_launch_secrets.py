"""What a site's launcher hands only its own ranks (deploy/launch/ranks.py ``SiteRanks``), with
real rank processes and a real coordinator in this process, as ``isthmus local`` and
``isthmus site`` run them (issue 33, rows 6 and 11):

* each rank's registration key, drawn by the coordinator: a stranger that registers
  rank 0 before the rank starts is refused and changes nothing, and the site trains;
* the ranks' rendezvous: a FileStore in a 0700 folder, no TCP port, removed at the end.
"""

from __future__ import annotations

import stat
import time
from pathlib import Path

import grpc
import pytest
from helpers import register_rank

from isthmus.deploy.config.job import load_config
from isthmus.deploy.launch.ranks import SiteRanks, prepare_run_dir
from isthmus.inter.control.coordinator import Coordinator, CoordinatorSettings

pytestmark = pytest.mark.timeout(240)


def test_a_stranger_cannot_register_a_rank_and_the_ranks_meet_in_a_private_store(tmp_path):
    config = load_config(
        None,
        ["model.preset=tiny", "train.seq_len=64", "job.steps=2", f"run.run_dir={tmp_path}"],
        {"topology.sites": 1, "topology.ranks_per_site": 2},
    )
    run_dir, _ = prepare_run_dir(config)
    fingerprint = config.fingerprint()
    coord = Coordinator(
        CoordinatorSettings(
            site="site0",
            site_names=config.site_names,
            ranks=2,
            fingerprint=fingerprint,
            join_timeout_s=120,
        )
    )
    coord.start()
    ranks = SiteRanks(config, "site0", run_dir, coord.address, {})
    try:
        # Before the ranks start, a local process claims rank 0 with the right
        # fingerprint (the run folder's config is readable) and a key of its own.
        with pytest.raises(grpc.RpcError) as info:
            register_rank(coord.address, "site0", fingerprint, key="s" * 32, world_size=2, lane="")
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "the key its launcher handed it" in info.value.details()
        assert coord.refusals.count == 1
        assert not coord.rank_keys.is_any_rank("s" * 32)  # nothing recorded

        ranks.start()
        store = ranks.store_dir
        assert store is not None and stat.S_IMODE(store.stat().st_mode) == 0o700
        deadline = time.monotonic() + 200
        while not ranks.done():
            failed = ranks.failed()
            assert failed is None, SiteRanks.describe_failure(failed)
            assert time.monotonic() < deadline, "the site never finished"
            time.sleep(0.2)
        # The real rank 0 registered with the key handed to it (in a job of one site
        # only rank 0 reports), and its reports counted: the site trained every step.
        assert coord.rank_keys.is_rank(0, coord.rank_keys.handed(0))
        assert coord.step == 2
    finally:
        ranks.close()
        coord.stop()
    assert not Path(store).exists()
