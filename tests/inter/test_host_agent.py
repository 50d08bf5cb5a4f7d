"""A host agent (inter/control/host_agent.py) between a site's ranks and their
coordinator: real coordinators on loopback, the agent on a Unix socket, the ranks played
by real ``CoordinatorClient``s on threads. Its lateness is injected (its event loop
stalled, as a host starved of CPU stalls it), never waited for."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from coordinators import agent_site, rank_key, start_sites, stop_all
from helpers import in_threads, wait_until

from isthmus.deploy.commands.certs import write_certs
from isthmus.inter.control.agent_upstream import LoopUpstream
from isthmus.inter.control.channels import peer_channel
from isthmus.inter.control.coordinator_client import CoordinatorClient, Verdict
from isthmus.inter.control.host_agent import HostAgent
from isthmus.inter.security import SiteSecurity
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

FP = {"job.seed": "0"}
RANKS = 4


@pytest.fixture
def site(tmp_path):
    """A one-site job of RANKS registered ranks, its host agent, and a client per rank."""
    # A linger far past the spread of the test's votes: on a loaded machine the four
    # threads' votes came more than the default 250 ms apart, in two batches. A batch
    # full of the host's votes goes at once, whatever the linger.
    with agent_site(f"unix:{tmp_path}/agent.sock", RANKS, 1.5, linger_s=3) as site:
        yield site


def vote(client: CoordinatorClient, rank: int, step: int = 0, wait_ms: int = 3_000):
    return client.commit_step(
        site="site0", rank=rank, step=step, generation=1, ok=True, wait_ms=wait_ms, timeout_s=10
    )


def all_vote(clients, ranks, **kw) -> dict[int, object]:
    """Each of ``ranks`` votes on its own thread; its decision, or the error it raised."""
    out: dict[int, object] = {}

    def one(rank: int) -> None:
        try:
            out[rank] = vote(clients[rank], rank, **kw)
        except grpc.RpcError as exc:
            out[rank] = exc

    in_threads(one, ranks, 20)
    return out


def test_a_hosts_votes_reach_the_coordinator_in_one_message(site):
    coord, agent, clients = site
    decisions = all_vote(clients, range(RANKS))
    assert {d.verdict for d in decisions.values()} == {Verdict.COMMIT}
    assert agent.batches == 1
    assert all(c.agent_misses == 0 for c in clients)
    # The next step likewise: the agent's session is reused, and each rank's vote is a
    # message on the one stream it keeps to the agent (a third of a call's cost there).
    decisions = all_vote(clients, range(RANKS), step=1)
    assert {d.verdict for d in decisions.values()} == {Verdict.COMMIT}
    assert agent.batches == 2
    assert agent.stats()["votes"] == 2 * RANKS and agent.stats()["rank_connections"] == RANKS


def test_a_late_rank_goes_in_a_batch_of_its_own_and_the_step_waits_for_it(site):
    coord, agent, clients = site
    early: dict[int, object] = {}
    thread = threading.Thread(target=lambda: early.update(all_vote(clients, range(RANKS - 1))))
    thread.start()
    wait_until(lambda: agent.batches == 1, "the early ranks' ballots were never sent")
    agent.linger_s = 0.05  # the late rank's batch of one goes well within their wait
    time.sleep(0.3)
    assert not early  # no decision without the last rank's vote
    late = vote(clients[RANKS - 1], RANKS - 1)
    thread.join(10)
    assert late.verdict == Verdict.COMMIT
    assert {d.verdict for d in early.values()} == {Verdict.COMMIT}
    assert agent.batches == 2


def test_one_ranks_refused_ballot_is_its_own_refusal(site):
    coord, agent, clients = site
    impostor = CoordinatorClient.connect(coord.address, rank_key="0" * 64, agent=agent.address)
    try:
        out = all_vote(clients, range(RANKS - 1), wait_ms=800)
        bad: list[grpc.RpcError] = []
        threading.Thread(target=lambda: None).start()
        try:
            vote(impostor, RANKS - 1, wait_ms=800)
        except grpc.RpcError as exc:
            bad.append(exc)
    finally:
        impostor.close()
    # The others' ballots counted; with one missing, their decision is still pending.
    assert {d.verdict for d in out.values()} == {Verdict.PENDING}
    assert bad and bad[0].code() == grpc.StatusCode.PERMISSION_DENIED
    # Voting again with their key, together, the ranks commit.
    decisions = all_vote(clients, range(RANKS))
    assert {d.verdict for d in decisions.values()} == {Verdict.COMMIT}


def test_a_batch_with_one_bad_ballot_is_retried_ballot_by_ballot(site):
    coord, agent, clients = site
    clients[RANKS - 1].rank_key = "0" * 64  # this rank's key is wrong from now on
    out = all_vote(clients, range(RANKS), wait_ms=800)
    assert out[RANKS - 1].code() == grpc.StatusCode.PERMISSION_DENIED
    assert {getattr(out[r], "verdict", out[r]) for r in range(RANKS - 1)} == {Verdict.PENDING}
    assert agent.batches == 1 + RANKS  # the batch, then each ballot alone


def watch_loop(client: CoordinatorClient, stop: threading.Event, replies: list) -> None:
    while not stop.is_set():
        replies.append(client.membership_now(known_generation=1, wait_ms=1_000, timeout_s=10))


def test_watches_through_the_agent_vouch_for_their_ranks_until_one_stops(site):
    coord, agent, clients = site
    stops = [threading.Event() for _ in range(RANKS)]
    replies: list[list] = [[] for _ in range(RANKS)]
    threads = [
        threading.Thread(target=watch_loop, args=(clients[r], stops[r], replies[r]))
        for r in range(RANKS)
    ]
    for t in threads:
        t.start()
    started = time.monotonic()
    try:
        # Past the failure timeout (three 1 s watches each): every rank watched, only
        # through the agent, and alive.
        wait_until(lambda: all(len(r) >= 3 for r in replies), "the watches never went on", 20)
        live = coord.rank_liveness
        assert live.left_for is None, (live.left_for, agent.stats())
        assert live.watched() == list(range(RANKS)), live.watched()
        assert all(c.agent_misses == 0 for c in clients)
        assert all(r and r[-1].generation == 1 and not r[-1].sites for r in replies)
        # The ranks' ~12 watches in one poll (sent again as each rank joined), held as
        # long as the coordinator holds a poll that vouches: half the silence (1.5 s).
        stats, held_s = agent.stats(), coord.rank_liveness.silence_s / 2
        polls = 2 + RANKS + (time.monotonic() - started) / held_s
        assert stats["watches"] >= 2 * RANKS and stats["watch_polls"] <= polls, stats
        # Rank 2's watch stops (as when its process dies): the agent stops vouching for
        # it, and the coordinator declares it dead, and only it (the site then leaves
        # the job and watches no rank until they register again: what stays is why).
        stops[2].set()
        wait_until(lambda: live.left_for is not None, "rank 2 never declared dead", 15)
        assert live.left_for.startswith("rank 2 of site0 silent"), live.left_for
    finally:
        for s in stops:
            s.set()
        for t in threads:
            t.join(5)


def test_an_agent_that_was_late_keeps_vouching_for_its_live_ranks(tmp_path):
    """The agent's host starves it (its event loop stalls for three times ``vouch_s``)
    right after its ranks' watches ended; their next watches wait in its socket. When
    it runs again, the check of their silence is late: it was the agent that was away,
    not the ranks, so none is dropped from its poll, and once their watches are read
    they are held as before. (An agent that judged by the wall clock dropped both, sent
    its poll again without them, and their coordinator went on counting their silence.)"""
    with agent_site(f"unix:{tmp_path}/a", 2, 60, vouch_s=0.5) as (coord, agent, clients):
        keys = sorted(coord.rank_keys.handed(r) for r in range(2))
        for client in clients:  # a watch each, answered at once: both vouched for
            client.membership_now(known_generation=1, wait_ms=0, timeout_s=10)
        wait_until(lambda: agent.poll.keys == keys, "the agent never vouched for both")
        polls = agent.stats()["watch_polls"]
        # Both watches ended just now; the agent stalls (a fault injected into its loop).
        agent.loop.call_soon_threadsafe(time.sleep, 1.5)
        out: list = []
        in_threads(
            lambda c: out.append(c.membership_now(known_generation=1, wait_ms=300, timeout_s=10)),
            clients,
            15,
        )
        assert len(out) == 2 and all(c.agent_misses == 0 for c in clients)
        assert agent.stats()["watch_polls"] == polls, agent.stats()
        assert agent.poll.keys == keys


def test_a_suspect_reaches_a_watch_through_the_agent_at_once(tmp_path):
    coords = start_sites(2)
    site0 = coords[0]
    channel = peer_channel(site0.address)
    agent = HostAgent(channel, site="site0", ranks=1, listen=f"unix:{tmp_path}/a.sock").start()
    client = CoordinatorClient.connect(site0.address, rank_key=rank_key(site0), agent=agent.address)
    try:
        generation = site0.generation
        first = client.membership_now(known_generation=generation, wait_ms=1_000, timeout_s=10)
        assert first.generation == generation and not first.suspects
        coords[1].stop(grace_s=0)  # site1 falls silent
        start = time.monotonic()
        while True:  # watch as a rank does, until the news comes
            now = client.membership_now(known_generation=generation, wait_ms=5_000, timeout_s=10)
            if now.suspects or now.generation != generation:
                break
            assert time.monotonic() - start < 15
        assert "site1" in now.suspects or now.generation > generation
        assert time.monotonic() - start < 5.0  # not a watch's whole 5 s wait after it
        assert client.agent_misses == 0
    finally:
        client.close()
        agent.stop()
        channel.close()
        stop_all(coords)


def test_a_rank_whose_agent_is_gone_votes_and_watches_at_the_coordinator(site):
    coord, agent, clients = site
    agent.stop()
    out = all_vote(clients, range(RANKS))
    assert {d.verdict for d in out.values()} == {Verdict.COMMIT}
    now = clients[0].membership_now(known_generation=0, wait_ms=0, timeout_s=5)
    assert now.generation == 1
    assert all(c.agent_misses >= 1 for c in clients)


def test_only_a_ranks_poll_may_vouch_and_for_a_hosts_worth(site):
    coord, agent, clients = site
    with grpc.insecure_channel(coord.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        keys = [coord.rank_keys.handed(r) for r in range(RANKS)]
        for request in (
            pb.GetMembershipRequest(known_generation=1, vouched_rank_keys=keys),  # no key
            pb.GetMembershipRequest(
                known_generation=1, rank_key=keys[0], vouched_rank_keys=keys * 100
            ),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetMembership(request, timeout=5)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert coord.rank_liveness.watched() == []


def test_a_step_waits_for_the_ranks_that_watch_here_not_for_the_count_it_was_told(site, tmp_path):
    coord, _, _ = site
    with peer_channel(coord.address) as channel:
        # Told 8 ranks, with a linger that would outlast the test: 4 watch through it.
        agent = HostAgent(
            channel, site="site0", ranks=8, listen=f"unix:{tmp_path}/told8", linger_s=60
        ).start()
        clients = [
            CoordinatorClient.connect(
                coord.address, rank_key=coord.rank_keys.handed(r), agent=agent.address
            )
            for r in range(RANKS)
        ]
        try:
            for client in clients:
                client.membership_now(known_generation=1, wait_ms=0, timeout_s=10)
            start = time.monotonic()
            decisions = all_vote(clients, range(RANKS))
            assert {d.verdict for d in decisions.values()} == {Verdict.COMMIT}
            assert time.monotonic() - start < 10 and agent.batches == 1
        finally:
            for client in clients:
                client.close()
            agent.stop()


def test_an_agent_on_its_launchers_channel_calls_the_coordinator_from_its_loop(tmp_path):
    """The launcher hands its agent the ranks' own channel (mutual TLS and the job token,
    ``peer_channel``): the agent calls the coordinator on that channel's grpc.aio twin,
    from its event loop, and its ranks' votes and watches go through as on any other."""
    write_certs(tmp_path / "certs", ["site0"])
    security = SiteSecurity.load(tmp_path / "certs", "site0", require_tls=True, require_token=True)
    with agent_site(f"unix:{tmp_path}/a", 2, security=security) as (coord, agent, clients):
        assert isinstance(agent.upstream, LoopUpstream)
        for client in clients:
            now = client.membership_now(known_generation=1, wait_ms=0, timeout_s=10)
            assert now.generation == 1
        wait_until(lambda: agent.stats()["watch_polls"] >= 2, "the agent never polled")
        for step in range(3):
            decisions = all_vote(clients, range(2), step=step)
            assert {getattr(d, "verdict", None) for d in decisions.values()} == {Verdict.COMMIT}, [
                (d.code(), d.details()) for d in decisions.values() if not hasattr(d, "verdict")
            ]
        assert agent.batches == 3 and agent.stats()["rank_connections"] == 2
        assert all(c.agent_misses == 0 for c in clients)


