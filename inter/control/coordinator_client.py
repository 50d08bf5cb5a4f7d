"""A rank's typed client of its own site's coordinator: the calls deploy makes.

A rank speaks to its site's coordinator only (docs/design.md, "Coordinator"): it registers
its lane and its key, waits for the job's membership, votes on each step and watches for
silent members (through its host's agent when it has one, inter/control/host_agent.py),
on rank 0 reports each step's progress, and says when its script raised (which stops the
job at every site). :class:`CoordinatorClient` builds the protobuf messages, but for a
report (:data:`Progress`). The rank's key (:func:`~isthmus.inter.control.rank_keys.process_key`)
goes with every registration, vote and report: the coordinator counts a vote and takes a
site's digest only from its own ranks. Every call has a deadline (docs/design.md
invariant 5) and raises ``grpc.RpcError`` when refused or not answered in time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from isthmus.inter.control.abort import MAX_REASON_CHARS
from isthmus.inter.control.agent_socket import AgentLink
from isthmus.inter.control.agent_wire import Kind, StatusError
from isthmus.inter.control.channels import peer_channel
from isthmus.inter.control.host_session import HostSession
from isthmus.inter.control.rank_keys import process_key
from isthmus.inter.security import SiteSecurity
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

__all__ = [
    "CoordinatorClient",
    "Decision",
    "Membership",
    "MembershipNow",
    "Progress",
    "SiteInfo",
    "Verdict",
]

SiteInfo = pb.SiteInfo
"""A member site as the coordinator names it: ``name``, ``index``, ``lane_addresses``
(indexed by rank) and ``coordinator_address`` (read it, never build it)."""
Decision = pb.Decision
"""The job's decision on a step (``generation``, ``sites``, ``state_source``,
``state_step``, ...), as a rejoin carries it (read it, never build it)."""


class Verdict:
    """A decision's verdict (``Decision.verdict``), named."""

    PENDING = pb.VERDICT_PENDING
    COMMIT = pb.VERDICT_COMMIT
    RETRY = pb.VERDICT_RETRY
    REJOIN = pb.VERDICT_REJOIN
    STOP = pb.VERDICT_STOP


_MEMBERSHIP_WAIT_MS = 5_000
"""How long the coordinator may hold one membership long poll."""
_MEMBERSHIP_RPC_TIMEOUT_S = 15.0
"""Deadline of one membership long poll: its wait and ample slack."""


@dataclass(frozen=True, slots=True)
class Membership:
    """The job's membership as a rank first learns it (``GetMembershipResponse``):
    ``start_step`` > 0 when the site joins a running job and pulls the state after
    ``start_step - 1`` from ``state_source``'s ranks ("" when the job starts here)."""

    generation: int
    sites: tuple[SiteInfo, ...]
    start_step: int
    state_source: str


@dataclass(frozen=True, slots=True)
class MembershipNow:
    """The job's membership as the coordinator sees it now (a watch's answer): generation
    0 before the job starts; ``suspects`` not heard from within the failure timeout."""

    generation: int
    sites: tuple[SiteInfo, ...]
    suspects: tuple[str, ...]


Progress = pb.ReportProgressRequest
"""One step's report of a site to its coordinator, its fields named as in
proto/coordinator.proto (those left out are 0, "" or False); the client adds the key."""


