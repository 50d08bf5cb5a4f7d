"""The chaos suite's quick subset (`isthmus chaos --quick`): real `isthmus site`
processes over emulated links, with sites killed, restarted and cut off mid-run.

Each scenario passes only when every surviving site exits 0 with the same final
parameter digest, and the membership really changed (docs/reliability.md).
"""

from __future__ import annotations

import pytest
from helpers import assert_one_line_error, run_cli

from isthmus.deploy.chaos import SCENARIOS, run_scenario

QUICK = [s for s in SCENARIOS if s.quick]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("scenario", QUICK, ids=[s.name for s in QUICK])
def test_survivors_finish_with_identical_replicas(scenario, tmp_path):
    result = run_scenario(scenario, tmp_path)
    assert result.ok, result.why
    assert set(result.digests) == set(scenario.survivors)
    assert len(set(result.digests.values())) == 1
    if scenario.name == "kill":
        assert result.min_live_sites == 1  # site0 trained on alone
    if scenario.name in ("kill-restart", "partition"):
        assert result.rejoined == ["site1"]  # it pulled site0's state and came back


def test_an_unknown_scenario_is_a_one_line_error(tmp_path):
    result = run_cli("chaos", "--only", "meteor", "--keep", str(tmp_path), timeout=60)
    assert_one_line_error(result, "unknown scenario(s) ['meteor']")
