"""The frames between a rank and its host agent (inter/control/agent_wire.py) at their
edges: a frame cut short, a length prefix too large to be honest, a rank gone in the
middle of a vote. Real sockets: a real coordinator on loopback, a real ``HostAgent`` on a
Unix socket, the rank's own ``AgentConnection`` or a raw socket playing a broken one."""

from __future__ import annotations

import socket
import threading
import tracemalloc

import grpc
import pytest
from coordinators import agent_site
from helpers import wait_until

from isthmus.inter.control.agent_socket import AgentConnection, connect_agent
from isthmus.inter.control.agent_wire import HEADER, FrameError, Frames, Kind, StatusError, frame
from isthmus.inter.control.host_agent import HostAgent
from isthmus.proto import coordinator_pb2 as pb

pytestmark = pytest.mark.timeout(60)

FP = {"job.seed": "0"}


def test_frames_come_whole_however_the_bytes_are_cut():
    frames = [frame(Kind.VOTE, 7, b"x" * 300), frame(Kind.CANCEL, 8), frame(Kind.WATCH, 9, b"y")]
    stream = b"".join(frames)
    for cut in (1, 5, HEADER.size, 100, len(stream)):
        reader, got = Frames(), []
        for at in range(0, len(stream), cut):
            got += reader.feed(stream[at : at + cut])
        assert got == [(Kind.VOTE, 7, b"x" * 300), (Kind.CANCEL, 8, b""), (Kind.WATCH, 9, b"y")]
        assert reader.partial == 0
    reader = Frames()
    assert reader.feed(stream[:-1]) == [(Kind.VOTE, 7, b"x" * 300), (Kind.CANCEL, 8, b"")]
    assert reader.partial == HEADER.size  # the last frame's header, its byte still to come


def test_a_length_prefix_over_the_limit_is_refused_before_anything_is_held_for_it():
    reader = Frames(limit=1 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(FrameError, match="4294967295 bytes"):
            reader.feed(HEADER.pack(0xFFFFFFFF, Kind.VOTE, 1) + b"\0" * 1000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10 and reader.partial == 0


@pytest.fixture
def site(tmp_path):
    """A one-site job of two registered ranks and their host agent (``vouch_s`` 30: a
    rank it stops naming sooner was dropped for its closed connection)."""
    with agent_site(f"unix:{tmp_path}/a", 2, 1.5, with_clients=False, vouch_s=30) as site:
        yield site[:2]


def watch(connection: AgentConnection, key: str, wait_ms: int) -> int:
    request = pb.GetMembershipRequest(known_generation=1, wait_ms=wait_ms, rank_key=key)
    return connection.send(Kind.WATCH, request.SerializeToString())


def raw(agent: HostAgent) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(agent.address.removeprefix("unix:"))
    sock.settimeout(10)
    return sock


@pytest.mark.parametrize("cut", ["truncated", "oversized"])
def test_a_broken_stream_costs_the_agent_its_connection_and_nothing_else(site, cut):
    coord, agent = site
    key = coord.rank_keys.handed(0)
    request = pb.GetMembershipRequest(known_generation=1, wait_ms=0, rank_key=key)
    whole = frame(Kind.WATCH, 1, request.SerializeToString())
    with raw(agent) as sock:
        if cut == "truncated":  # a rank that dies mid-frame: nothing of it is taken
            sock.sendall(whole[:-3])
            sock.shutdown(socket.SHUT_WR)
        else:  # 4 GiB announced: the agent drops the connection at the header
            sock.sendall(HEADER.pack(0xFFFFFFFF, Kind.WATCH, 1) + b"\0" * 64)
        assert sock.recv(16) == b""  # closed by the agent, nothing answered
    assert agent.watches == 0 and agent.stats()["watch_polls"] == 0
    # The agent serves the next connection as before.
    connection = connect_agent(agent.address)
    try:
        kind, answer = connection.call(Kind.WATCH, request.SerializeToString(), 10)
        assert kind == Kind.MEMBERSHIP
        assert pb.GetMembershipResponse.FromString(answer).generation == 1
    finally:
        connection.close()


def test_an_agent_that_closes_mid_frame_is_unavailable_to_its_rank(tmp_path):
    path = tmp_path / "fake"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def half_an_answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)  # the rank's vote
            conn.sendall(frame(Kind.DECISION, 1, b"\x08\x01" * 10)[:12])

    thread = threading.Thread(target=half_an_answer)
    thread.start()
    connection = AgentConnection(path)
    try:
        with pytest.raises(StatusError) as ended:
            connection.call(Kind.VOTE, b"", 10)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "12 bytes of a frame unread" in ended.value.details()
    finally:
        connection.close()
        thread.join(10)
        server.close()


def test_a_rank_gone_mid_vote_is_vouched_for_no_more_at_once(site):
    """Rank 1 watches and votes through the agent, then its process ends (its connection
    closes) while its ballot waits for rank 0's: the ballot is withdrawn, and the agent's
    poll names rank 1 no more at once (not ``vouch_s``, 30 s, later), so its coordinator
    counts its silence from then and declares it dead."""
    coord, agent = site
    keys = [coord.rank_keys.handed(r) for r in range(2)]
    live = [connect_agent(agent.address) for _ in range(2)]
    try:
        for rank, connection in enumerate(live):
            watch(connection, keys[rank], 5_000)  # held there: both vouched for
        wait_until(lambda: agent.poll.keys == sorted(keys), "the agent never named both")
        ballot = pb.RankBallot(rank=1, ok=True, rank_key=keys[1])
        vote = pb.CommitHostStepRequest(
            site="site0", step=0, generation=1, ballots=[ballot], wait_ms=3_000, sites_known=True
        )
        live[1].send(Kind.VOTE, vote.SerializeToString())
        wait_until(lambda: agent.votes == 1, "the vote never reached the agent")
        live[1].close()  # rank 1's process ends
        wait_until(lambda: agent.poll.keys == [keys[0]], "rank 1 still vouched for", 5)
        assert agent.batches == 0  # its ballot was withdrawn, never sent
        liveness = coord.rank_liveness
        wait_until(lambda: liveness.left_for is not None, "rank 1 never declared dead", 15)
        assert liveness.left_for.startswith("rank 1 of site0 silent"), liveness.left_for
    finally:
        for connection in live:
            connection.close()
