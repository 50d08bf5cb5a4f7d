"""One cross-site all-reduce round as a pipeline of small tasks.

The round's main thread only routes: it takes chunks from the mailbox as they arrive
and hands each to a pool of encode/decode threads (zstd and numpy release the GIL, so
they overlap each other and gRPC's I/O). A task encodes and sends a contribution,
decodes a received chunk, or, when a chunk's last contribution is in, sums them in
site order and sends the encoded result. A chunk that arrived corrupt is pulled
again from its sender (``ResendChunk``) and never summed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import TYPE_CHECKING

import grpc
import torch

from isthmus.proto import lane_pb2

from .codec import CodecError, crc32
from .mailbox import CORRUPT, MailboxKey

if TYPE_CHECKING:
    from .allreduce import CrossSiteAllReduce, RoundStats

__all__ = ["CrossSiteError", "RoundPipeline"]

_CONTRIBUTION = lane_pb2.CHUNK_KIND_CONTRIBUTION
_RESULT = lane_pb2.CHUNK_KIND_RESULT
_POLL_S = 0.05  # how often the waiting router looks for failed tasks and sends
_FETCH_TIMEOUT_S = 10.0  # one ResendChunk call; the round's deadline bounds retries


class CrossSiteError(RuntimeError):
    """A cross-site round failed: a peer timed out, refused or sent bad data."""


class RoundPipeline:
    """Runs one round of ``ar`` over ``flat`` in place (see the module docstring)."""

    def __init__(
        self,
        ar: CrossSiteAllReduce,
        flat: torch.Tensor,
        step: int,
        group: int,
        average: bool,
        stats: RoundStats,
    ) -> None:
        self.ar, self.flat, self.step, self.group = ar, flat, step, group
        self.average, self.stats = average, stats
        self.per = ar.chunk_bytes // 4
        self.total = flat.numel()
        self.num_chunks = -(-self.total // self.per)
        self.where = f"site {ar.site_index} step {step} group {group}"
        self.deadline = time.monotonic() + ar.timeout_s
        self._lock = threading.Lock()  # parts and stats, shared by the pool's tasks
        self._parts: dict[int, dict[int, torch.Tensor]] = {}
        self._tasks: list[futures.Future] = []
        self._errors: list[BaseException] = []
        self._abort = threading.Event()
        self._rounds: dict = {}

    # -- the router (caller's thread) ----------------------------------------------

    def run(self) -> None:
        """Runs the round to the peers' acknowledgements; raises CrossSiteError."""
        ar, step, group = self.ar, self.step, self.group
        ar.server.mailbox.discard_before(step)
        # A peer may still pull chunks of the previous step (its round can finish after
        # ours), so those stay; older ones go.
        ar.server.outbox.discard_before(step - 1)
        self._rounds = {s: p.begin_round(self.deadline) for s, p in ar.peers.items()}
        ok = False
        try:
            pending: set[MailboxKey] = set()
            for c in range(self.num_chunks):
                owner = ar.owner(c, step, group)
                if owner == ar.site_index:
                    self._parts[c] = {}
                    pending.update((step, group, _CONTRIBUTION, c, s) for s in ar.peers)
                else:
                    pending.add((step, group, _RESULT, c, owner))
                self._submit(self._contribute, c, owner)
            while pending:
                self._raise_failures()
                remaining = self.deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted({k[4] for k in pending})
                    raise CrossSiteError(
                        f"{self.where}: timed out after {ar.timeout_s:.1f}s waiting for "
                        f"{len(pending)} chunk(s) from site(s) {missing}"
                    )
                found = ar.server.mailbox.take_any(pending, min(_POLL_S, remaining))
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
        finally:
            if not ok:
                self._abort.set()  # tasks still queued skip; running ones finish
                futures.wait(self._tasks, timeout=max(0.0, self.deadline - time.monotonic()))
            for rnd in self._rounds.values():
                rnd.end()
        self._wait_acks()

    def _submit(self, fn: Callable[..., None], *args: object) -> None:
        self._tasks.append(self.ar.pool.submit(self._guard, fn, *args))

    def _guard(self, fn: Callable[..., None], *args: object) -> None:
        if self._abort.is_set():
            return
        try:
            fn(*args)
        except BaseException as exc:
            with self._lock:
                self._errors.append(exc)
            self._abort.set()

    def _raise_failures(self) -> None:
        if self.ar.abort.is_set():
            raise CrossSiteError(f"{self.where}: aborted: {self.ar.abort_reason}")
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
            _, running = futures.wait(self._tasks, timeout=min(_POLL_S, max(0.0, remaining)))
            if not running:
                self._raise_failures()
                return
            if remaining <= 0:
                raise CrossSiteError(f"{self.where}: encode/decode did not finish in time")

    def _wait_acks(self) -> None:
        # Return only once every peer took our chunks, so no peer is left waiting for
        # bytes of a site that already moved on.
        for s, rnd in self._rounds.items():
            while True:
                self._raise_failures()  # an abort ends the wait for a silent peer
                left = self.deadline - time.monotonic()
                try:
                    took = rnd.wait(max(0.0, min(_POLL_S * 4, left)))
                    break
                except (TimeoutError, futures.TimeoutError) as exc:
                    if left <= _POLL_S * 4:
                        raise CrossSiteError(
                            f"{self.where}: site {s} did not acknowledge in time"
                        ) from exc
                except grpc.RpcError as exc:
                    raise CrossSiteError(f"{self.where}: {describe(s, exc)}") from exc
            if took != rnd.sent:
                raise CrossSiteError(f"{self.where}: site {s} took {took} of {rnd.sent} chunks")

    # -- tasks (pool threads) ------------------------------------------------------

    def _bounds(self, c: int) -> tuple[int, int]:
        return c * self.per, min(self.total, (c + 1) * self.per)

    def _count(self, **deltas: float) -> None:
        with self._lock:
            for name, value in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + value)

    def _encode(self, values: torch.Tensor, key: str) -> bytes:
        t0 = time.perf_counter()
        payload = self.ar.codec.encode(values, key)
        self._count(encode_s=time.perf_counter() - t0)
        return payload

    def _decode(self, payload: bytes, n: int) -> torch.Tensor:
        t0 = time.perf_counter()
        values = self.ar.codec.decode(payload, n)
        self._count(decode_s=time.perf_counter() - t0)
        return values

    def _request(self, kind: int, c: int, payload: bytes) -> lane_pb2.PushChunksRequest:
        lo, hi = self._bounds(c)
        return lane_pb2.PushChunksRequest(
            generation=self.ar.generation,
            step=self.step,
            group=self.group,
            kind=kind,
            chunk_index=c,
            num_chunks=self.num_chunks,
            from_site=self.ar.site_index,
            total_elements=self.total,
            num_elements=hi - lo,
            codec=self.ar.codec.name,
            payload=payload,
            crc32=crc32(payload),
        )

    def _contribute(self, c: int, owner: int) -> None:
        lo, hi = self._bounds(c)
        values = self.flat[lo:hi]
        if owner == self.ar.site_index and not self.ar.codec.lossy:
            # Lossless: decode(encode(x)) is x, so skip both.
            self._add_part(c, owner, values.to("cpu", copy=True))
            return
        # Error-feedback state is per lane (this object), group and chunk.
        payload = self._encode(values, f"g{self.group}/c{c}")
        if owner == self.ar.site_index:
            # Our own part goes through the codec too, so a lossy codec treats every
            # site alike.
            self._add_part(c, owner, self._decode(payload, hi - lo))
            return
        req = self._request(_CONTRIBUTION, c, payload)
        self.ar.server.outbox.put((self.step, self.group, _CONTRIBUTION, c), req, [owner])
        self._rounds[owner].send(req)
        self._count(bytes_sent=len(payload), raw_bytes=(hi - lo) * 4)

    def _receive(self, key: MailboxKey, req: lane_pb2.PushChunksRequest) -> None:
        kind, c, sender = key[2], key[3], key[4]
        lo, hi = self._bounds(c)
        if (req.num_elements, req.total_elements) != (hi - lo, self.total):
            raise CrossSiteError(
                f"{self.where}: site {sender} sent chunk {c} of {req.num_elements}/"
                f"{req.total_elements} elements, expected {hi - lo}/{self.total}"
            )
        try:
            values = self._decode(req.payload, hi - lo)
        except CodecError as exc:
            raise CrossSiteError(f"{self.where}: chunk {c} from site {sender}: {exc}") from exc
        self._count(bytes_received=len(req.payload))
        if kind == _RESULT:
            self.flat[lo:hi].copy_(values)
        else:
            self._add_part(c, sender, values)

    def _add_part(self, c: int, site: int, values: torch.Tensor) -> None:
        with self._lock:
            parts = self._parts[c]
            parts[site] = values
            if len(parts) < self.ar.num_sites:
                return
            del self._parts[c]
        self._reduce(c, parts)

    def _reduce(self, c: int, parts: dict[int, torch.Tensor]) -> None:
        lo, hi = self._bounds(c)
        sites = self.ar.num_sites
        # Fixed site order: float addition is not associative, and every site must
        # see the same bits.
        summed = parts[0].clone()
        for s in range(1, sites):
            summed.add_(parts[s])
        if self.average:
            summed.div_(sites)
        payload = self._encode(summed, f"g{self.group}/r{c}")
        mine = self._decode(payload, hi - lo) if self.ar.codec.lossy else summed
        self.flat[lo:hi].copy_(mine)
        req = self._request(_RESULT, c, payload)
        self.ar.server.outbox.put((self.step, self.group, _RESULT, c), req, self.ar.peers)
        for rnd in self._rounds.values():
            rnd.send(req)
        n = len(self._rounds)
        self._count(bytes_sent=n * len(payload), raw_bytes=n * (hi - lo) * 4)

    def _refetch(self, key: MailboxKey) -> None:
        step, group, kind, c, sender = key
        ask = lane_pb2.ResendChunkRequest(
            generation=self.ar.generation,
            step=step,
            group=group,
            kind=kind,
            chunk_index=c,
            from_site=self.ar.site_index,
        )
        while not self._abort.is_set():
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise CrossSiteError(
                    f"{self.where}: chunk {c} from site {sender} never came intact"
                )
            try:
                chunk = self.ar.peers[sender].fetch(ask, min(_FETCH_TIMEOUT_S, remaining))
            except grpc.RpcError as exc:
                raise CrossSiteError(
                    f"{self.where}: pulling chunk {c}: {describe(sender, exc)}"
                ) from exc
            got = (chunk.step, chunk.group, chunk.kind, chunk.chunk_index, chunk.from_site)
            problem = self.ar.server.check(chunk)
            if got != key:
                problem = f"site {sender} answered with chunk {got}, asked for {key}"
            if problem is None:
                self.ar.server.mailbox.redeposit(key, chunk)
                return
            if not problem.startswith("crc32 mismatch"):
                raise CrossSiteError(f"{self.where}: pulled chunk {c}: {problem}")
            self._count(corrupt_chunks=1)  # corrupt again on the way back: ask again


def describe(site: int, exc: BaseException) -> str:
    """One line for a failed call to ``site``."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        code = exc.code()
        kind = "timed out" if code == grpc.StatusCode.DEADLINE_EXCEEDED else "failed"
        return f"sending to site {site} {kind}: {code.name}: {exc.details()}"
    return f"sending to site {site} failed: {exc}"
