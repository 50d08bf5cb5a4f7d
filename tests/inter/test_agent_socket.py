"""A rank trusts only a host agent of its own user that no one else can swap
(inter/control/agent_socket.py), waits for one slow to start, and says in one line when
it goes without. Real sockets: a real coordinator on loopback, real ``HostAgent``s on
Unix sockets, a squatter listening as another user (a forked child that became
``nobody``), the rank played by a real ``CoordinatorClient``."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import register_rank, wait_until

from isthmus.inter.control.channels import peer_channel
from isthmus.inter.control.coordinator import Coordinator, CoordinatorSettings
from isthmus.inter.control.coordinator_client import CoordinatorClient, Verdict
from isthmus.inter.control.host_agent import HostAgent

pytestmark = pytest.mark.timeout(60)

FP = {"job.seed": "0"}
NOBODY = 65534
LOGGER = "isthmus.coordinator_client"


@pytest.fixture
def coord():
    """A one-site job of one registered rank."""
    coord = Coordinator(
        CoordinatorSettings(site="site0", site_names=["site0"], ranks=1, fingerprint=FP)
    )
    coord.start()
    try:
        register_rank(coord.address, "site0", FP, key=coord.rank_keys.handed(0))
        coord.wait_ready(10)
        yield coord
    finally:
        coord.stop(grace_s=0)


@contextlib.contextmanager
def rank(coord: Coordinator, agent: str, **kw) -> Iterator[CoordinatorClient]:
    client = CoordinatorClient.connect(
        coord.address, rank_key=coord.rank_keys.handed(0), agent=agent, **kw
    )
    try:
        yield client
    finally:
        client.close()


@contextlib.contextmanager
def host_agent(coord: Coordinator, folder: Path) -> Iterator[HostAgent]:
    """The site's real agent, listening at ``folder``/agent."""
    with peer_channel(coord.address) as channel:
        agent = HostAgent(channel, site="site0", ranks=1, listen=f"unix:{folder}/agent")
        agent.start()
        try:
            yield agent
        finally:
            agent.stop()


def vote(client: CoordinatorClient, step: int):
    return client.commit_step(
        site="site0", rank=0, step=step, generation=1, ok=True, wait_ms=3_000, timeout_s=10
    )


def agent_lines(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.getMessage().startswith(("host agent", "no host agent"))
    ]


