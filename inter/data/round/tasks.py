"""The per-chunk tasks of a cross-site round, run on the lane's pool threads.

:class:`ChunkTasks` is what a :class:`~isthmus.inter.data.round.pipeline.RoundPipeline`
holds to touch values: a task encodes and sends a contribution, checks and decodes a
received chunk, or, once a chunk's contributions are all in, sums them in site order
and sends the result (a raw CPU chunk's owner in one pass over memory, in C:
``device.sum_raw_host``). Nothing here waits on the mailbox: the pipeline's router does.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from isthmus.inter.data.codecs.chain import CodecError, NonFiniteEncoding, crc32
from isthmus.inter.data.lane.mailbox import Handoffs, MailboxKey, Outbox
from isthmus.inter.data.round.context import (
    CrossSiteError,
    EncodingFault,
    ModelMismatch,
    NonFiniteGradient,
    RoundStats,
    RoundView,
    contribution_fault,
    sum_fault,
)
from isthmus.inter.data.round.device import finite, sum_parts, sum_raw_host
from isthmus.inter.data.round.pull import pull_intact
from isthmus.inter.data.transport.wire import Chunk, Frame
from isthmus.inter.data.transport.wirecore import (
    SUM_OVERFLOW,
    SUM_OWN_NONFINITE,
    crc_of_finite,
    one_pass_sums,
)
from isthmus.proto import lane_pb2

if TYPE_CHECKING:
    from isthmus.inter.data.lane.peer import LanePeer

__all__ = ["CONTRIBUTION", "RESULT", "ChunkTasks"]

log = logging.getLogger("isthmus.round")

CONTRIBUTION = lane_pb2.CHUNK_KIND_CONTRIBUTION
RESULT = lane_pb2.CHUNK_KIND_RESULT


@dataclasses.dataclass(kw_only=True, eq=False)
class ChunkTasks:
    """The tasks of one round over ``flat`` in place: :meth:`contribute`, :meth:`receive`
    and :meth:`pull`, run on the pool's threads by the
    :class:`~isthmus.inter.data.round.pipeline.RoundPipeline` that holds them (its
    docstring tells the fields it shares with them)."""

    view: RoundView
    flat: torch.Tensor
    step: int
    group: int
    average: bool
    stats: RoundStats
    outbox: Outbox
    peers: dict[int, LanePeer]
    check: Callable[[Chunk], str | None]
    handoffs: Handoffs  # this rank's nonces, where a chunk pulled again is handed back
    send: Callable[[int, Frame], None]
    """Sends a frame to a peer site on the round's connection to it."""
    failed: threading.Event  # set once the round failed: a pull stops asking
    where: str
    deadline: float  # the round's, by ``time.monotonic``

    def __post_init__(self) -> None:
        view, flat, self.codec = self.view, self.flat, self.view.codec
        # A CPU tensor is read and written through numpy (no torch dispatch per chunk).
        # A CUDA one stays on its GPU: received bytes are decoded, summed and encoded
        # there, on a stream of each pool thread's own (never the training's stream,
        # whose queued backward would hold every copy back).
        self.device = flat.device if flat.is_cuda else None
        self.host = None if flat.is_cuda else flat.numpy()
        # A raw CPU chunk's bytes are checked and checksummed in one C pass each:
        # its sender's (wirecore.crc_of_finite) and its owner's sum (sum_raw_host).
        self.one_pass = self.host is not None and self.codec.plain_fp32 and one_pass_sums()
        self.per = view.chunk_bytes // 4
        self.total = flat.numel()
        self.num_chunks = -(-self.total // self.per)
        self._lock = threading.Lock()  # parts and stats, shared by the pool's threads
        # The chunks this site owns: their parts, by site, until the last is in.
        self._parts: dict[int, dict[int, np.ndarray | torch.Tensor]] = {
            c: {}
            for c in range(self.num_chunks)
            if view.owner(c, self.step, self.group) == view.site_index
        }

    def _bounds(self, c: int) -> tuple[int, int]:
        return c * self.per, min(self.total, (c + 1) * self.per)

    def count(self, **deltas: float) -> None:
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
            self.count(encode_s=time.perf_counter() - t0)

    def _decode(self, payload: bytes | memoryview, n: int) -> np.ndarray | torch.Tensor:
        """Host values (a CPU round) or values on the round's GPU."""
        t0 = time.perf_counter()
        values: np.ndarray | torch.Tensor
        if self.device is None:
            values = self.codec.decode_array(payload, n)
        else:
            values = self.codec.decode_device(payload, n, self.device)
        self.count(decode_s=time.perf_counter() - t0)
        return values

    def _send_chunk(
        self,
        kind: lane_pb2.ChunkKind,
        c: int,
        payload: bytes | memoryview,
        to: dict[int, LanePeer],
        crc: int | None = None,
    ) -> None:
        """Sends chunk ``c`` to the sites of ``to`` (and keeps it in the outbox for a
        resend) from where its payload lies: the round's tensor, or the codec's output
        (a CUDA chunk's in pinned memory of its own, see ``codecs.base.to_host_view``).
        Nothing writes there before every peer took it. ``crc``: the payload's CRC-32C
        where it is already known."""
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
            crc32=crc32(payload) if crc is None else crc,
        )
        frame = Frame(header.SerializeToString(), memoryview(payload).cast("B"))
        self.outbox.put((self.step, self.group, kind, c), frame, to)
        for site in to:
            self.send(site, frame)
        self.count(bytes_sent=len(to) * len(payload), raw_bytes=len(to) * (hi - lo) * 4)

    def _like(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.float32, device=self.device or "cpu")

    def _own(self, lo: int, hi: int) -> np.ndarray | torch.Tensor:
        return self.host[lo:hi] if self.host is not None else self.flat[lo:hi]

    def _store(self, lo: int, hi: int, values: np.ndarray | torch.Tensor) -> None:
        """Writes final values into [lo, hi) of the round's tensor."""
        if self.host is not None:
            np.copyto(self.host[lo:hi], values)
            return
        assert isinstance(values, torch.Tensor)  # a CUDA round decodes onto its GPU
        if values.data_ptr() != self.flat[lo:hi].data_ptr():
            self.flat[lo:hi].copy_(values)

    def contribute(self, c: int, owner: int) -> None:
        """Sends this site's part of chunk ``c`` to its ``owner`` (or keeps it, ours)."""
        lo, hi = self._bounds(c)
        if owner == self.view.site_index:
            self._contribute_own(c, lo, hi)
            return
        if self.one_pass:  # raw: the chunk's own bytes, checked and checksummed at once
            self._contribute_raw(c, lo, hi, owner)
            return
        # Error-feedback state is per lane (its codec), group and chunk. The payload
        # is checked, not the gradient before it: one pass over the encoded bytes (for
        # int8 its scales alone) covers both the gradient and the encode.
        try:
            payload = self._encode(self.flat[lo:hi], f"g{self.group}/c{c}")
        except NonFiniteEncoding as exc:
            self._check_own(c, lo, hi)
            raise self._encode_fault(c, lo, hi, exc) from exc
        self._send_chunk(CONTRIBUTION, c, payload, {owner: self.peers[owner]})

    def _contribute_raw(self, c: int, lo: int, hi: int, owner: int) -> None:
        assert self.host is not None
        t0 = time.perf_counter()
        crc = crc_of_finite(self.host[lo:hi])
        self.count(encode_s=time.perf_counter() - t0)
        if crc is None:  # the raw encode is the values themselves: ours are not finite
            self.count(nonfinite_chunks=1)
            raise self._own_fault(c, lo, hi)
        payload = self.host[lo:hi].data.cast("B")
        self._send_chunk(CONTRIBUTION, c, payload, {owner: self.peers[owner]}, crc)

    def _contribute_own(self, c: int, lo: int, hi: int) -> None:
        me = self.view.site_index
        if not self.codec.lossy:
            # Lossless: decode(encode(x)) is x, so skip both. One pass checks it later.
            if not self.one_pass:
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
            self.count(encode_s=time.perf_counter() - t0)
        self._add_part(c, me, own if self.host is None else own.numpy())

    def _encode_fault(self, c: int, lo: int, hi: int, exc: NonFiniteEncoding) -> EncodingFault:
        self.count(nonfinite_chunks=1)
        return contribution_fault(self.where, c, lo, hi, self.codec.name, exc)

    def _check_own(
        self, c: int, lo: int, hi: int, own: np.ndarray | torch.Tensor | None = None
    ) -> None:
        """Raises NonFiniteGradient if this site's values of chunk ``c`` (or its decoded
        part ``own``) are not finite: summed in, every site's weights turn NaN (issue 14)."""
        if not finite(self._own(lo, hi) if own is None else own):
            raise self._own_fault(c, lo, hi)

    def _own_fault(self, c: int, lo: int, hi: int) -> NonFiniteGradient:
        return NonFiniteGradient(
            f"{self.where}: this site's gradient holds NaN or Inf (chunk {c}, elements "
            f"{lo}..{hi}); refused before it left the site"
        )

    def receive(self, key: MailboxKey, req: Chunk) -> None:
        """Checks and decodes a received chunk: a part summed in, or a result stored."""
        kind, c, sender = key[2], key[3], key[4]
        lo, hi = self._bounds(c)
        if (req.num_elements, req.total_elements) != (hi - lo, self.total):
            # Asked again of the sender itself: a forged chunk that got into the
            # mailbox first must not end the job, the sender's own copy does.
            again = self.pull(key)
            if again is None:
                return  # the round failed meanwhile
            if (again.num_elements, again.total_elements) != (hi - lo, self.total):
                raise ModelMismatch(
                    f"site {sender}'s model differs from this site's: its gradient of "
                    f"group {key[1]} holds {again.total_elements:,} values, this rank's "
                    f"{self.total:,}; every site must build the same model (the same "
                    "code and sizes, seeded with the job's seed)"
                )
            req = again
        values = self._finite_decoded(c, sender, req)
        if values is None:
            # Refused before it is summed, and asked for again: a forged chunk that got
            # into the mailbox first is replaced by the sender's own copy.
            self.count(nonfinite_chunks=1)
            log.warning("%s: chunk %d from site %d holds NaN or Inf; pulling it again",
                        self.where, c, sender)  # fmt: skip
            again = self.pull(key)
            if again is None:
                return  # the round failed meanwhile
            values = self._finite_decoded(c, sender, again)
            if values is None:
                raise CrossSiteError(
                    f"{self.where}: site {sender} sent NaN or Inf in chunk {c} twice; "
                    "refused before summing"
                )
        self.count(bytes_received=len(req.payload))
        if kind == RESULT:
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
        if self.one_pass and self._reduce_raw(c, lo, hi, parts):
            return
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
            self.count(nonfinite_chunks=1)
            cause = "overflowed" if not finite(summed) else "is finite, but its encode is not"
            raise sum_fault(self.where, c, lo, hi, cause, self.codec.name, exc) from exc
        self._send_chunk(RESULT, c, payload, self.peers)

    def _reduce_raw(
        self, c: int, lo: int, hi: int, parts: dict[int, np.ndarray | torch.Tensor]
    ) -> bool:
        """A raw CPU chunk's sum, checks and checksum in one pass; False where the C
        library declined (the caller's passes then do it)."""
        assert self.host is not None
        out, me = self.host[lo:hi], self.view.site_index
        t0 = time.perf_counter()
        host = cast("dict[int, np.ndarray]", parts)
        done = sum_raw_host(host, out, me, self.view.num_sites, self.average)
        self.count(encode_s=time.perf_counter() - t0)
        if done is None:
            self._check_own(c, lo, hi, host[me])  # not checked as it came in
            return False
        status, crc = done
        if status == SUM_OWN_NONFINITE:
            raise self._own_fault(c, lo, hi)
        if status == SUM_OVERFLOW:
            self.count(nonfinite_chunks=1)
            raise sum_fault(self.where, c, lo, hi, "overflowed", self.codec.name, "not finite")
        self._send_chunk(RESULT, c, out.data.cast("B"), self.peers, crc)
        return True

    def pull(self, key: MailboxKey) -> Chunk | None:
        """The chunk ``key`` asked again of its sender until it comes intact; None if
        the round failed meanwhile (:func:`~isthmus.inter.data.round.pull.pull_intact`)."""
        return pull_intact(
            key,
            peer=self.peers[key[4]],
            handoffs=self.handoffs,
            check=self.check,
            generation=self.view.generation,
            site_index=self.view.site_index,
            deadline=self.deadline,
            failed=self.failed,
            where=self.where,
            on_corrupt=lambda: self.count(corrupt_chunks=1),
        )