def test_an_event_for_a_stopped_agents_loop_is_no_traceback_on_the_console(caplog):
    """One launcher runs an agent per site, each on its own loop, and grpc.aio hands
    every loop the call events of one completion queue: an event of a call made on an
    agent's loop that has closed fails on the other's with "Event loop is closed", and
    asyncio printed it with a traceback on the launcher's console, under the job's one
    error line (2 of ~20 runs of a refused script on the 2-core machine). The agents'
    loops take that one quietly; any other failure of a callback is reported as ever."""
    import asyncio

    from isthmus.inter.control.host_agent import quiet_closed_loop_events

    def closed() -> None:
        raise RuntimeError("Event loop is closed")

    def other() -> None:
        raise RuntimeError("a real fault")

    loop = asyncio.new_event_loop()
    loop.set_exception_handler(quiet_closed_loop_events)
    try:
        with caplog.at_level("ERROR", logger="asyncio"):
            loop.call_soon(closed)
            loop.call_soon(other)
            loop.call_soon(loop.stop)
            loop.run_forever()
    finally:
        loop.close()
    reported = [r for r in caplog.records if r.name == "asyncio"]
    assert len(reported) == 1 and str(reported[0].exc_info[1]) == "a real fault", caplog.text


def test_an_agent_takes_only_a_channel_with_a_grpc_aio_twin(tmp_path):
    """Its calls wait on its loop, on the twin that ``peer_channel`` registers."""
    with grpc.insecure_channel("127.0.0.1:1") as channel:
        agent = HostAgent(channel, site="site0", ranks=1, listen=f"unix:{tmp_path}/a")
        with pytest.raises(ValueError, match="peer_channel"):
            agent.start()
