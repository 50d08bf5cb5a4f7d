"""One cross-site all-reduce round as a pipeline of small tasks.

The round's main thread only routes: it takes chunks from the mailbox as they arrive
and hands each to a pool of encode/decode threads (zstd, numpy, the checksum and
grpcio's copies release the GIL, so they overlap each other and gRPC's I/O). A task
encodes and sends a contribution, decodes a received chunk, or, when a chunk's last
contribution is in, sums them in site order and sends the encoded result. A chunk that
arrived corrupt is pulled again from its sender (``ResendChunk``) and never summed.

Bytes are copied as little as the design allows (issue 11 measured ~10 copies of every
chunk per hop before): encoded values go straight into the outgoing message
(``wire.encode_chunk``), a received payload is a view of the bytes handed over, the sum
is written into the round's tensor, a ``raw`` result is copied once, from the message.

A round is handed what it uses — a frozen :class:`RoundView` of the membership and
settings, the lane's mailbox and outbox, the peers, the pool and one
:class:`AbortSignal` — never the all-reduce that made it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import TYPE_CHECKING

import numpy as np
import torch

from isthmus.inter.data.codec import CodecError, NonFiniteEncoding, crc32
from isthmus.inter.data.mailbox import CORRUPT, Mailbox, MailboxKey, Outbox
from isthmus.inter.data.round_device import finite, lane_stream, sum_parts
from isthmus.inter.data.round_pull import pull_intact, tell_peers_abort, wait_acks
from isthmus.inter.data.wire import Chunk, Frame
from isthmus.proto import lane_pb2

if TYPE_CHECKING:
    from isthmus.inter.data.lane_peer import LanePeer
    from isthmus.inter.data.peer_round import PeerRound

__all__ = [
    "AbortSignal",
    "CrossSiteError",
    "NonFiniteGradient",
    "RoundPipeline",
    "RoundStats",
    "RoundView",
]

from isthmus.inter.data.round_types import (
    POLL_S,
    AbortSignal,
    CrossSiteError,
    EncodingFault,
    NonFiniteGradient,
    PeerAborted,
    RoundStats,
    RoundView,
    RunningTasks,
    contribution_fault,
    describe,
    settle,
    sum_fault,
)

log = logging.getLogger("isthmus.round")

_CONTRIBUTION = lane_pb2.CHUNK_KIND_CONTRIBUTION
_RESULT = lane_pb2.CHUNK_KIND_RESULT


class RoundPipeline:
    """Runs one round over ``flat`` in place (see the module docstring).

    Args:
        view: membership and settings of the round.
        mailbox: where this lane's server deposits received chunks.
        outbox: where sent chunks wait for a resend request.
        check: validates a pulled chunk (``LaneServer.check``).
        peers: site index -> lane client, for every other site of ``view``.
        pool: the encode/decode threads.
        abort: fails the round at once when set.
        flat: contiguous 1-D fp32 tensor (CPU or CUDA), reduced in place.
        step: training step; with ``group`` it names the round on the wire.
        group: FSDP group (bucket) index within the step.
        average: divide the sum by the number of sites.
        stats: filled in as the round runs.
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
        self.view, self.mailbox, self.outbox, self.check = view, mailbox, outbox, check
        self.peers, self.pool, self.abort = peers, pool, abort
        self.flat, self.step, self.group = flat, step, group
        self.average, self.stats = average, stats
        self.codec = view.codec
        # A CPU tensor is read and written through numpy (no torch dispatch per chunk).
        # A CUDA one stays on its GPU: received bytes are decoded, summed and encoded
        # there, on a stream of each pool thread's own (never the training's stream,
        # whose queued backward would hold every copy back).
        self.device = flat.device if flat.is_cuda else None
        self.host = None if flat.is_cuda else flat.numpy()
        self.per = view.chunk_bytes // 4
        self.total = flat.numel()
        self.num_chunks = -(-self.total // self.per)
        self.where = f"site {view.site_index} step {step} group {group}"
        self.deadline = time.monotonic() + view.timeout_s
        self._lock = threading.Lock()  # parts and stats, shared by the pool's tasks
        self._parts: dict[int, dict[int, np.ndarray | torch.Tensor]] = {}
        self._tasks: list[futures.Future] = []
        self._running = RunningTasks()
        self._errors: list[BaseException] = []
        self._failed = threading.Event()
        self._rounds: dict[int, PeerRound] = {}
        self.pool_lost = False
        """The pool refused a task: it was shut down (its owner makes a new one)."""

    # -- the router (caller's thread) ----------------------------------------------

    def run(self) -> None:
        """Runs the round to the peers' acknowledgements; raises CrossSiteError."""
        view, step, group = self.view, self.step, self.group
        # The lanes this round talks to are the only ones this site hands a chunk asked
        # for again, or a bulk ticket (inter/data/lane_handoff.py).
        self.outbox.meet(self.peers)
        home = (view.site_index, self.mailbox.handoffs)
        self._rounds = {s: p.begin_round(self.deadline, home) for s, p in self.peers.items()}
        ok = False
        try:
            pending: set[MailboxKey] = set()
            for c in range(self.num_chunks):
                owner = view.owner(c, step, group)
                if owner == view.site_index:
                    self._parts[c] = {}
                    pending.update((step, group, _CONTRIBUTION, c, s) for s in self.peers)
                else:
                    pending.add((step, group, _RESULT, c, owner))
                self._submit(self._contribute, c, owner)
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
                    self._count(corrupt_chunks=1)
                    self._submit(self._refetch, key)
                    continue
                pending.discard(key)
                self._submit(self._receive, key, req)
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
            with self._running.track(fn.__name__):
                if self.device is None:
                    fn(*args)
                else:
                    stream = lane_stream(self.device)
                    with torch.cuda.stream(stream):
                        fn(*args)
                    stream.synchronize()  # the task's results are in place when it ends
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
            self._count(corrupt_chunks=rnd.resent, stalled_flows=rnd.stalls)

    # -- tasks (pool threads) ------------------------------------------------------

    def _bounds(self, c: int) -> tuple[int, int]:
        return c * self.per, min(self.total, (c + 1) * self.per)

    def _count(self, **deltas: float) -> None:
        with self._lock:
            for name, value in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + value)

    def _encode(
        self, values: torch.Tensor, key: str, decoded: torch.Tensor | None = None
    ) -> bytes | memoryview:
        """``values`` encoded (and, into ``decoded``, what the payload decodes to);
        raises NonFiniteEncoding rather than return a payload that decodes to NaN or
        Inf (nothing non-finite ever leaves: invariant 8)."""
        t0 = time.perf_counter()
        try:
            return self.codec.encode(values, key, require_finite=True, decoded_out=decoded)
        finally:
            self._count(encode_s=time.perf_counter() - t0)

    def _decode(self, payload: bytes | memoryview, n: int) -> np.ndarray | torch.Tensor:
        """Host values (a CPU round) or values on the round's GPU."""
        t0 = time.perf_counter()
        values: np.ndarray | torch.Tensor
        if self.device is None:
            values = self.codec.decode_array(payload, n)
        else:
            values = self.codec.decode_device(payload, n, self.device)
        self._count(decode_s=time.perf_counter() - t0)
        return values

    def _frame(self, kind: lane_pb2.ChunkKind, c: int, payload: bytes | memoryview) -> Frame:
        """The chunk to send, from where its payload lies: the round's tensor, or the
        codec's output (a CUDA chunk's in pinned memory of its own, see
        ``codecs.base.to_host_view``). Nothing writes there before every peer took it."""
        lo, hi = self._bounds(c)
        header = lane_pb2.PushChunksRequest(
            generation=self.view.generation,
            step=self.step,
            group=self.group,
            kind=kind,
            chunk_index=c,
            num_chunks=self.num_chunks,
            from_site=self.view.site_index,
            total_elements=self.total,
            num_elements=hi - lo,
            codec=self.codec.name,
            crc32=crc32(payload),
        )
        return Frame(header.SerializeToString(), memoryview(payload).cast("B"))

    def _like(self, n: int) -> torch.Tensor:
        """A new fp32 tensor of ``n`` values where the round's values live."""
        return torch.empty(n, dtype=torch.float32, device=self.device or "cpu")

    def _own(self, lo: int, hi: int) -> np.ndarray | torch.Tensor:
        """Our own values of [lo, hi), where they lie (a view, no copy)."""
        return self.host[lo:hi] if self.host is not None else self.flat[lo:hi]

    def _store(self, lo: int, hi: int, values: np.ndarray | torch.Tensor) -> None:
        """Writes final values into [lo, hi) of the round's tensor."""
        if self.host is not None:
            np.copyto(self.host[lo:hi], values)
            return
        assert isinstance(values, torch.Tensor)  # a CUDA round decodes onto its GPU
        if values.data_ptr() != self.flat[lo:hi].data_ptr():
            self.flat[lo:hi].copy_(values)

    def _contribute(self, c: int, owner: int) -> None:
        lo, hi = self._bounds(c)
        if owner == self.view.site_index:
            self._contribute_own(c, lo, hi)
            return
        # Error-feedback state is per lane (this object), group and chunk. The payload
        # is checked, not the gradient before it: one pass over the encoded bytes (for
        # int8 its scales alone) covers both the gradient and the encode.
        try:
            payload = self._encode(self.flat[lo:hi], f"g{self.group}/c{c}")
        except NonFiniteEncoding as exc:
            self._check_own(c, lo, hi)
            raise self._encode_fault(c, lo, hi, exc) from exc
        frame = self._frame(_CONTRIBUTION, c, payload)
        self.outbox.put(
            (self.step, self.group, _CONTRIBUTION, c), frame, {owner: self.peers[owner]}
        )
        self._rounds[owner].send(frame)
        self._count(bytes_sent=len(payload), raw_bytes=(hi - lo) * 4)

    def _contribute_own(self, c: int, lo: int, hi: int) -> None:
        me = self.view.site_index
        if not self.codec.lossy:
            # Lossless: decode(encode(x)) is x, so skip both.
            self._check_own(c, lo, hi)
            self._add_part(c, me, self._own(lo, hi))
            return
        # A lossy codec treats our part as any site's (CodecChain.keep_own: nothing is
        # sent, so on a GPU no payload reaches the host; a NaN shows in the sum).
        own = self._like(hi - lo)
        t0 = time.perf_counter()
        try:
            self.codec.keep_own(self.flat[lo:hi], f"g{self.group}/c{c}", own)
        except NonFiniteEncoding as exc:
            self._check_own(c, lo, hi)
            raise self._encode_fault(c, lo, hi, exc) from exc
        finally:
            self._count(encode_s=time.perf_counter() - t0)
        self._add_part(c, me, own if self.host is None else own.numpy())

    def _encode_fault(self, c: int, lo: int, hi: int, exc: NonFiniteEncoding) -> EncodingFault:
        self._count(nonfinite_chunks=1)
        return contribution_fault(self.where, c, lo, hi, self.codec.name, exc)

    def _check_own(
        self, c: int, lo: int, hi: int, own: np.ndarray | torch.Tensor | None = None
    ) -> None:
        """Raises NonFiniteGradient if this site's values of chunk ``c`` (or its decoded
        part ``own``) are not finite: summed in, every site's weights turn NaN (issue 14)."""
        if not finite(self._own(lo, hi) if own is None else own):
            raise NonFiniteGradient(
                f"{self.where}: this site's gradient holds NaN or Inf (chunk {c}, elements "
                f"{lo}..{hi}); refused before it left the site"
            )

    def _receive(self, key: MailboxKey, req: Chunk) -> None:
        kind, c, sender = key[2], key[3], key[4]
        lo, hi = self._bounds(c)
        if (req.num_elements, req.total_elements) != (hi - lo, self.total):
            raise CrossSiteError(
                f"{self.where}: site {sender} sent chunk {c} of {req.num_elements}/"
                f"{req.total_elements} elements, expected {hi - lo}/{self.total}"
            )
        values = self._finite_decoded(c, sender, req)
        if values is None:
            # Refused before it is summed, and asked for again: a forged chunk that got
            # into the mailbox first is replaced by the sender's own copy.
            self._count(nonfinite_chunks=1)
            log.warning("%s: chunk %d from site %d holds NaN or Inf; pulling it again",
                        self.where, c, sender)  # fmt: skip
            again = self._pull(key)
            if again is None:
                return  # the round failed meanwhile
            values = self._finite_decoded(c, sender, again)
            if values is None:
                raise CrossSiteError(
                    f"{self.where}: site {sender} sent NaN or Inf in chunk {c} twice; "
                    "refused before summing"
                )
        self._count(bytes_received=len(req.payload))
        if kind == _RESULT:
            self._store(lo, hi, values)
        else:
            self._add_part(c, sender, values)

    def _finite_decoded(self, c: int, sender: int, req: Chunk) -> np.ndarray | torch.Tensor | None:
        """``req`` decoded, or None if it holds NaN or Inf. Known before any decode where
        the payload says it (a raw one from a bulk connection, checked as it arrived by
        wirecore; int8's scales), else checked on the values (on a GPU, a reduction and
        a wait for it)."""
        checked = getattr(req, "payload_finite", None)
        if checked is None:
            checked = self.codec.payload_finite(req.payload, req.num_elements)
        if checked is False:
            return None
        values = self._decoded(c, sender, req)
        return values if checked or finite(values) else None

    def _decoded(self, c: int, sender: int, req: Chunk) -> np.ndarray | torch.Tensor:
        lo, hi = self._bounds(c)
        try:
            return self._decode(req.payload, hi - lo)
        except CodecError as exc:
            raise CrossSiteError(f"{self.where}: chunk {c} from site {sender}: {exc}") from exc

    def _add_part(self, c: int, site: int, values: np.ndarray | torch.Tensor) -> None:
        if self.device is not None:
            with self._lock:  # the last part is summed on the stream that made it
                parts = self._parts[c]
                last = len(parts) + 1 == self.view.num_sites
                if last:
                    parts[site] = values
                    del self._parts[c]
            if last:
                self._reduce(c, parts)
                return
            # Another thread may sum it on its own stream: the values must be complete.
            # (A CUDA event for that stream to wait on measured no faster, 2026-11-29.)
            torch.cuda.current_stream(self.device).synchronize()
        with self._lock:
            parts = self._parts[c]
            parts[site] = values
            if len(parts) < self.view.num_sites:
                return
            del self._parts[c]
        self._reduce(c, parts)

    def _reduce(self, c: int, parts: dict[int, np.ndarray | torch.Tensor]) -> None:
        lo, hi = self._bounds(c)
        sites = self.view.num_sites
        if self.host is not None:  # a CPU round decodes to numpy
            summed = torch.from_numpy(sum_parts(parts, self.host[lo:hi], sites, self.average))
        else:  # a CUDA round: the parts are tensors on self.device
            summed = sum_parts(parts, self.flat[lo:hi], sites, self.average)
        # Every site, the owner too, keeps decode(result): a lossy encode leaves it in
        # place of the sum as it quantizes.
        try:
            payload = self._encode(
                summed, f"g{self.group}/r{c}", summed if self.codec.lossy else None
            )
        except NonFiniteEncoding as exc:
            if self.codec.lossy:  # our own part was not checked as it was kept
                self._check_own(c, lo, hi, parts[self.view.site_index])
            self._count(nonfinite_chunks=1)
            cause = "overflowed" if not finite(summed) else "is finite, but its encode is not"
            raise sum_fault(self.where, c, lo, hi, cause, self.codec.name, exc) from exc
        frame = self._frame(_RESULT, c, payload)
        self.outbox.put((self.step, self.group, _RESULT, c), frame, self.peers)
        for rnd in self._rounds.values():
            rnd.send(frame)
        n = len(self._rounds)
        self._count(bytes_sent=n * len(payload), raw_bytes=n * (hi - lo) * 4)

    def _refetch(self, key: MailboxKey) -> None:
        chunk = self._pull(key)
        if chunk is not None:
            self.mailbox.redeposit(key, chunk)

    def _pull(self, key: MailboxKey) -> Chunk | None:
        """The chunk ``key`` asked again of its sender until it comes intact; None if
        the round failed meanwhile (:func:`~isthmus.inter.data.round_pull.pull_intact`)."""
        return pull_intact(
            key,
            peer=self.peers[key[4]],
            handoffs=self.mailbox.handoffs,
            check=self.check,
            generation=self.view.generation,
            site_index=self.view.site_index,
            deadline=self.deadline,
            failed=self._failed,
            where=self.where,
            on_corrupt=lambda: self._count(corrupt_chunks=1),
        )
