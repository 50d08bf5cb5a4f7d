"""Lanes: the gRPC data plane between the ranks at one mesh coordinate of every site.

A :class:`LaneServer` receives ``PushChunks`` streams, validates every message field
by field and deposits the valid ones in a :class:`Mailbox`. A :class:`LanePeer` sends
to one peer site: per round and per connection, one client-streaming ``PushChunks``
fed from a queue by a sender thread, so encoding (the caller) and sending overlap.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent import futures

import grpc

from isthmus.proto import lane_pb2, lane_pb2_grpc

from .codec import crc32

__all__ = ["LanePeer", "LaneServer", "Mailbox", "MailboxKey", "PeerRound", "max_payload_bytes"]

log = logging.getLogger(__name__)

# (step, group, kind, chunk_index, from_site)
MailboxKey = tuple[int, int, int, int, int]
_HEADROOM = 64 * 1024  # protobuf framing and metadata on top of the payload
_POLL_S = 0.1  # how often blocked loops look at stop/deadline flags


def max_payload_bytes(chunk_bytes: int) -> int:
    """Returns the largest payload accepted for ``chunk_bytes`` of fp32 values.

    zstd's worst case on incompressible input is a little above the input
    (ZSTD_compressBound is about n + n/256 + 64); allow that and some slack.
    """
    return chunk_bytes + chunk_bytes // 128 + 1024


def _channel_options(chunk_bytes: int) -> list[tuple[str, int]]:
    limit = max_payload_bytes(chunk_bytes) + _HEADROOM
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


class Mailbox:
    """Thread-safe store of received chunks keyed by :data:`MailboxKey`.

    Keeps the keys ever deposited for the live steps so a replayed chunk is refused
    even after it was taken, and a step floor so chunks of finished rounds are refused.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: dict[MailboxKey, lane_pb2.PushChunksRequest] = {}
        self._seen: set[MailboxKey] = set()
        self._floor = 0

    def deposit(self, key: MailboxKey, item: lane_pb2.PushChunksRequest) -> str | None:
        """Stores ``item``; returns None, or why it was refused ("duplicate"/"stale")."""
        with self._cond:
            if key[0] < self._floor:
                return "stale"
            if key in self._seen:
                return "duplicate"
            self._seen.add(key)
            self._items[key] = item
            self._cond.notify_all()
            return None

    def take(self, key: MailboxKey, timeout: float) -> lane_pb2.PushChunksRequest:
        """Waits up to ``timeout`` seconds for ``key``, removes and returns it.

        Raises:
            TimeoutError: nothing arrived under ``key`` in time.
        """
        found = self.take_any((key,), timeout)
        if found is None:
            raise TimeoutError(f"no chunk {key} within {timeout:.3f}s")
        return found[1]

    def take_any(
        self, keys: Iterable[MailboxKey], timeout: float
    ) -> tuple[MailboxKey, lane_pb2.PushChunksRequest] | None:
        """Waits up to ``timeout`` seconds for any of ``keys``; removes and returns it."""
        wanted = keys if isinstance(keys, (set, frozenset, dict)) else set(keys)
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while True:
                for key in self._items:  # the mailbox is usually the smaller side
                    if key in wanted:
                        return key, self._items.pop(key)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def discard_before(self, step: int) -> int:
        """Drops everything of steps before ``step`` and refuses them from now on.

        Returns:
            The number of unclaimed chunks dropped.
        """
        with self._cond:
            self._floor = max(self._floor, step)
            stale = [k for k in self._items if k[0] < step]
            for key in stale:
                del self._items[key]
            self._seen = {k for k in self._seen if k[0] >= step}
            return len(stale)

    def clear(self) -> None:
        """Forgets everything (a new membership generation starts over)."""
        with self._cond:
            self._items.clear()
            self._seen.clear()
            self._floor = 0

    def keys(self) -> list[MailboxKey]:
        """Returns a snapshot of the keys waiting to be taken."""
        with self._cond:
            return list(self._items)

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class LaneServer(lane_pb2_grpc.LaneServicer):
    """The receiving side of one rank's lane.

    Args:
        site_index: this site's index in the membership's site list.
        num_sites: number of sites in the membership.
        codec: codec name every sender must use (``Codec.name``).
        generation: current membership generation.
        chunk_bytes: the job's chunk size; bounds payloads and messages.
        host: interface to bind; port 0 lets the OS pick.
        port: port to bind (0 = ephemeral).
        max_workers: handler threads; each open stream holds one for its round.
    """

    def __init__(
        self,
        *,
        site_index: int,
        num_sites: int,
        codec: str,
        generation: int = 0,
        chunk_bytes: int = 1 << 20,
        host: str = "127.0.0.1",
        port: int = 0,
        max_workers: int = 32,
    ) -> None:
        if not 0 <= site_index < num_sites:
            raise ValueError(f"site_index must be in [0, {num_sites}), got {site_index}")
        if chunk_bytes < 4 or chunk_bytes % 4:
            raise ValueError(f"chunk_bytes must be a positive multiple of 4, got {chunk_bytes}")
        self.site_index = site_index
        self.codec = codec
        self.chunk_bytes = chunk_bytes
        self.mailbox = Mailbox()
        self._lock = threading.Lock()
        self._generation = generation
        self._num_sites = num_sites
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="lane-rx"),
            options=_channel_options(chunk_bytes),
        )
        lane_pb2_grpc.add_LaneServicer_to_server(self, self._server)
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"could not bind lane server to {host}:{port}")
        self._address = f"{host}:{bound}"
        self._server.start()
        log.info("[site %d] lane server listening on %s", site_index, self._address)

    @property
    def address(self) -> str:
        """The "host:port" peers dial."""
        return self._address

    @property
    def generation(self) -> int:
        """The membership generation accepted chunks must carry."""
        with self._lock:
            return self._generation

    def set_generation(self, generation: int, num_sites: int | None = None) -> None:
        """Moves to a new membership; chunks of the old one in the mailbox are dropped."""
        with self._lock:
            self._generation = generation
            if num_sites is not None:
                self._num_sites = num_sites
            self.mailbox.clear()

    def stop(self, grace: float | None = 1.0) -> None:
        """Stops accepting streams; open ones get ``grace`` seconds to finish."""
        self._server.stop(grace).wait(timeout=(grace or 0) + 5)

    def _validate(self, req: lane_pb2.PushChunksRequest) -> None:
        with self._lock:
            generation, num_sites = self._generation, self._num_sites
        per = self.chunk_bytes // 4
        limit = max_payload_bytes(self.chunk_bytes)
        crc = crc32(req.payload)
        pre, bad = grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT
        kinds = (lane_pb2.CHUNK_KIND_CONTRIBUTION, lane_pb2.CHUNK_KIND_RESULT)
        # Cheap field checks first; the CRC last, on a message that is otherwise sound.
        checks = (
            (
                req.generation == generation,
                pre,
                f"generation {req.generation} != receiver's {generation}",
            ),
            (req.codec == self.codec, pre, f"codec {req.codec!r} != receiver's {self.codec!r}"),
            (
                req.from_site < num_sites and req.from_site != self.site_index,
                bad,
                f"from_site {req.from_site} is not a peer of site {self.site_index} "
                f"among {num_sites} sites",
            ),
            (req.kind in kinds, bad, f"chunk kind {req.kind} is not CONTRIBUTION or RESULT"),
            (
                req.chunk_index < req.num_chunks,
                bad,
                f"chunk_index {req.chunk_index} >= num_chunks {req.num_chunks}",
            ),
            (
                0 < req.num_elements <= min(per, req.total_elements),
                bad,
                f"num_elements {req.num_elements} outside [1, {min(per, req.total_elements)}]",
            ),
            (
                req.num_chunks == -(-req.total_elements // per),
                bad,
                f"num_chunks {req.num_chunks} does not match total_elements "
                f"{req.total_elements} in chunks of {per}",
            ),
            (
                len(req.payload) <= limit,
                bad,
                f"payload of {len(req.payload)} bytes exceeds {limit}",
            ),
            (
                crc == req.crc32,
                bad,
                f"crc32 mismatch on chunk {req.chunk_index}: payload has "
                f"{crc:#010x}, header says {req.crc32:#010x}",
            ),
        )
        for ok, code, why in checks:
            if not ok:
                raise _Refused(code, why)

    def PushChunks(  # noqa: N802 (gRPC method name)
        self,
        request_iterator: Iterator[lane_pb2.PushChunksRequest],
        context: grpc.ServicerContext,
    ) -> lane_pb2.PushChunksResponse:
        """Validates and deposits each chunk of the stream; aborts on the first bad one.

        Chunks are deposited one by one as they arrive, not at the end of the stream:
        a round's stream stays open until the sender's results are out, and those wait
        for the chunks already sent (holding them back would deadlock). A refused chunk
        changes nothing; valid chunks before it in the stream stay deposited.
        """
        accepted = 0
        for req in request_iterator:
            try:
                self._validate(req)
                key = (req.step, req.group, req.kind, req.chunk_index, req.from_site)
                why = self.mailbox.deposit(key, req)
                if why == "duplicate":
                    raise _Refused(grpc.StatusCode.ALREADY_EXISTS, f"duplicate chunk {key}")
                if why == "stale":
                    raise _Refused(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"chunk {key} belongs to a finished step",
                    )
            except _Refused as exc:
                msg = (
                    f"site {self.site_index} refused chunk from site {req.from_site} "
                    f"(step {req.step} group {req.group}): {exc}"
                )
                log.warning(msg)
                context.abort(exc.code, msg)  # raises; nothing of this chunk was stored
            accepted += 1
        return lane_pb2.PushChunksResponse(accepted=accepted)


class _End:
    """End-of-round sentinel."""


class PeerRound:
    """The chunks sent to one peer in one round, over all the peer's connections."""

    def __init__(self, senders: list[_Sender], deadline: float) -> None:
        self._senders = senders
        self._futures = [s.begin(deadline) for s in senders]
        self._next = 0
        self._ended = False
        self.sent = 0

    def send(self, request: lane_pb2.PushChunksRequest) -> None:
        """Queues one chunk; connections take turns."""
        self._senders[self._next].queue.put(request)
        self._next = (self._next + 1) % len(self._senders)
        self.sent += 1

    def end(self) -> None:
        """Closes the round's streams once queued chunks are out (idempotent)."""
        if not self._ended:
            self._ended = True
            for sender in self._senders:
                sender.queue.put(_End())

    def failure(self) -> BaseException | None:
        """Returns the first stream's error so far, without waiting."""
        for fut in self._futures:
            if fut.done() and fut.exception() is not None:
                return fut.exception()
        return None

    def wait(self, timeout: float) -> int:
        """Waits for every stream's answer; returns chunks the peer accepted.

        Raises:
            grpc.RpcError: a stream was refused or failed.
            TimeoutError: no answer within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        total = 0
        for fut in self._futures:
            total += fut.result(timeout=max(0.0, deadline - time.monotonic()))
        return total


class _Sender:
    """One connection to a peer and the thread that streams its queue."""

    def __init__(self, address: str, options: list, name: str) -> None:
        self.channel = grpc.insecure_channel(address, options=options)
        self._stub = lane_pb2_grpc.LaneStub(self.channel)
        self.queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def begin(self, deadline: float) -> futures.Future:
        fut: futures.Future = futures.Future()
        self.queue.put((fut, deadline))
        return fut

    def _get(self, deadline: float | None) -> object | None:
        """Next queue item, or None once stopped or past ``deadline``."""
        while not self._stop.is_set():
            if deadline is not None and time.monotonic() > deadline:
                return None
            try:
                return self.queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
        return None

    def _requests(self, first, deadline: float, ended: threading.Event) -> Iterator:
        yield first
        while (item := self._get(deadline)) is not None:
            if isinstance(item, _End):
                ended.set()
                return
            yield item

    def _run(self) -> None:
        while (head := self._get(None)) is not None:
            fut, deadline = head  # every round starts with begin()'s (future, deadline)
            first = self._get(deadline)
            if isinstance(first, _End):  # nothing for this peer this round
                fut.set_result(0)
                continue
            ended = threading.Event()
            try:
                if first is None:
                    raise TimeoutError("round deadline passed before the first chunk")
                # wait_for_ready: a peer still starting is waited for, up to the deadline.
                reply = self._stub.PushChunks(
                    self._requests(first, deadline, ended),
                    timeout=max(0.001, deadline - time.monotonic()),
                    wait_for_ready=True,
                )
                fut.set_result(reply.accepted)
            except (grpc.RpcError, TimeoutError) as exc:
                fut.set_exception(exc)
            # After a failure (or a stream cut short by the deadline) drop the rest of
            # this round so the next round starts clean.
            while not ended.is_set() and (item := self._get(None)) is not None:
                if isinstance(item, _End):
                    break

    def close(self) -> None:
        self._stop.set()
        self.channel.close()  # cancels an open stream so the thread sees the stop
        self._thread.join(timeout=5)


class LanePeer:
    """Client of one peer site's lane.

    Args:
        address: the peer's "host:port".
        chunk_bytes: the job's chunk size (sets the message size limits).
        proxy: optional HTTP CONNECT proxy URL (e.g. the WAN emulator).
        connections: parallel TCP connections, each with its own stream and thread.
    """

    def __init__(
        self,
        address: str,
        *,
        chunk_bytes: int = 1 << 20,
        proxy: str | None = None,
        connections: int = 1,
    ) -> None:
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        self.address = address
        base = _channel_options(chunk_bytes)
        # Without an explicit proxy, ignore http_proxy/grpc_proxy from the environment.
        base += [("grpc.http_proxy", proxy)] if proxy else [("grpc.enable_http_proxy", 0)]
        self._senders = [
            # A local subchannel pool and a distinct arg give each channel its own TCP
            # connection; identical channels would share one.
            _Sender(
                address,
                [*base, ("grpc.use_local_subchannel_pool", 1), ("grpc.channel_id", i)],
                name=f"lane-tx-{address}-{i}",
            )
            for i in range(connections)
        ]

    def begin_round(self, deadline: float) -> PeerRound:
        """Opens a round whose streams must finish by ``deadline`` (time.monotonic())."""
        return PeerRound(self._senders, deadline)

    def close(self) -> None:
        """Stops the sender threads and closes the channels."""
        for sender in self._senders:
            sender.close()
