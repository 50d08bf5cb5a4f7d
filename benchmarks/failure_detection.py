"""What a dead site costs, and what a lossy, jittery link costs in false suspicions
(issue 62, item 3; inter/control/arrivals.py).

stall: `isthmus chaos`'s kill-first scenario (2 sites and a witness, 5 ms each way, per-step
sync; site0 SIGKILLed at step 4) with the default failover settings (heartbeats every
0.2 s, a deadline learned from them, 10 s at most) against a fixed 10 s timeout (the same
code with heartbeats every 2.5 s: a floor of 4 periods is then the 10 s ceiling, which is
how every site was judged before). The stall is the survivor's retried step's sync time
less its median step's.

suspicions: two real coordinators (default settings) whose link loses 1 % of its segments
(each stall 200 ms, Linux's least retransmission timeout) and jitters 5 ms, for
--minutes: how often either suspected the other, and the deadlines it learned.

    python3 benchmarks/failure_detection.py --out /tmp/fd [--repeats 2] [--minutes 30]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import _common

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from isthmus.deploy.chaos.judge import metrics_records  # noqa: E402
from isthmus.deploy.chaos.scenarios import SCENARIOS  # noqa: E402
from isthmus.deploy.chaos.suite import run_scenario  # noqa: E402
from isthmus.inter.control.coordinator import Coordinator, CoordinatorSettings  # noqa: E402
from isthmus.sim import LinkSpec, RelayServer  # noqa: E402
from isthmus.sim.impairments import Jitter, Loss  # noqa: E402

RULES = {"learned": ("failover.heartbeat_s=0.2",), "fixed 10 s": ("failover.heartbeat_s=2.5",)}


def stall_s(work: Path, overrides: tuple[str, ...]) -> dict:
    scenario = replace(next(s for s in SCENARIOS if s.name == "kill-first"), steps=10)
    result = run_scenario(scenario, work, overrides=("failover.failure_timeout_s=10", *overrides))
    lines = metrics_records(work / "run" / "sites" / "site1" / "metrics.jsonl")
    syncs = [line["sync_s"] for line in lines]
    retried = [line["sync_s"] for line in lines if line.get("retries")]
    stall = max(retried or syncs) - statistics.median(syncs) if syncs else float("nan")
    return {"ok": result.ok, "why": result.why, "stall_s": stall, "steps": len(lines)}


def suspicions(minutes: float) -> dict:
    impairments = (Loss(rate=0.01, delay_ms=200.0), Jitter(ms=5.0))
    relay = RelayServer().start()
    link = relay.add_link("a-b", LinkSpec.symmetric(latency_s=0.005, impairments=impairments))
    names = ["site0", "site1"]
    coords = [
        Coordinator(CoordinatorSettings(site=n, site_names=names, ranks=1, fingerprint={}))
        for n in names
    ]
    proxies = [f"http://{h}:{p}" for h, p in (link.add_proxy("a"), link.add_proxy("b"))]
    for coord, peer, proxy in zip(coords, reversed(coords), proxies, strict=True):
        coord.set_peers({peer.site: peer.address}, {peer.site: proxy})
        coord.start()
    from helpers import register_rank

    for i, coord in enumerate(coords):
        register_rank(coord.address, coord.site, {}, key=coord.rank_keys.handed(0), lane=f"x:{i}")
    for coord in coords:
        coord.wait_ready(60)
    counted, suspected, deadlines = 0, [False, False], []
    learned = time.monotonic() + 10.0  # deadlines once 8 gaps are known (MIN_GAPS)
    end = time.monotonic() + 60 * minutes
    while time.monotonic() < end:
        for i, (coord, peer) in enumerate(zip(coords, reversed(coords), strict=True)):
            with coord.state.cond:
                now = peer.site in coord.state.suspects_locked()
                if time.monotonic() > learned:
                    deadlines.append(coord.state.arrivals.deadline_s(peer.site))
            if now and not suspected[i]:
                counted += 1
                with coord.state.cond:
                    silent = time.monotonic() - coord.state.last_seen.get(peer.site, 0.0)
                    lag = coord.state.arrivals.own_lag_s()
                print(
                    f"{coord.site} suspects {peer.site}: silent {silent:.2f} s, own lag {lag:.2f} s"
                )
            suspected[i] = now
        time.sleep(0.05)
    stats = link.stats()
    for coord in coords:
        coord.stop(grace_s=0)
    relay.close()
    return {
        "minutes": minutes,
        "false_suspicions": counted,
        "deadline_s_median": statistics.median(deadlines),
        "deadline_s_p99": statistics.quantiles(deadlines, n=100)[98],
        "deadline_s_max": max(deadlines),
        "link": stats,
    }


def main() -> None:
    p = _common.parser(__doc__, "folder for the runs and failure_detection.json")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--minutes", type=float, default=30.0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for k in range(args.repeats):
        for rule, overrides in RULES.items():
            with tempfile.TemporaryDirectory(dir=args.out) as work:
                row = {"rule": rule, "repeat": k, **stall_s(Path(work), overrides)}
            rows.append(row)
            print(
                f"{rule:>11}  run {k}: stall {row['stall_s']:6.2f} s  ok={row['ok']} {row['why']}"
            )
    quiet = suspicions(args.minutes) if args.minutes > 0 else {}
    if quiet:
        print(
            f"lossy link, {quiet['minutes']:g} min: {quiet['false_suspicions']} false "
            f"suspicions; deadline median {quiet['deadline_s_median']:.2f} s, "
            f"p99 {quiet['deadline_s_p99']:.2f} s, max {quiet['deadline_s_max']:.2f} s"
        )
    _common.write_json(args.out / "failure_detection.json", {"stall": rows, "lossy_link": quiet})


if __name__ == "__main__":
    main()
