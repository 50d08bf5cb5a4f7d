"""The processes of benchmarks/control_plane.py: one site's coordinator, and a
process of simulated ranks (or per-host agents) that register, heartbeat, long poll and
vote per step as real ranks do. The benchmark spawns this folder's control_plane.py
with ``--serve-coordinator`` or ``--serve-ranks``, which call into here.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import time
from dataclasses import asdict, dataclass, field

SECRET = b"control-plane-benchmark-secret!!"
"""The site secret the simulated ranks derive their keys from (rank_keys.derived_key)."""
FINGERPRINT = {"job.seed": "0", "bench": "control_plane"}
VOTE_WAIT_MS = 2_000  # inter/data/membership.py _VOTE_WAIT_MS
WATCH_WAIT_MS = 1_000  # inter/data/membership.py _WATCH_WAIT_MS
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


def serve_coordinator(site: str, names: list[str], ranks: int) -> None:
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
        failure_timeout_s=30.0,  # a loaded 2-core machine must not look like a dead site
        rpc_timeout_s=10.0,
    )
    coordinator = Coordinator(settings, rank_keys=RankKeys.derive(site, ranks, SECRET))
    print(coordinator.address, flush=True)
    peers = json.loads(sys.stdin.readline())
    coordinator.set_peers({name: address for name, address in peers.items() if name != site})
    coordinator.start()
    print("started", flush=True)
    for line in sys.stdin:
        if line.strip() == "stop":
            break
    coordinator.stop(grace_s=0.5)


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
    messages: int = 0
    """With real agents: the vote messages they sent the coordinator for this step."""


class SimulatedRanks:
    """``ranks`` ranks of ``site`` in one event loop, over one channel per
    ``RANKS_PER_CHANNEL`` ranks; with ``host_ranks`` > 1, one agent per host of that
    many ranks votes and watches for them."""

    def __init__(
        self, site: str, address: str, ranks: int, host_ranks: int = 1, calls: str = "call"
    ) -> None:
        import grpc

        from isthmus.inter.control.channels import MESSAGE_LIMITS
        from isthmus.inter.control.rank_keys import derived_key
        from isthmus.proto import coordinator_pb2_grpc as pb_grpc

        self.site, self.ranks, self.host_ranks = site, ranks, host_ranks
        self.streams: dict[int, object] | None = {} if calls == "stream" else None
        """With ``calls="stream"``: each voter's open HostSession, by its first rank."""
        self.agents = self._start_agents(address) if calls == "agent" else []
        """With ``calls="agent"``: a real HostAgent per host (inter/control/host_agent.py),
        which each rank votes and watches through, as a job's ranks do."""
        self.agent_stubs = [
            pb_grpc.CoordinatorStub(grpc.aio.insecure_channel(agent.address))
            for agent in self.agents
        ]
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

    def _start_agents(self, address: str) -> list:
        """One HostAgent a host, on a Unix socket, with a channel of its own to the
        coordinator (threads of this process, where a job runs each on its host)."""
        import tempfile

        import grpc

        from isthmus.inter.control.host_agent import HostAgent

        self._socket_dir = tempfile.TemporaryDirectory(prefix="isthmus-agents-")
        return [
            HostAgent(
                grpc.insecure_channel(address),
                site=self.site,
                ranks=min(self.host_ranks, self.ranks - first),
                listen=f"unix:{self._socket_dir.name}/{first}",
            ).start()
            for first in range(0, self.ranks, self.host_ranks)
        ]

    def watch_stub(self, rank: int):
        """Where ``rank``'s watch and votes go: its host's agent, or the coordinator."""
        if self.agents:
            return self.agent_stubs[rank // self.host_ranks]
        return self.stub(rank)

    async def join(self) -> None:
        """Every rank registers, then waits for the membership; the watchers start."""
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
        # A host's agent watches once for its ranks (under the first one's key); a real
        # agent is watched by each rank, as a job's ranks do.
        watching = range(0, self.ranks, 1 if self.agents else self.host_ranks)
        self.watchers = [asyncio.create_task(self.watch(r)) for r in watching]

    async def watch(self, rank: int) -> None:
        """The membership watcher of inter/data/membership.py: long poll after long poll."""
        import grpc

        from isthmus.proto import coordinator_pb2 as pb

        wait_ms = WATCH_WAIT_MS if self.host_ranks == 1 or self.agents else HOST_WATCH_WAIT_MS
        while not self.stop.is_set():
            try:
                reply = await self.watch_stub(rank).GetMembership(
                    pb.GetMembershipRequest(
                        known_generation=self.generation,
                        wait_ms=wait_ms,
                        rank_key=self.keys[rank],
                    ),
                    timeout=wait_ms / 1000 + RPC_SLACK_S,
                )
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.25)
                continue
            if reply.suspects or reply.generation != self.generation:
                await asyncio.sleep(0.25)

    async def vote(self, rank: int, step: int, times: StepTimes) -> None:
        """One rank's vote on ``step``, asked again while PENDING (SiteMembership.vote);
        with hosts, the vote of the host whose first rank is ``rank``, for its ranks."""
        import grpc

        from isthmus.proto import coordinator_pb2 as pb

        if not self.agents and (self.host_ranks > 1 or self.streams is not None):
            ballots = [
                pb.RankBallot(rank=r, ok=True, rank_key=self.keys[r])
                for r in range(rank, min(self.ranks, rank + self.host_ranks))
            ]
            request = pb.CommitHostStepRequest(
                site=self.site,
                step=step,
                generation=self.generation,
                ballots=ballots,
                wait_ms=VOTE_WAIT_MS,
                sites_known=True,
            )
            call = self.stub(rank).CommitHostStep
            if self.streams is not None:
                call = functools.partial(self.on_stream, rank)
        else:
            request = pb.CommitStepRequest(
                site=self.site,
                rank=rank,
                step=step,
                generation=self.generation,
                ok=True,
                wait_ms=VOTE_WAIT_MS,
                rank_key=self.keys[rank],
                sites_known=True,
            )
            call = self.watch_stub(rank).CommitStep
        sent = time.monotonic()
        times.first_vote = min(times.first_vote or sent, sent)
        times.last_vote = max(times.last_vote, sent)
        while True:
            try:
                decision = await call(request, timeout=VOTE_WAIT_MS / 1000 + RPC_SLACK_S)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.FAILED_PRECONDITION,
                ):
                    raise
                times.errors[exc.code().name] = times.errors.get(exc.code().name, 0) + 1
                await asyncio.sleep(0.2)
                continue
            if decision.verdict != pb.VERDICT_PENDING:
                break
            times.repolls += 1
        seen = time.monotonic()
        times.first_seen = min(times.first_seen or seen, seen)
        times.last_seen = max(times.last_seen, seen)
        name = pb.Verdict.Name(decision.verdict).removeprefix("VERDICT_")
        # The ranks this answer is for (through a real agent each rank has its own).
        ranks = 1 if self.agents else min(self.host_ranks, self.ranks - rank)
        times.verdicts[name] = times.verdicts.get(name, 0) + ranks
        if rank == 0 and decision.verdict == pb.VERDICT_COMMIT:
            await self.stub(0).ReportProgress(
                pb.ReportProgressRequest(
                    site=self.site, step=step + 1, step_s=1.0, rank_key=self.keys[0]
                ),
                timeout=RPC_SLACK_S,
            )

    async def on_stream(self, rank: int, request, timeout: float):
        """``request`` on the HostSession of the voter whose first rank is ``rank``
        (opened at its first vote, again after an error), as inter/control/host_session.py
        sends it."""
        assert self.streams is not None
        stream = self.streams.get(rank)
        if stream is None:
            stream = self.streams[rank] = self.stub(rank).HostSession()
        try:
            await stream.write(request)
            return await asyncio.wait_for(stream.read(), timeout)
        except BaseException:
            self.streams.pop(rank, None)
            stream.cancel()
            raise

    async def step(self, step: int, at: float) -> StepTimes:
        """Every rank votes on ``step`` from ``at`` (CLOCK_MONOTONIC) on."""
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        times = StepTimes(step)
        sent_before = sum(agent.batches for agent in self.agents)
        voters = range(0, self.ranks, 1 if self.agents else self.host_ranks)
        votes = asyncio.gather(*(self.vote(r, step, times) for r in voters))
        try:
            await asyncio.wait_for(votes, STEP_TIMEOUT_S)
        except TimeoutError:
            times.timed_out = True
        times.messages = sum(agent.batches for agent in self.agents) - sent_before
        return times

    async def close(self) -> None:
        self.stop.set()
        for task in self.watchers:
            task.cancel()
        for stream in (self.streams or {}).values():
            stream.cancel()
        await asyncio.gather(*self.watchers, return_exceptions=True)
        for channel in self.channels:
            await channel.close()
        for agent in self.agents:
            agent.stop()


async def _ranks_main(site: str, address: str, ranks: int, host_ranks: int, calls: str) -> None:
    """The client process: joins, says "ready", then runs "step N AT" lines from stdin."""
    sim = SimulatedRanks(site, address, ranks, host_ranks, calls)
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


def serve_ranks(site: str, address: str, ranks: int, host_ranks: int, calls: str) -> None:
    asyncio.run(_ranks_main(site, address, ranks, host_ranks, calls))


# -- the driver -------------------------------------------------------------------------------