class Squatter:
    """A listener on ``folder``/agent run by another user: a child forked as root that
    enters the folder, becomes ``nobody`` and only then binds and listens, so the kernel
    records ``nobody`` as the listener. It counts the bytes anyone sends it."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "agent"
        ready_r, ready_w = os.pipe()
        self._stop_r, self._stop_w = os.pipe()
        self._report_r, report_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: raw system calls only, then _exit
            code = 1
            try:
                for fd in (ready_r, self._stop_w, self._report_r):
                    os.close(fd)  # the stop pipe ends only once no copy of its end is open
                os.chdir(folder)
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                self._serve(ready_w, report_w)
                code = 0
            finally:
                os._exit(code)
        os.close(ready_w)
        os.close(report_w)
        os.close(self._stop_r)
        readable, _, _ = select.select([ready_r], [], [], 10)
        ok = readable and os.read(ready_r, 1) == b"1"
        os.close(ready_r)
        assert ok, "the squatter never listened"

    def _serve(self, ready_w: int, report_w: int) -> None:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind("agent")  # relative: the folder is nobody's, its parents root's 0700
        server.listen(16)
        os.write(ready_w, b"1")
        conns: list[socket.socket] = []
        got = 0
        while True:
            readable, _, _ = select.select([server, self._stop_r, *conns], [], [])
            if self._stop_r in readable:
                break
            for s in readable:
                if s is server:
                    conns.append(server.accept()[0])
                elif isinstance(s, socket.socket):
                    data = s.recv(65536)
                    got += len(data)
                    if not data:
                        conns.remove(s)
                        s.close()
        os.write(report_w, str(got).encode())

    def stop(self) -> int:
        """Stops the child; returns the bytes it was sent."""
        os.close(self._stop_w)
        report = b""
        while chunk := os.read(self._report_r, 64):
            report += chunk
        os.close(self._report_r)
        _, status = os.waitpid(self.pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        return int(report)


@pytest.mark.skipif(os.geteuid() != 0, reason="playing another user needs root")
@pytest.mark.parametrize("files", ["theirs", "handed to us"])
def test_an_agent_served_by_another_user_gets_nothing(coord, tmp_path, caplog, files):
    folder = tmp_path / "squat"
    folder.mkdir(mode=0o700)
    os.chown(folder, NOBODY, NOBODY)
    squatter = Squatter(folder)
    got = None
    try:
        if files == "handed to us":
            # The socket and its folder made ours afterwards: only the listener's
            # credentials, which the kernel keeps, tell.
            os.chown(squatter.path, 0, 0)
            os.chown(folder, 0, 0)
        address = f"unix:{squatter.path}"
        with caplog.at_level(logging.WARNING, LOGGER), rank(coord, address) as client:
            assert vote(client, 0).verdict == Verdict.COMMIT  # at the coordinator
            now = client.membership_now(known_generation=1, wait_ms=100, timeout_s=10)
            assert now.generation == 1
            assert vote(client, 1).verdict == Verdict.COMMIT
    finally:
        got = squatter.stop()
    assert got == 0  # no vote, no key, not a byte
    assert agent_lines(caplog) == [
        f"host agent at {address} is served by uid {NOBODY}, not ours (0): "
        "calling the coordinator directly"
    ]


@pytest.mark.parametrize(
    ("parent_mode", "folder_mode", "open_part"),
    [
        pytest.param(0o700, 0o777, "folder", id="folder 0777"),
        pytest.param(0o700, 0o770, "folder", id="folder 0770"),
        # Sticky spares a folder above, never the socket's own.
        pytest.param(0o700, 0o1777, "folder", id="folder 1777"),
        # Whoever may write the folder above can swap the socket's folder.
        pytest.param(0o777, 0o700, "parent", id="parent 0777"),
    ],
)
def test_an_agent_whose_socket_others_could_swap_is_refused(
    coord, tmp_path, caplog, parent_mode, folder_mode, open_part
):
    parent = tmp_path / "parent"
    folder = parent / "agent-dir"
    folder.mkdir(parents=True)
    with host_agent(coord, folder) as agent:
        os.chmod(folder, folder_mode)  # after the bind: the real agent made its socket
        os.chmod(parent, parent_mode)
        with caplog.at_level(logging.WARNING, LOGGER), rank(coord, agent.address) as client:
            assert vote(client, 0).verdict == Verdict.COMMIT
            assert vote(client, 1).verdict == Verdict.COMMIT
        assert agent.votes == 0 and agent.batches == 0  # nothing went through it
    part, mode = (folder, folder_mode) if open_part == "folder" else (parent, parent_mode)
    assert agent_lines(caplog) == [
        f"host agent at {agent.address}: {part} is writable by others (mode {mode:04o}): "
        "calling the coordinator directly"
    ]


def test_an_agent_on_a_tcp_port_is_refused(coord, caplog):
    with peer_channel(coord.address) as channel:
        agent = HostAgent(channel, site="site0", ranks=1, listen="127.0.0.1:0").start()
        try:
            with caplog.at_level(logging.WARNING, LOGGER), rank(coord, agent.address) as client:
                assert vote(client, 0).verdict == Verdict.COMMIT
            assert agent.votes == 0
        finally:
            agent.stop()
    assert agent_lines(caplog) == [
        f"host agent at {agent.address} is not a Unix socket (who serves it cannot be "
        "checked): calling the coordinator directly"
    ]


def test_an_agent_slow_to_start_is_waited_for_then_used(coord, tmp_path, caplog):
    # Under a sticky folder anyone may write, as /tmp: an agent there is still ours.
    shared = tmp_path / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    folder = shared / "agent-dir"  # made by the agent, after the rank started
    address = f"unix:{folder}/agent"
    with caplog.at_level(logging.DEBUG, LOGGER), rank(coord, address, agent_wait_s=30) as client:
        assert client.agent is not None and not client.agent.checked
        assert vote(client, 0).verdict == Verdict.COMMIT  # meanwhile, at the coordinator
        folder.mkdir(mode=0o700)
        with host_agent(coord, folder) as agent:
            wait_until(lambda: client.agent.checked, "the rank never took its agent")
            assert vote(client, 1).verdict == Verdict.COMMIT
            assert agent.votes == 1 and agent.batches == 1
        assert client.agent_misses == 0
    assert not [line for line in agent_lines(caplog) if "calling the coordinator" in line]


def test_a_rank_whose_agent_never_comes_says_so_in_one_line(coord, tmp_path, caplog):
    address = f"unix:{tmp_path}/never/agent"
    with caplog.at_level(logging.WARNING, LOGGER), rank(coord, address, agent_wait_s=0.2) as c:
        wait_until(lambda: agent_lines(caplog), "the rank never said it has no agent")
        for step in range(3):
            assert vote(c, step).verdict == Verdict.COMMIT
            c.membership_now(known_generation=1, wait_ms=0, timeout_s=10)
        assert c.agent_misses == 0  # nothing was sent to an agent never checked
    (line,) = agent_lines(caplog)
    assert line.startswith(f"host agent at {address} not up after 0.2s, the rank's start-up (")
    assert line.endswith("): calling the coordinator directly")


def test_an_agent_gone_after_it_was_used_is_said_once(coord, tmp_path, caplog):
    with (
        caplog.at_level(logging.WARNING, LOGGER),
        host_agent(coord, tmp_path) as agent,
        rank(coord, agent.address) as client,
    ):
        assert vote(client, 0).verdict == Verdict.COMMIT
        assert agent.batches == 1 and not agent_lines(caplog)
        agent.stop()
        for step in (1, 2, 3):
            assert vote(client, step).verdict == Verdict.COMMIT
        assert client.agent_misses == 3
    (line,) = agent_lines(caplog)
    assert line.startswith(f"host agent at {agent.address} unreachable (")
    assert line.endswith("): calling the coordinator")
