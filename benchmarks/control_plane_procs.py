"""The processes of benchmarks/control_plane.py: one site's coordinator, a site's real
host agents (a process each), and a process of simulated ranks (or simulated per-host
agents) that register, long poll and vote per step as real ranks do. The benchmark
spawns this folder's control_plane.py with ``--serve-coordinator``, ``--serve-agents``
or ``--serve-ranks``, which call into here.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field

SECRET = b"control-plane-benchmark-secret!!"
"""The site secret the simulated ranks derive their keys from (rank_keys.derived_key)."""
FINGERPRINT = {"job.seed": "0", "bench": "control_plane"}
VOTE_WAIT_MS = 2_000  # inter/data/sync/membership.py _VOTE_WAIT_MS
WATCH_WAIT_MS = 5_000  # inter/data/sync/membership.py _WATCH_WAIT_MS
HOST_WATCH_WAIT_MS = 10_000
"""An agent's watch: answered at once on news (a suspect, a generation) like a rank's,
so a longer wait costs nothing but the polls it saves; a rank's 1 s polls, in phase with
1 s steps, landed on the coordinator in the same burst as the step's votes."""
RPC_SLACK_S = 5.0
STEP_TIMEOUT_S = 60.0
"""A step not decided everywhere by then: the configuration did not keep up."""
RANKS_PER_CHANNEL = 8
"""Simulated ranks sharing one client channel (one TCP connection): a host's ranks."""


# -- a coordinator process ----------------------------------------------------------------


def serve_coordinator(site: str, names: list[str], ranks: int, failure_timeout_s: float) -> None:
    """Runs one site's coordinator: prints its address, reads the peers' addresses
    (one JSON line), starts, and serves until stdin closes or says "stop"."""
    from isthmus.inter.control.coordinator import Coordinator, CoordinatorSettings
    from isthmus.inter.control.rank_keys import RankKeys

    settings = CoordinatorSettings(
        site=site,
        site_names=names,
        ranks=ranks,
        fingerprint=FINGERPRINT,
        join_timeout_s=600.0,
        heartbeat_s=1.0,
        failure_timeout_s=failure_timeout_s,
        rpc_timeout_s=10.0,
    )
    coordinator = Coordinator(settings, rank_keys=RankKeys.derive(site, ranks, SECRET))
    declared = _record_declared_dead(coordinator)
    print(coordinator.address, flush=True)
    peers = json.loads(sys.stdin.readline())
    coordinator.set_peers({name: address for name, address in peers.items() if name != site})
    coordinator.start()
    print("started", flush=True)
    for line in sys.stdin:
        if line.strip() == "stop":
            break
    print(json.dumps({"declared_dead": sorted(declared)}), flush=True)
    coordinator.stop(grace_s=0.5)


def _record_declared_dead(coordinator) -> set[int]:
    """The ranks the coordinator's failover loop found silent (and so declared dead:
    inter/control/failover.py ``_watch_ranks``), gathered as it finds them."""
    declared: set[int] = set()
    liveness = coordinator.failover.rank_liveness
    silent = liveness.silent

    def recorded() -> list[int]:
        found = silent()
        declared.update(found)
        return found

    liveness.silent = recorded
    return declared


# -- host agents, a process each -------------------------------------------------------------


