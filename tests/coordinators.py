"""Real coordinators on loopback for the control-plane tests (test_failover.py,
test_forged_calls.py, test_witness.py, test_fuzz.py): each site has one "rank" played
by the test, which registers and votes like deploy/rank/program.py does. Sites die by
stopping their coordinator; a partition cuts the emulated link."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

from helpers import in_threads, register_rank, wait_until

from isthmus.inter.control.channels import peer_channel
from isthmus.inter.control.coordinator import Coordinator, CoordinatorSettings
from isthmus.inter.control.coordinator_client import CoordinatorClient
from isthmus.inter.control.host_agent import HostAgent
from isthmus.inter.security import SiteSecurity
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc
from isthmus.sim import LinkSpec, RelayServer

FP = {"job.seed": "0"}
FAST = {"heartbeat_s": 0.1, "failure_timeout_s": 0.8, "rpc_timeout_s": 1.0}


COLLABORATORS = ("peers", "proxies", "security", "rank_keys", "clock")
"""What a Coordinator is handed besides its settings."""


def coordinator(site: str, names: list[str], **options) -> Coordinator:
    """One site's coordinator with the fast test settings, not started; ``options`` are
    settings (CoordinatorSettings) and collaborators (COLLABORATORS) alike."""
    handed = {k: options.pop(k) for k in COLLABORATORS if k in options}
    settings = {"ranks": 1, "fingerprint": FP, "join_timeout_s": 20, **FAST, **options}
    return Coordinator(CoordinatorSettings(site=site, site_names=names, **settings), **handed)


def start_sites(n: int, proxies=None, **options) -> list[Coordinator]:
    names = [f"site{i}" for i in range(n)]
    coords = [coordinator(name, names, **options) for name in names]
    addresses = {c.site: c.address for c in coords}
    for c in coords:
        c.set_peers(
            {s: a for s, a in addresses.items() if s != c.site},
            (proxies or {}).get(c.site),
        )
        c.start()
    for i, c in enumerate(coords):
        register(c, lane=f"127.0.0.1:{2000 + i}")
    for c in coords:
        c.wait_ready(20)
    return coords


@contextlib.contextmanager
def running_sites(n: int, proxies=None, **options) -> Iterator[list[Coordinator]]:
    """start_sites's coordinators, stopped after (stop_all): a site the test puts in
    the list in place of another (a restart) is the one stopped."""
    coords = start_sites(n, proxies, **options)
    try:
        yield coords
    finally:
        stop_all(coords)


def rank_key(coord: Coordinator) -> str:
    """The key the test's rank 0 of ``coord``'s site registers and votes with: the one
    the coordinator drew for its launcher to hand that rank (inter/control/rank_keys.py)."""
    return coord.rank_keys.handed(0)


def register(coord: Coordinator, lane: str) -> None:
    register_rank(
        coord.address, coord.site, FP, key=rank_key(coord), lane=lane, security=coord.security
    )


@contextlib.contextmanager
def agent_site(
    listen: str, ranks: int, failure_timeout_s: float = 10.0, with_clients: bool = True,
    security: SiteSecurity | None = None, **agent_options,
) -> Iterator[tuple[Coordinator, HostAgent, list[CoordinatorClient]]]:  # fmt: skip
    """A one-site job of ``ranks`` registered ranks and its host agent on the ranks'
    channel (``security``'s), started (listening at ``listen``; ``agent_options`` are
    HostAgent's), and, ``with_clients``, a client per rank that votes and watches
    through the agent. All stopped after."""
    settings = CoordinatorSettings(
        site="site0", site_names=["site0"], ranks=ranks, fingerprint=FP,
        failure_timeout_s=failure_timeout_s,
    )  # fmt: skip
    coord = Coordinator(settings, security=security)
    coord.start()
    channel = peer_channel(coord.address, security=security)
    agent = HostAgent(channel, site="site0", ranks=ranks, listen=listen, **agent_options)
    clients: list[CoordinatorClient] = []
    try:
        for rank in range(ranks):
            register_rank(
                coord.address, "site0", FP, key=coord.rank_keys.handed(rank),
                lane=f"127.0.0.1:{3000 + rank}", rank=rank, world_size=ranks, security=security,
            )  # fmt: skip
        coord.wait_ready(10)
        agent.start()
        for rank in range(ranks) if with_clients else ():
            key = coord.rank_keys.handed(rank)
            clients.append(
                CoordinatorClient.connect(
                    coord.address, security, rank_key=key, agent=agent.address
                )
            )
        yield coord, agent, clients
    finally:
        for client in clients:
            client.close()
        agent.stop()
        channel.close()
        coord.stop(grace_s=0)


def vote(coord: Coordinator, step: int, generation: int, ok: bool = True, wait_s: float = 15):
    """What a rank does: vote, then ask again until the decision is not PENDING."""
    deadline = time.monotonic() + wait_s
    with coord.security.channel(coord.address) as channel:  # its token, if it has one
        stub = pb_grpc.CoordinatorStub(channel)
        request = pb.CommitStepRequest(
            site=coord.site,
            rank=0,
            step=step,
            generation=generation,
            ok=ok,
            wait_ms=1000,
            rank_key=rank_key(coord),
        )
        while time.monotonic() < deadline:
            decision = stub.CommitStep(request, timeout=5)
            if decision.verdict != pb.VERDICT_PENDING:
                return decision
    raise AssertionError(f"{coord.site}: no decision on step {step} in {wait_s}s")


def vote_all(coords, step, generation, ok=None):
    ok = ok or {}
    results: dict[str, pb.Decision] = {}

    def one(c):
        results[c.site] = vote(c, step, generation, ok.get(c.site, True))

    in_threads(one, coords, 30)
    return results


def retry_until(coords, step, generation, members, ok):
    """Vote not-ok (as ranks whose rounds hit a dead site do) until a RETRY names
    exactly ``members``. Waits first until every voter suspects the sites that are not
    to stay (silence is noticed after failure_timeout_s), so a retry drops them."""

    def dropped(c: Coordinator) -> bool:
        with c.state.cond:
            return set(c.members) - set(members) <= set(c.state.suspects_locked())

    wait_until(lambda: all(dropped(c) for c in coords), f"{members}' peers never suspected")
    for _ in range(10):  # a leader that is not yet suspected may answer once more
        decisions = vote_all(coords, step=step, generation=generation, ok=ok)
        assert {d.verdict for d in decisions.values()} == {pb.VERDICT_RETRY}, decisions
        generation = next(iter(decisions.values())).generation
        if all(names(d) == members for d in decisions.values()):
            return generation
    raise AssertionError(f"never retried with {members} alone")


def restart_site1(address: str, site0: Coordinator, lane: str, **options) -> Coordinator:
    """A new site1 coordinator at ``address`` (its old one stopped), one rank registered;
    ``options`` as :func:`coordinator`'s."""
    host, port = address.rsplit(":", 1)
    again = coordinator("site1", ["site0", "site1"], host=host, port=int(port), **options)
    again.set_peers({"site0": site0.address})
    again.start()
    register(again, lane=lane)
    return again


def site1_restarted(coords: list[Coordinator], lane: str, **options) -> tuple[Coordinator, int]:
    """Of two sites, site1 dies after step 0 and site0 commits step 1 alone (in the
    generation returned); then a new site1 (restart_site1, registering ``lane``) takes
    its place in ``coords``, and is returned."""
    assert {d.verdict for d in vote_all(coords, 0, 1).values()} == {pb.VERDICT_COMMIT}
    address = coords[1].address
    coords[1].stop(grace_s=0)
    generation = retry_until(coords[:1], 1, 1, ["site0"], ok={"site0": False})
    assert vote(coords[0], 1, generation).verdict == pb.VERDICT_COMMIT
    coords[1] = restart_site1(address, coords[0], lane, **options)
    return coords[1], generation


def linked_pair(relay: RelayServer):
    """An emulated link between site0 and site1, and each site's proxy through it."""
    link = relay.add_link("site0-site1", LinkSpec.symmetric(latency_s=0.001))
    proxies = {
        "site0": {"site1": "http://{}:{}".format(*link.add_proxy(initiator="a"))},
        "site1": {"site0": "http://{}:{}".format(*link.add_proxy(initiator="b"))},
    }
    os.environ["no_grpc_proxy"] = "none.invalid"  # noqa: SIM112 (see deploy/launch/local.py)
    return link, proxies


def names(decision: pb.Decision) -> list[str]:
    return [info.name for info in decision.sites]


def stop_all(coords):
    for c in coords:
        c.leave()
    for c in coords:
        c.stop(grace_s=0.2)
