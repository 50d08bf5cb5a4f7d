"""The cross-site all-reduce over lanes (DESIGN.md, "Cross-site algorithm").

Chunk ``c`` of a round is owned by site ``(c + step + group) % num_sites``; rotating
with step and group spreads the owners' extra work. Every other site sends the owner
its encoded chunk (CONTRIBUTION); the owner decodes all contributions, its own too,
sums them in site-index order, encodes the sum once and sends those same bytes
(RESULT) to every site; every site, the owner included, keeps ``decode(result)``.
So all sites hold bitwise-identical values whatever the codec.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent import futures

import grpc
import torch

from isthmus.proto import lane_pb2

from .codec import Codec, CodecError, crc32
from .lane import LaneServer
from .lane_peer import LanePeer, PeerRound
from .mailbox import MailboxKey

__all__ = ["CrossSiteAllReduce", "CrossSiteError", "RoundStats"]

log = logging.getLogger(__name__)

_CONTRIBUTION = lane_pb2.CHUNK_KIND_CONTRIBUTION
_RESULT = lane_pb2.CHUNK_KIND_RESULT
_POLL_S = 0.05  # how often a waiting round looks for failed sends


class CrossSiteError(RuntimeError):
    """A cross-site round failed: a peer timed out, refused or sent bad data."""


@dataclasses.dataclass(slots=True)
class RoundStats:
    """What one ``allreduce`` call moved and how long it took."""

    bytes_sent: int = 0
    """Payload bytes this site sent (after encoding)."""
    bytes_received: int = 0
    """Payload bytes this site received and used."""
    raw_bytes: int = 0
    """fp32 bytes of the chunks this site sent, before encoding."""
    tensor_bytes: int = 0
    """fp32 bytes of the whole round's buffer."""
    num_chunks: int = 0
    wall_s: float = 0.0
    encode_s: float = 0.0
    decode_s: float = 0.0


