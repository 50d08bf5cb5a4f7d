"""The links' figures over a run and the straggler rule (deploy/reports/links.py)."""

from __future__ import annotations

import pytest

from isthmus.deploy.reports.links import (
    STRAGGLER_SHARE,
    link_rows,
    link_summary,
    merge_links,
    straggler,
)


def test_the_slowest_link_is_a_straggler_only_well_below_the_others_median() -> None:
    assert straggler({"a->b": 1.0, "b->a": 0.5}) == ("b->a", "b->a", 0.5)
    named, slowest, share = straggler({"a->b": 1.0, "b->a": 0.9, "a->c": 2.0, "c->a": 1.1})
    assert named is None and slowest == "b->a" and share == pytest.approx(0.9 / 1.1)
    below = STRAGGLER_SHARE * 0.99
    assert straggler({"a->b": 1.0, "a->c": 1.0, "c->a": below})[0] == "c->a"
    assert straggler({"a->b": 1.0}) == (None, None, None)  # nothing to compare with


def bulk(gbytes: float, wire_s: float, rtt: float, retrans: int) -> dict:
    moved = int(gbytes * 1e9)
    return {
        "transport": "bulk",
        "bytes": moved,
        "wire_s": wire_s,
        "gbit_s": moved * 8 / wire_s / 1e9,
        "rtt_ms": rtt,
        "min_rtt_ms": rtt / 2,
        "retrans": retrans,
        "per_flow": [],
    }


def test_a_run_names_its_links_their_rates_and_the_straggler() -> None:
    grpc = {k: None for k in bulk(1, 1, 1, 0)} | {"transport": "grpc"}
    steps = [
        {
            "step": i,
            "links": merge_links(
                [
                    {"site": "a", "links": {"b": bulk(1, 8, 10, 1), "c": grpc}},
                    {"site": "b", "links": {"a": bulk(1, 16, 20 + i, 2)}},
                    {"site": "c", "links": {"a": bulk(1, 8, 10, 0)}},
                ]
            ),
        }
        for i in range(2)
    ]
    assert "per_flow" not in steps[0]["links"]["a->b"]
    summary = link_summary(steps, line_mbit=2000)
    links = summary["links"]
    assert links["a->b"]["gbit_s"] == pytest.approx(1.0) and links["b->a"]["gbit_s"] == 0.5
    assert links["a->b"]["line_share"] == pytest.approx(0.5)
    assert links["b->a"]["rtt_ms"] == 20.5 and links["b->a"]["min_rtt_ms"] == 10
    assert links["b->a"]["retrans"] == 4 and links["a->b"]["bytes"] == 2e9
    assert links["a->c"]["gbit_s"] is None and links["a->c"]["transport"] == "grpc"
    assert summary["straggler"]["link"] == "b->a"
    rows = dict(link_rows(summary))
    assert rows["straggler"].startswith("b->a (b->a at 50% of the others' median")
    assert rows["link a->b"] == "1.000 Gbit/s (50% of line rate), RTT 10.00 ms, 2 retransmits"
    assert rows["link a->c"] == "grpc: no socket figures"
    assert link_summary([{"step": 0, "links": {}}], 1000) == {}