def serve_agents(site: str, address: str, ranks: int, host_ranks: int, folder: str) -> None:
    """Runs one real HostAgent per host of ``host_ranks`` ranks, each in a process of its
    own as a node's launcher runs it (deploy/launch/ranks.py), listening on
    ``unix:FOLDER/FIRST`` (FIRST: the host's first rank). The processes are forked from
    this one once it imported gRPC and the agent (no gRPC object made yet: forking is
    safe), as the launcher's zygote forks ranks. Prints their pids as one JSON line once
    every agent listens; on "stop" (or stdin closed) stops them and prints their stats
    summed (one JSON line)."""
    import signal

    from isthmus.inter.control.channels import peer_channel
    from isthmus.inter.control.host_agent import HostAgent

    children: list[tuple[int, int]] = []  # (pid, read end of its pipe)
    for first in range(0, ranks, host_ranks):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the agent's process
            os.close(read)
            for _, other in children:
                os.close(other)
            code = 1
            try:
                _agent_process(
                    HostAgent,
                    peer_channel(address),
                    site=site,
                    ranks=min(host_ranks, ranks - first),
                    listen=f"unix:{folder}/{first}",
                    out=write,
                )
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        children.append((pid, read))
    streams = [os.fdopen(read) for _, read in children]
    for (pid, _), stream in zip(children, streams, strict=True):
        if stream.readline().strip() != "up":
            raise RuntimeError(f"host agent {pid} of {site} did not start")
    print(json.dumps({"pids": [pid for pid, _ in children]}), flush=True)
    for line in sys.stdin:
        if line.strip() == "stop":
            break
    for pid, _ in children:
        os.kill(pid, signal.SIGTERM)
    totals: dict[str, int] = {}
    for stream in streams:
        line = stream.readline()
        for name, value in (json.loads(line) if line else {}).items():
            totals[name] = totals.get(name, 0) + value
    for pid, _ in children:
        os.waitpid(pid, 0)
    print(json.dumps(totals), flush=True)


def _agent_process(agent_type, channel, *, site: str, ranks: int, listen: str, out: int) -> None:
    """One agent's process: serves until SIGTERM, then writes its stats to ``out``."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with its parent
    # Blocked before any thread starts (they inherit the mask): only sigwait takes it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    agent = agent_type(channel, site=site, ranks=ranks, listen=listen).start()
    os.write(out, b"up\n")
    signal.sigwait({signal.SIGTERM})
    agent.stop()
    stats = {k: v for k, v in agent.stats().items() if isinstance(v, int)}
    os.write(out, (json.dumps(stats) + "\n").encode())
    channel.close()


# -- a process of simulated ranks -----------------------------------------------------------


@dataclass
class StepTimes:
    """What one site's ranks saw of one step (CLOCK_MONOTONIC seconds)."""

    step: int
    first_vote: float = 0.0
    last_vote: float = 0.0
    first_seen: float = 0.0
    last_seen: float = 0.0
    verdicts: dict[str, int] = field(default_factory=dict)
    repolls: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    """Votes that failed (deadline, overload) and were sent again, as a rank does."""
    timed_out: bool = False


_METHOD = "/isthmus.v1.Coordinator/"


class AgentWire:
    """A simulated rank's connection to its host agent: the rank's own
    ``AgentConnection``, opened and checked as a rank's client opens it
    (inter/control/agent_socket.py, ``connect_agent``), its frames read by the event loop
    instead of a waiting thread (thousands of ranks share one process here)."""

    def __init__(self, address: str) -> None:
        from isthmus.inter.control.agent_socket import connect_agent

        self.connection = connect_agent(address)
        self._waiting: dict[int, asyncio.Future] = {}
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.connection.fileno(), self._readable)

    def _readable(self) -> None:
        import grpc

        from isthmus.inter.control.agent_wire import StatusError

        for kind, rid, payload in self.connection.receive():
            waiting = self._waiting.pop(rid, None)
            if waiting is not None and not waiting.done():
                waiting.set_result((kind, payload))
        if self.connection.broken:
            self._loop.remove_reader(self.connection.fileno())
            for waiting in self._waiting.values():
                if not waiting.done():
                    waiting.set_exception(
                        StatusError(grpc.StatusCode.UNAVAILABLE, self.connection.broken)
                    )

    async def call(self, kind: int, request: bytes, timeout_s: float) -> bytes:
        """``request`` (a frame of ``kind``) to the agent; its answer's payload.

        Raises:
            StatusError: the agent's refusal, or the connection broke.
            TimeoutError: no answer in ``timeout_s``.
        """
        from isthmus.inter.control.agent_wire import Kind, status_error

        rid = self.connection.send(kind, request)
        answer = self._waiting[rid] = self._loop.create_future()
        try:
            kind, payload = await asyncio.wait_for(answer, timeout_s)
        finally:
            self._waiting.pop(rid, None)
        if kind == Kind.ERROR:
            raise status_error(payload)
        return payload

    def close(self) -> None:
        if not self.connection.broken:
            self._loop.remove_reader(self.connection.fileno())
        self.connection.close()