class CoordinatorClient:
    """One rank's calls to its site's coordinator, over one channel. ``rank_key`` None:
    the process's own (:func:`process_key`); a test may play a rank."""

    def __init__(
        self,
        channel: grpc.Channel,
        *,
        rank_key: str | None = None,
        agent: AgentLink | None = None,
    ) -> None:
        self.channel = channel
        self.stub = pb_grpc.CoordinatorStub(channel)
        self.rank_key = rank_key if rank_key is not None else process_key()
        self._session = HostSession(self.stub)
        """Where this rank's waiting votes go without an agent: one open stream."""
        self.agent = agent
        """The way to this host's agent for votes and watches, once it is checked."""
        self.agent_misses = 0
        """Calls meant for the agent that went to the coordinator (it was unreachable)."""

    @classmethod
    def connect(
        cls,
        address: str,
        security: SiteSecurity | None = None,
        *,
        rank_key: str | None = None,
        agent: str = "",
        agent_wait_s: float = 0.0,
    ) -> CoordinatorClient:
        """A client of the coordinator at ``address`` ("host:port"), with mutual TLS and
        the job token as ``security`` says (None = plaintext). ``agent`` ("unix:/path")
        is used once it is checked (agent_socket.py), waited for in the background for
        ``agent_wait_s`` (the rank's start-up deadline; 0: look once)."""
        link = AgentLink(agent, wait_s=agent_wait_s) if agent else None
        return cls(peer_channel(address, security=security), rank_key=rank_key, agent=link)

    def _via_agent(
        self, kind: Kind, request, timeout_s: float, on_call: Callable | None = None
    ) -> bytes | None:
        """``request`` to the agent, the answer's payload; None when there is no agent (one
        not checked yet, or refused, is none) or it is unreachable (UNAVAILABLE: the agent
        never says that of the coordinator), for the caller to ask the coordinator."""
        agent = self.agent
        if agent is None:
            return None
        try:
            connection = agent.connection()
            if connection is None:
                return None
            return connection.call(kind, request.SerializeToString(), timeout_s, on_call)[1]
        except StatusError as exc:
            if exc.code() is not grpc.StatusCode.UNAVAILABLE:
                raise
            agent.unreachable(exc.details())
            self.agent_misses += 1
            return None

    def register_rank(
        self,
        *,
        site: str,
        rank: int,
        world_size: int,
        lane_address: str,
        fingerprint: Mapping[str, str],
        timeout_s: float,
    ) -> None:
        """Registers this rank's lane ("" in a job of one site) and key: what a rank does
        first. Waits for the coordinator to come up, at most ``timeout_s``.

        Raises:
            grpc.RpcError: FAILED_PRECONDITION when the coordinator refuses the rank
                (another fingerprint, a rank that does not fit the site, the rank
                already registered with another key, ...), DEADLINE_EXCEEDED when it
                is not reached in time.
        """
        self.stub.RegisterRank(
            pb.RegisterRankRequest(
                site=site,
                rank=rank,
                world_size=world_size,
                lane_address=lane_address,
                fingerprint=pb.JobFingerprint(fields=fingerprint),
                rank_key=self.rank_key,
            ),
            timeout=timeout_s,
            wait_for_ready=True,
        )

    def wait_membership(self, timeout_s: float) -> Membership:
        """Waits, by long poll, until every site of the job is ready and returns the
        membership; ``TimeoutError`` after ``timeout_s``, ``grpc.RpcError``
        FAILED_PRECONDITION once the coordinator gave up on the job."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            reply = self.stub.GetMembership(
                pb.GetMembershipRequest(
                    known_generation=0, wait_ms=_MEMBERSHIP_WAIT_MS, rank_key=self.rank_key
                ),
                timeout=_MEMBERSHIP_RPC_TIMEOUT_S,
            )
            if reply.generation > 0:
                return Membership(
                    generation=reply.generation,
                    sites=tuple(reply.sites),
                    start_step=reply.start_step,
                    state_source=reply.state_source,
                )
        raise TimeoutError(f"no job membership after {timeout_s:.0f}s")

    def commit_step(
        self,
        *,
        site: str,
        rank: int,
        step: int,
        generation: int,
        ok: bool,
        wait_ms: int,
        timeout_s: float,
    ) -> Decision:
        """Votes on ``step``'s rounds (ok: this rank's rounds all succeeded) and waits up
        to ``wait_ms`` for the job's decision; PENDING when none came in that time.

        The rank runs in ``generation`` and has its sites: a COMMIT that keeps it comes
        without ``sites`` (``sites_known``); any other decision names them.

        A vote that waits goes to the host's agent when the rank has one (its ballot joins
        the host's others in one message), else on this rank's ``HostSession`` stream (at
        2 x 256 ranks on 2 cores: the step's decision 317 -> 130 ms, p50, against a call);
        one that does not wait (``wait_ms`` 0: a vote ahead, from another thread while the
        session may hold a waiting vote) is a ``CommitStep`` call. A refused vote raises
        ``grpc.RpcError``; a session that gave no answer in ``timeout_s``, ``TimeoutError``.
        """
        ballot: dict[str, Any] = {"rank": rank, "ok": ok, "rank_key": self.rank_key}
        on: dict[str, Any] = dict(site=site, step=step, generation=generation, wait_ms=wait_ms)
        if wait_ms == 0:
            request = pb.CommitStepRequest(**on, **ballot, sites_known=True)
            return self.stub.CommitStep(request, timeout=timeout_s)
        votes = pb.CommitHostStepRequest(**on, ballots=[pb.RankBallot(**ballot)], sites_known=True)
        via_agent = self._via_agent(Kind.VOTE, votes, timeout_s)
        if via_agent is not None:
            return pb.Decision.FromString(via_agent)
        return self._session.vote(votes, timeout_s)

    def membership_now(
        self,
        *,
        known_generation: int,
        wait_ms: int,
        timeout_s: float,
        on_call: Callable[[grpc.Future], None] | None = None,
    ) -> MembershipNow:
        """The membership, answered at once if it is not ``known_generation`` or a
        member is suspect, else after up to ``wait_ms`` (a long poll).

        ``on_call`` is handed the call before it is waited on: its ``cancel()`` ends the
        poll at once, and this raises ``grpc.FutureCancelledError`` (how a watcher that
        is closing stops without waiting out the poll). A first membership
        (``known_generation`` 0) is the coordinator's to answer, never the agent's.
        """
        request = pb.GetMembershipRequest(
            known_generation=known_generation, wait_ms=wait_ms, rank_key=self.rank_key
        )
        via_agent = None
        if known_generation:
            via_agent = self._via_agent(Kind.WATCH, request, timeout_s, on_call)
        if via_agent is not None:
            reply = pb.GetMembershipResponse.FromString(via_agent)
        else:
            call = self.stub.GetMembership.future(request, timeout=timeout_s)
            if on_call is not None:
                on_call(call)
            reply = call.result()
        return MembershipNow(reply.generation, tuple(reply.sites), tuple(reply.suspects))

    def report_progress(self, progress: Progress, *, timeout_s: float) -> str:
        """Reports one step (with this client's key) to the coordinator, which feeds
        Prometheus and compares the digest with the other sites'. Returns why the sites'
        replicas differ when a peer reported another digest for a step this site digested
        too, else "" (PERMISSION_DENIED when the key is no registered rank's)."""
        return self.report(progress, timeout_s=timeout_s)[0]

    def report(self, progress: Progress, *, timeout_s: float) -> tuple[str, bool]:
        """:meth:`report_progress`, answering also whether every member site reported
        the same digest after 0 steps (``progress.digest_step == 0``), so the sites
        start from the same parameters: ``(divergence, agreed)``."""
        request = pb.ReportProgressRequest(rank_key=self.rank_key)
        request.MergeFrom(progress)
        reply = self.stub.ReportProgress(request, timeout=timeout_s)
        return reply.divergence, reply.agreed

    def abort_job(self, *, site: str, rank: int, reason: str, timeout_s: float) -> None:
        """Says that this rank's script raised: the job stops at every site (the site's
        coordinator tells its peers, inter/control/abort.py). ``reason`` is the traceback's
        last line, cut to what the coordinator takes."""
        line = "".join(c if c.isprintable() else " " for c in " ".join(reason.split()))
        reason = line[:MAX_REASON_CHARS] or "the script failed"
        request = pb.AbortJobRequest(site=site, rank=rank, rank_key=self.rank_key, reason=reason)
        self.stub.AbortJob(request, timeout=timeout_s)

    def close(self) -> None:
        """Closes the vote stream and the channels (calls in flight are cancelled)."""
        self._session.close()
        self.channel.close()
        if self.agent is not None:
            self.agent.close()
