"""One cross-site all-reduce round as a pipeline of small tasks.

The round's main thread only routes: it takes chunks from the mailbox as they arrive
and hands each to a pool of encode/decode threads (zstd, numpy, the checksum and
grpcio's copies release the GIL, so they overlap each other and gRPC's I/O). A task
encodes and sends a contribution, decodes a received chunk, or, when a chunk's last
contribution is in, sums them in site order and sends the encoded result. A chunk that
arrived corrupt is pulled again from its sender (``ResendChunk``) and never summed.

Bytes are copied as little as the design allows (issue 11 measured ~10 copies of every
chunk per hop before): encoded values go straight into the outgoing message, a received
payload is a view of the bytes handed over, the sum is written into the round's tensor.
A round is handed what it uses (a frozen :class:`RoundView`, the lane's mailbox and
outbox, the peers, the pool, one :class:`AbortSignal`), never the all-reduce that made it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import TYPE_CHECKING

import torch

from isthmus.inter.data.lane.mailbox import CORRUPT, Mailbox, MailboxKey, Outbox
from isthmus.inter.data.round.context import (
    POLL_S,
    AbortSignal,
    CrossSiteError,
    ModelMismatch,
    NonFiniteGradient,
    PeerAborted,
    RoundStats,
    RoundView,
    RunningTasks,
    describe,
    settle,
)
from isthmus.inter.data.round.device import on_lane_stream
from isthmus.inter.data.round.pull import tell_peers_abort, wait_acks
from isthmus.inter.data.round.tasks import CONTRIBUTION, RESULT, ChunkTasks
from isthmus.inter.data.transport.wire import Chunk

if TYPE_CHECKING:
    from isthmus.inter.data.lane.peer import LanePeer
    from isthmus.inter.data.transport.peer_round import PeerRound

__all__ = [
    "AbortSignal",
    "CrossSiteError",
    "ModelMismatch",
    "NonFiniteGradient",
    "RoundPipeline",
    "RoundStats",
    "RoundView",
]


class RoundPipeline:
    """Runs one round over ``flat`` in place (see the module docstring); its
    :class:`ChunkTasks` touch the values, on ``pool``'s threads. ``check`` validates a
    pulled chunk (``LaneServer.check``); ``peers`` maps every other site of ``view`` to
    its lane client; (step, group) names the round on the wire.
    """

    def __init__(
        self,
        *,
        view: RoundView,
        mailbox: Mailbox,
        outbox: Outbox,
        check: Callable[[Chunk], str | None],
        peers: dict[int, LanePeer],
        pool: futures.Executor,
        abort: AbortSignal,
        flat: torch.Tensor,
        step: int,
        group: int,
        average: bool,
        stats: RoundStats,
    ) -> None:
        self.view, self.mailbox, self.outbox = view, mailbox, outbox
        self.peers, self.pool, self.abort = peers, pool, abort
        self.step, self.group = step, group
        self.where = f"site {view.site_index} step {step} group {group}"
        self.deadline = time.monotonic() + view.timeout_s
        self._failed = threading.Event()
        self.tasks = ChunkTasks(
            view=view,
            flat=flat,
            step=step,
            group=group,
            average=average,
            stats=stats,
            outbox=outbox,
            peers=peers,
            handoffs=mailbox.handoffs,
            check=check,
            send=lambda site, frame: self._rounds[site].send(frame),
            failed=self._failed,
            where=self.where,
            deadline=self.deadline,
        )
        self.num_chunks = self.tasks.num_chunks
        self._lock = threading.Lock()  # the tasks' errors
        self._tasks: list[futures.Future] = []
        self._running = RunningTasks()
        self._errors: list[BaseException] = []
        self._rounds: dict[int, PeerRound] = {}
        self.pool_lost = False
        """The pool refused a task: it was shut down (its owner makes a new one)."""

    # -- the router (caller's thread) ----------------------------------------------

    def run(self) -> None:
        """Runs the round to the peers' acknowledgements; raises CrossSiteError."""
        view, step, group = self.view, self.step, self.group
        # The lanes this round talks to are the only ones this site hands a chunk asked
        # for again, or a bulk ticket (inter/data/lane/handoff.py).
        self.outbox.meet(self.peers)
        home = (view.site_index, self.mailbox.handoffs)
        self._rounds = {s: p.begin_round(self.deadline, home) for s, p in self.peers.items()}
        ok = False
        try:
            pending: set[MailboxKey] = set()
            for c in range(self.num_chunks):
                owner = view.owner(c, step, group)
                if owner == view.site_index:
                    pending.update((step, group, CONTRIBUTION, c, s) for s in self.peers)
                else:
                    pending.add((step, group, RESULT, c, owner))
                self._submit(self.tasks.contribute, c, owner)
            while pending:
                self._raise_failures()
                remaining = self.deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted({k[4] for k in pending})
                    raise CrossSiteError(
                        f"{self.where}: timed out after {view.timeout_s:.1f}s waiting for "
                        f"{len(pending)} chunk(s) from site(s) {missing}"
                    )
                found = self.mailbox.take_any(pending, min(POLL_S, remaining))
                if found is None:
                    continue
                key, req = found
                if req is CORRUPT:  # stays pending until the pulled copy arrives
                    self.tasks.count(corrupt_chunks=1)
                    self._submit(self._refetch, key)
                    continue
                pending.discard(key)
                self._submit(self.tasks.receive, key, req)
            self._wait_tasks()
            ok = True
        except CrossSiteError as exc:
            if not isinstance(exc, PeerAborted):  # (a peer that gave up told every site)
                tell_peers_abort(self.peers, self.view, self.step, self.group, str(exc))
            raise
        finally:
            if not ok:
                self._failed.set()  # tasks still queued skip; running ones finish
                settle(self._tasks, self.deadline)
            for rnd in self._rounds.values():
                rnd.end()
        self._wait_acks()

    def _refetch(self, key: MailboxKey) -> None:
        chunk = self.tasks.pull(key)
        if chunk is not None:
            self.mailbox.redeposit(key, chunk)

    def _submit(self, fn: Callable[..., None], *args: object) -> None:
        try:
            self._tasks.append(self.pool.submit(self._guard, fn, *args))
        except RuntimeError as exc:  # the pool was shut down under the round
            self.pool_lost = True
            raise CrossSiteError(f"{self.where}: the lane's codec threads are gone") from exc

    def stuck(self) -> list[str]:
        """Where the round's running tasks are (after it failed: threads that hang)."""
        return self._running.where()

    def _guard(self, fn: Callable[..., None], *args: object) -> None:
        if self._failed.is_set():
            return
        try:
            # On a GPU the task's results are in place when it ends.
            with self._running.track(fn.__name__), on_lane_stream(self.tasks.flat):
                fn(*args)
        except BaseException as exc:
            with self._lock:
                self._errors.append(exc)
            self._failed.set()

    def _raise_failures(self) -> None:
        if self.abort.is_set():
            raise CrossSiteError(f"{self.where}: aborted: {self.abort.reason}")
        given_up = self.mailbox.aborted(self.step, self.group)
        if given_up is not None:
            site, why = given_up
            raise PeerAborted(f"{self.where}: site {site} gave the round up: {why}")
        with self._lock:
            exc = self._errors[0] if self._errors else None
        if isinstance(exc, CrossSiteError):
            raise exc
        if exc is not None:
            raise CrossSiteError(f"{self.where}: {type(exc).__name__}: {exc}") from exc
        for s, rnd in self._rounds.items():
            exc = rnd.failure()
            if exc is not None:
                raise CrossSiteError(f"{self.where}: {describe(s, exc)}") from exc

    def _wait_tasks(self) -> None:
        # Tasks are only ever added by this thread, so the list is complete here.
        while True:
            self._raise_failures()
            remaining = self.deadline - time.monotonic()
            _, running = futures.wait(self._tasks, timeout=min(POLL_S, max(0.0, remaining)))
            if any(task.cancelled() for task in running):
                # Its pool was shut down under it (another round's renewal, _renew_pool_if_lost):
                # a task cancelled in its queue never runs and futures.wait never counts it.
                self.pool_lost = True
                raise CrossSiteError(f"{self.where}: the lane's codec threads are gone")
            if not running:
                self._raise_failures()
                return
            if remaining <= 0:
                raise CrossSiteError(f"{self.where}: encode/decode did not finish in time")

    def _wait_acks(self) -> None:
        # Only once every peer took our chunks: no peer waits for a site that moved on.
        for s, rnd in self._rounds.items():
            wait_acks(s, rnd, self.deadline, self._raise_failures, self.where)
            # Frames damaged on the way (sent again), connections left past a deadline.
            self.tasks.count(corrupt_chunks=rnd.resent, stalled_flows=rnd.stalls)