class SimulatedRanks:
    """``ranks`` ranks of ``site`` in one event loop, over one connection per
    ``RANKS_PER_CHANNEL`` ranks (a host's); with ``host_ranks`` > 1 and no real agents,
    one simulated agent per host of that many ranks votes and watches for them.

    A rank registers and learns its first membership over grpc.aio, as often as a real
    one (once); its watches and votes, the calls that repeat, go to its real agent on its
    own connection there (:class:`AgentWire`, as a rank's client sends them), or over the
    bare client of benchmarks/h2_client.py to the coordinator (and, with ``old_ranks``, to
    an older revision's agent, which spoke gRPC): the same bytes on the wire at a tenth of
    grpc.aio's CPU, so that thousands of them leave the cores to what the benchmark
    measures."""

    def __init__(
        self,
        site: str,
        address: str,
        ranks: int,
        host_ranks: int = 1,
        calls: str = "call",
        agents: str = "",
        old_ranks: bool = False,
    ) -> None:
        import grpc

        from isthmus.inter.control.channels import MESSAGE_LIMITS
        from isthmus.inter.control.rank_keys import derived_key
        from isthmus.proto import coordinator_pb2_grpc as pb_grpc

        self.site, self.address, self.ranks, self.host_ranks = site, address, ranks, host_ranks
        self.calls, self.old_ranks = calls, old_ranks
        self.agents_dir = agents if calls == "agent" else ""
        """With ``calls="agent"``: the folder where each host's real HostAgent (a process
        of its own, :func:`serve_agents`) listens, which each rank votes and watches
        through, as a job's ranks do."""
        self.wires: list = []
        """One bare connection a host (to its agent) or a channel's worth of ranks (to
        the coordinator), opened in :meth:`join`; with a real agent, one
        :class:`AgentWire` a rank."""
        self.streams: dict[int, object] = {}
        """Each voter's open HostSession, by its first rank (with ``calls="agent"``: each
        rank's, at its agent)."""
        count = max(1, -(-ranks // RANKS_PER_CHANNEL))
        self.channels = [
            grpc.aio.insecure_channel(address, options=MESSAGE_LIMITS) for _ in range(count)
        ]
        self.stubs = [pb_grpc.CoordinatorStub(c) for c in self.channels]
        self.keys = [derived_key(SECRET, site, r) for r in range(ranks)]
        self.generation = 0
        self.stop = asyncio.Event()
        self.watchers: list[asyncio.Task] = []

    def stub(self, rank: int):
        return self.stubs[rank // RANKS_PER_CHANNEL]

    @property
    def framed(self) -> bool:
        """Whether the ranks speak to real agents in frames (this tree's agents)."""
        return bool(self.agents_dir) and not self.old_ranks

    def wire(self, rank: int):
        """Where ``rank``'s watches and votes go: its own connection to its agent, its
        host's to an older agent, or its channel's to the coordinator."""
        if self.framed:
            return self.wires[rank]
        per = self.host_ranks if self.agents_dir else RANKS_PER_CHANNEL
        return self.wires[rank // per]

    async def join(self) -> None:
        """Every rank registers, then waits for the membership; the watchers start."""
        from h2_client import H2Channel

        from isthmus.proto import coordinator_pb2 as pb

        gate = asyncio.Semaphore(256)

        async def register(rank: int) -> None:
            async with gate:
                await self.stub(rank).RegisterRank(
                    pb.RegisterRankRequest(
                        site=self.site,
                        rank=rank,
                        world_size=self.ranks,
                        lane_address=f"127.0.0.1:{20000 + rank}",
                        fingerprint=pb.JobFingerprint(fields=FINGERPRINT),
                        rank_key=self.keys[rank],
                    ),
                    timeout=120,
                    wait_for_ready=True,
                )

        async def membership(rank: int) -> int:
            async with gate:
                while True:
                    reply = await self.stub(rank).GetMembership(
                        pb.GetMembershipRequest(
                            known_generation=0, wait_ms=5_000, rank_key=self.keys[rank]
                        ),
                        timeout=15,
                    )
                    if reply.generation > 0:
                        return reply.generation

        await asyncio.gather(*(register(r) for r in range(self.ranks)))
        generations = await asyncio.gather(*(membership(r) for r in range(self.ranks)))
        self.generation = max(generations)
        if self.framed:
            first = [r - r % self.host_ranks for r in range(self.ranks)]
            self.wires = [AgentWire(f"unix:{self.agents_dir}/{f}") for f in first]
        else:
            if self.agents_dir:
                hosts = range(0, self.ranks, self.host_ranks)
                where = [f"unix:{self.agents_dir}/{f}" for f in hosts]
            else:
                where = [self.address] * len(self.channels)
            self.wires = [await H2Channel.connect(address) for address in where]
        # A host's agent watches once for its ranks (under the first one's key); a real
        # agent is watched by each rank, as a job's ranks do.
        watching = range(0, self.ranks, 1 if self.agents_dir else self.host_ranks)
        self.watchers = [asyncio.create_task(self.watch(r)) for r in watching]

    async def watch(self, rank: int) -> None:
        """The membership watcher of inter/data/sync/membership.py: long poll after long poll."""
        from h2_client import H2CallError

        from isthmus.inter.control.agent_wire import Kind, StatusError
        from isthmus.proto import coordinator_pb2 as pb

        wait_ms = WATCH_WAIT_MS
        if self.host_ranks > 1 and not self.agents_dir:
            wait_ms = HOST_WATCH_WAIT_MS
        spread = self.host_ranks == 1 or self.agents_dir
        while not self.stop.is_set():
            # As SiteMembership._watch asks: a wait spread over 75-100 % of it.
            ask = int(wait_ms * random.uniform(0.75, 1.0)) if spread else wait_ms
            request = pb.GetMembershipRequest(
                known_generation=self.generation, wait_ms=ask, rank_key=self.keys[rank]
            ).SerializeToString()
            timeout_s = wait_ms / 1000 + RPC_SLACK_S
            try:
                if self.framed:
                    answer = await self.wire(rank).call(Kind.WATCH, request, timeout_s)
                else:
                    answer = await self.wire(rank).unary(
                        _METHOD + "GetMembership", request, timeout_s
                    )
            except (H2CallError, StatusError, TimeoutError):
                await asyncio.sleep(0.25)
                continue
            reply = pb.GetMembershipResponse.FromString(answer)
            if reply.suspects or reply.generation != self.generation:
                await asyncio.sleep(0.25)

    async def vote(self, rank: int, step: int, times: StepTimes) -> None:
        """One rank's vote on ``step``, asked again while PENDING (SiteMembership.vote);
        with simulated agents, the vote of the host whose first rank is ``rank``."""
        from h2_client import H2CallError

        from isthmus.inter.control.agent_wire import Kind, StatusError
        from isthmus.proto import coordinator_pb2 as pb

        last = min(self.ranks, rank + (1 if self.agents_dir else self.host_ranks))
        ballots = [pb.RankBallot(rank=r, ok=True, rank_key=self.keys[r]) for r in range(rank, last)]

        def host_vote() -> bytes:
            return pb.CommitHostStepRequest(
                site=self.site,
                step=step,
                generation=self.generation,
                ballots=ballots,
                wait_ms=VOTE_WAIT_MS,
                sites_known=True,
            ).SerializeToString()

        if self.calls == "call":
            # A call a vote: CommitStep of a rank, CommitHostStep of a simulated agent.
            method = "CommitHostStep" if len(ballots) > 1 else ""
            request = (
                host_vote()
                if method
                else pb.CommitStepRequest(
                    site=self.site,
                    rank=rank,
                    step=step,
                    generation=self.generation,
                    ok=True,
                    wait_ms=VOTE_WAIT_MS,
                    rank_key=self.keys[rank],
                    sites_known=True,
                ).SerializeToString()
            )
            path = _METHOD + (method or "CommitStep")

            async def call() -> bytes:
                return await self.wire(rank).unary(path, request, VOTE_WAIT_MS / 1000 + RPC_SLACK_S)

        else:  # a frame to its agent, or a message on the voter's HostSession
            request = host_vote()

            async def call() -> bytes:
                timeout_s = VOTE_WAIT_MS / 1000 + RPC_SLACK_S
                if self.framed:
                    return await self.wire(rank).call(Kind.VOTE, request, timeout_s)
                return await self.on_stream(rank, request, timeout_s)

        sent = time.monotonic()
        times.first_vote = min(times.first_vote or sent, sent)
        times.last_vote = max(times.last_vote, sent)
        while True:
            try:
                decision = pb.Decision.FromString(await call())
            except (H2CallError, StatusError, TimeoutError) as exc:
                name = type(exc).__name__
                times.errors[name] = times.errors.get(name, 0) + 1
                await asyncio.sleep(0.2)
                continue
            if decision.verdict != pb.VERDICT_PENDING:
                break
            times.repolls += 1
        seen = time.monotonic()
        times.first_seen = min(times.first_seen or seen, seen)
        times.last_seen = max(times.last_seen, seen)
        name = pb.Verdict.Name(decision.verdict).removeprefix("VERDICT_")
        times.verdicts[name] = times.verdicts.get(name, 0) + len(ballots)
        if rank == 0 and decision.verdict == pb.VERDICT_COMMIT:
            await self.stub(0).ReportProgress(
                pb.ReportProgressRequest(
                    site=self.site, step=step + 1, step_s=1.0, rank_key=self.keys[0]
                ),
                timeout=RPC_SLACK_S,
            )

    async def on_stream(self, rank: int, request: bytes, timeout: float) -> bytes:
        """``request`` on the HostSession of the voter whose first rank is ``rank``
        (opened at its first vote, again after an error), as inter/control/host_session.py
        sends it."""
        stream = self.streams.get(rank)
        if stream is None:
            stream = self.streams[rank] = self.wire(rank).stream(_METHOD + "HostSession")
        try:
            stream.send(request)
            return await asyncio.wait_for(stream.recv(), timeout)
        except BaseException:
            self.streams.pop(rank, None)
            stream.cancel()
            raise

    async def step(self, step: int, at: float) -> StepTimes:
        """Every rank votes on ``step`` from ``at`` (CLOCK_MONOTONIC) on."""
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        times = StepTimes(step)
        voters = range(0, self.ranks, 1 if self.agents_dir else self.host_ranks)
        votes = asyncio.gather(*(self.vote(r, step, times) for r in voters))
        try:
            await asyncio.wait_for(votes, STEP_TIMEOUT_S)
        except TimeoutError:
            times.timed_out = True
        return times

    async def close(self) -> None:
        self.stop.set()
        for task in self.watchers:
            task.cancel()
        for stream in self.streams.values():
            stream.cancel()
        await asyncio.gather(*self.watchers, return_exceptions=True)
        for wire in self.wires:
            wire.close()
        for channel in self.channels:
            await channel.close()


async def _ranks_main(
    site: str, address: str, ranks: int, host_ranks: int, calls: str, agents: str, old: bool
) -> None:
    """The client process: joins, says "ready", then runs "step N AT" lines from stdin."""
    sim = SimulatedRanks(site, address, ranks, host_ranks, calls, agents, old)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await sim.join()
    print("ready", flush=True)
    while line := (await reader.readline()).decode().split():
        if line[0] != "step":
            break
        times = await sim.step(int(line[1]), float(line[2]))
        print(json.dumps(asdict(times)), flush=True)
    await sim.close()


def serve_ranks(
    site: str,
    address: str,
    ranks: int,
    host_ranks: int,
    calls: str,
    agents: str = "",
    old_ranks: bool = False,
) -> None:
    asyncio.run(_ranks_main(site, address, ranks, host_ranks, calls, agents, old_ranks))


# -- the driver -------------------------------------------------------------------------------