class CrossSiteAllReduce:
    """All-reduces flat fp32 buffers with the same rank of every other site.

    Args:
        site_index: this site's index in the membership.
        num_sites: number of live sites.
        server: this rank's lane server (receives from every peer).
        peers: site index -> lane client, for every other site.
        codec: the job's codec; must match the server's and every peer's.
        chunk_bytes: chunk size in bytes (a multiple of 4, equal to the server's).
        timeout_s: limit on one whole round, from call to last acknowledgement.
        generation: membership generation stamped on every chunk.
    """

    def __init__(
        self,
        *,
        site_index: int,
        num_sites: int,
        server: LaneServer,
        peers: dict[int, LanePeer],
        codec: Codec,
        chunk_bytes: int = 1 << 20,
        timeout_s: float = 60.0,
        generation: int = 0,
    ) -> None:
        expected = set(range(num_sites)) - {site_index}
        if set(peers) != expected:
            raise ValueError(f"peers must cover sites {sorted(expected)}, got {sorted(peers)}")
        if chunk_bytes != server.chunk_bytes:
            raise ValueError(f"chunk_bytes {chunk_bytes} != server's {server.chunk_bytes}")
        if codec.name != server.codec:
            raise ValueError(f"codec {codec.name!r} != server's {server.codec!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.site_index = site_index
        self.num_sites = num_sites
        self.server = server
        self.peers = peers
        self.codec = codec
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.generation = generation

    def owner(self, chunk: int, step: int, group: int) -> int:
        """Returns the site that reduces ``chunk`` of round (step, group)."""
        return (chunk + step + group) % self.num_sites

    def allreduce(
        self, tensors: list[torch.Tensor], step: int, group: int, average: bool
    ) -> RoundStats:
        """Sums (or averages) ``tensors`` over all sites, in place.

        Args:
            tensors: tensors of any shape, dtype and device; every site passes the same
                shapes in the same order. Values travel as fp32.
            step: training step; with ``group`` it names the round on the wire.
            group: FSDP group (bucket) index within the step.
            average: divide the sum by ``num_sites``.
        Returns:
            The round's statistics.
        Raises:
            CrossSiteError: a peer timed out, refused a chunk or sent an invalid one.
        """
        start = time.perf_counter()
        stats = RoundStats()
        if not tensors:
            return stats
        flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])
        stats.tensor_bytes = flat.numel() * 4
        if self.num_sites > 1 and flat.numel() > 0:
            self._round(flat, step, group, average, stats)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n
        stats.wall_s = time.perf_counter() - start
        return stats

    def _request(
        self,
        kind: int,
        chunk: int,
        payload: bytes,
        total: int,
        step: int,
        group: int,
        num_elements: int,
    ) -> lane_pb2.PushChunksRequest:
        per = self.chunk_bytes // 4
        return lane_pb2.PushChunksRequest(
            generation=self.generation,
            step=step,
            group=group,
            kind=kind,
            chunk_index=chunk,
            num_chunks=-(-total // per),
            from_site=self.site_index,
            total_elements=total,
            num_elements=num_elements,
            codec=self.codec.name,
            payload=payload,
            crc32=crc32(payload),
        )

    def _round(
        self, flat: torch.Tensor, step: int, group: int, average: bool, stats: RoundStats
    ) -> None:
        per = self.chunk_bytes // 4
        total = flat.numel()
        num_chunks = -(-total // per)
        stats.num_chunks = num_chunks
        me, sites, codec = self.site_index, self.num_sites, self.codec
        where = f"site {me} step {step} group {group}"
        deadline = time.monotonic() + self.timeout_s
        self.server.mailbox.discard_before(step)

        def bounds(c: int) -> tuple[int, int]:
            return c * per, min(total, (c + 1) * per)

        def encode(c: int, values: torch.Tensor) -> bytes:
            t0 = time.perf_counter()
            payload = codec.encode(values)
            stats.encode_s += time.perf_counter() - t0
            return payload

        def decode(payload: bytes, n: int) -> torch.Tensor:
            t0 = time.perf_counter()
            values = codec.decode(payload, n)
            stats.decode_s += time.perf_counter() - t0
            return values

        rounds: dict[int, PeerRound] = {s: p.begin_round(deadline) for s, p in self.peers.items()}
        try:
            # 1. Contributions first, so peers can start reducing while we wait.
            parts: dict[int, dict[int, torch.Tensor]] = {}
            pending: set[MailboxKey] = set()
            for c in range(num_chunks):
                lo, hi = bounds(c)
                owner = self.owner(c, step, group)
                payload = encode(c, flat[lo:hi])
                if owner == me:
                    # Our own part goes through the codec too, so a lossy codec treats
                    # every site alike.
                    parts[c] = {me: decode(payload, hi - lo)}
                    pending.update((step, group, _CONTRIBUTION, c, s) for s in self.peers)
                else:
                    rounds[owner].send(
                        self._request(_CONTRIBUTION, c, payload, total, step, group, hi - lo)
                    )
                    stats.bytes_sent += len(payload)
                    stats.raw_bytes += (hi - lo) * 4
                    pending.add((step, group, _RESULT, c, owner))
            # 2. Reduce owned chunks and take results in whatever order they arrive.
            while pending:
                self._check_sends(rounds, where)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted({k[4] for k in pending})
                    raise CrossSiteError(
                        f"{where}: timed out after {self.timeout_s:.1f}s waiting for "
                        f"{len(pending)} chunk(s) from site(s) {missing}"
                    )
                found = self.server.mailbox.take_any(pending, min(_POLL_S, remaining))
                if found is None:
                    continue
                key, req = found
                pending.discard(key)
                c, sender = key[3], key[4]
                lo, hi = bounds(c)
                if (req.num_elements, req.total_elements) != (hi - lo, total):
                    raise CrossSiteError(
                        f"{where}: site {sender} sent chunk {c} of {req.num_elements}/"
                        f"{req.total_elements} elements, expected {hi - lo}/{total}"
                    )
                try:
                    values = decode(req.payload, hi - lo)
                except CodecError as exc:
                    raise CrossSiteError(f"{where}: chunk {c} from site {sender}: {exc}") from exc
                stats.bytes_received += len(req.payload)
                if key[2] == _RESULT:
                    flat[lo:hi].copy_(values)
                    continue
                parts[c][sender] = values
                if len(parts[c]) < sites:
                    continue
                # Fixed site order: float addition is not associative, and every site
                # must see the same bits.
                acc = parts.pop(c)
                summed = acc[0].clone()
                for s in range(1, sites):
                    summed.add_(acc[s])
                if average:
                    summed.div_(sites)
                payload = encode(c, summed)
                flat[lo:hi].copy_(decode(payload, hi - lo))
                for rnd in rounds.values():
                    rnd.send(self._request(_RESULT, c, payload, total, step, group, hi - lo))
                    stats.bytes_sent += len(payload)
                    stats.raw_bytes += (hi - lo) * 4
        finally:
            for rnd in rounds.values():
                rnd.end()
        # 3. Return only once every peer acknowledged our chunks, so no peer is left
        # waiting for bytes of a site that already moved on.
        for s, rnd in rounds.items():
            try:
                accepted = rnd.wait(max(0.0, deadline - time.monotonic()))
            except (TimeoutError, futures.TimeoutError) as exc:
                raise CrossSiteError(f"{where}: site {s} did not acknowledge in time") from exc
            except grpc.RpcError as exc:
                raise CrossSiteError(f"{where}: {_describe(s, exc)}") from exc
            if accepted != rnd.sent:
                raise CrossSiteError(f"{where}: site {s} accepted {accepted} of {rnd.sent} chunks")

    def _check_sends(self, rounds: dict[int, PeerRound], where: str) -> None:
        for s, rnd in rounds.items():
            exc = rnd.failure()
            if exc is not None:
                raise CrossSiteError(f"{where}: {_describe(s, exc)}") from exc


def _describe(site: int, exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        code = exc.code()
        kind = "timed out" if code == grpc.StatusCode.DEADLINE_EXCEEDED else "failed"
        return f"sending to site {site} {kind}: {code.name}: {exc.details()}"
    return f"sending to site {site} failed: {exc}"
