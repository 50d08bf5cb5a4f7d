"""The sending side of a lane: one client per peer site.

A :class:`LanePeer` sends to one peer site's :class:`~isthmus.inter.lane.LaneServer`:
per round and per connection, one client-streaming ``PushChunks`` fed from a queue by
a sender thread, so encoding (the callers) and sending overlap. A :class:`PeerRound`
is one round's worth of those streams. :meth:`LanePeer.fetch` pulls one chunk again
(``ResendChunk``) when the copy that arrived failed its checksum.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc

from isthmus.proto import lane_pb2, lane_pb2_grpc

from .lane import channel_options
from .security import INSECURE, SiteSecurity

__all__ = ["LanePeer", "PeerRound"]

_POLL_S = 0.1  # how often blocked loops look at stop/deadline flags


_END = object()  # end-of-round marker


@dataclass(slots=True)
class _Begin:
    """The start of a round on one connection."""

    round_id: int
    future: futures.Future
    deadline: float


class PeerRound:
    """The chunks sent to one peer in one round, over all the peer's connections."""

    _ids = itertools.count(1)

    def __init__(self, senders: list[_Sender], deadline: float) -> None:
        self._senders = senders
        self.round_id = next(PeerRound._ids)
        self._futures = [s.begin(self.round_id, deadline) for s in senders]
        self._next = 0
        self._ended = False
        self._lock = threading.Lock()  # encode/decode pool threads send concurrently
        self.sent = 0

    def send(self, request: lane_pb2.PushChunksRequest) -> None:
        """Queues one chunk; connections take turns. Thread-safe.

        A chunk sent after :meth:`end` (a failing round's stragglers) is dropped: it
        would otherwise open the next round's stream.
        """
        with self._lock:
            if self._ended:
                return
            sender = self._senders[self._next]
            self._next = (self._next + 1) % len(self._senders)
            self.sent += 1
        sender.put((self.round_id, request))

    def end(self) -> None:
        """Closes the round's streams once queued chunks are out (idempotent)."""
        with self._lock:
            ended, self._ended = self._ended, True
        if not ended:
            for sender in self._senders:
                sender.put((self.round_id, _END))

    def failure(self) -> BaseException | None:
        """Returns the first stream's error so far, without waiting."""
        for fut in self._futures:
            if fut.done() and fut.exception() is not None:
                return fut.exception()
        return None

    def wait(self, timeout: float) -> int:
        """Waits for every stream's answer; returns chunks the peer took.

        A chunk is taken when it was accepted or marked corrupt (the peer pulls
        those again with ``ResendChunk``).

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
    """One connection to a peer and the thread that streams its queue.

    Queue items are a :class:`_Begin`, then ``(round_id, chunk)`` pairs and a
    ``(round_id, _END)``. Tagging every item with its round keeps rounds apart when a
    stream fails: gRPC may still pull from the request iterator after the call
    failed, and neither that iterator nor the clean-up may take the next round's items.
    """

    def __init__(self, address: str, options: list, name: str, security: SiteSecurity) -> None:
        self.channel = security.channel(address, options)
        self.stub = lane_pb2_grpc.LaneStub(self.channel)
        self._items: deque = deque()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item: object) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()

    def begin(self, round_id: int, deadline: float) -> futures.Future:
        fut: futures.Future = futures.Future()
        self.put(_Begin(round_id, fut, deadline))
        return fut

    def _next_begin(self) -> _Begin | None:
        """The next round's start; older rounds' leftovers are dropped on the way."""
        with self._cond:
            while not self._stop.is_set():
                while self._items:
                    item = self._items.popleft()
                    if isinstance(item, _Begin):
                        return item
                self._cond.wait(_POLL_S)
        return None

    def _take(self, round_id: int, deadline: float) -> object | None:
        """The next item of round ``round_id`` (a chunk or _END); None once the round is
        superseded, the sender stops or the deadline passes. Never takes another
        round's item."""
        with self._cond:
            while not self._stop.is_set():
                if self._items:
                    item = self._items[0]
                    if isinstance(item, _Begin) or item[0] > round_id:
                        return None
                    self._items.popleft()
                    if item[0] == round_id:
                        return item[1]
                    continue  # a straggler of an older round
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(_POLL_S, left))
        return None

    def _requests(self, first, round_id: int, deadline: float, ended: threading.Event) -> Iterator:
        yield first
        while not ended.is_set() and (item := self._take(round_id, deadline)) is not None:
            if item is _END:
                ended.set()
                return
            yield item

    def _run(self) -> None:
        while (head := self._next_begin()) is not None:
            fut, deadline, round_id = head.future, head.deadline, head.round_id
            first = self._take(round_id, deadline)
            if first is _END:  # nothing for this peer this round
                fut.set_result(0)
                continue
            ended = threading.Event()
            try:
                if first is None:
                    raise TimeoutError("round deadline passed before the first chunk")
                # wait_for_ready: a peer still starting is waited for, up to the deadline.
                reply = self.stub.PushChunks(
                    self._requests(first, round_id, deadline, ended),
                    timeout=max(0.001, deadline - time.monotonic()),
                    wait_for_ready=True,
                )
                fut.set_result(reply.accepted + reply.corrupt)
            except (grpc.RpcError, TimeoutError) as exc:
                fut.set_exception(exc)
            # The rest of a failed round (if any) is dropped by _next_begin/_take, which
            # skip items of older rounds; stop a lingering request iterator too.
            ended.set()

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self.channel.close()  # cancels an open stream so the thread sees the stop
        self._thread.join(timeout=5)


class LanePeer:
    """Client of one peer site's lane.

    Args:
        address: the peer's "host:port".
        chunk_bytes: the job's chunk size (sets the message size limits).
        proxy: optional HTTP CONNECT proxy URL (e.g. the WAN emulator).
        connections: parallel TCP connections, each with its own stream and thread.
        security: mutual TLS and the job token (`isthmus.inter.security`); None = off.
    """

    def __init__(
        self,
        address: str,
        *,
        chunk_bytes: int = 1 << 20,
        proxy: str | None = None,
        connections: int = 1,
        security: SiteSecurity | None = None,
    ) -> None:
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        self.address = address
        self._fetch_lock = threading.Lock()
        self._fetches = 0
        base = channel_options(chunk_bytes)
        # Without an explicit proxy, ignore http_proxy/grpc_proxy from the environment.
        base += [("grpc.http_proxy", proxy)] if proxy else [("grpc.enable_http_proxy", 0)]
        self._senders = [
            # A local subchannel pool and a distinct arg give each channel its own TCP
            # connection; identical channels would share one.
            _Sender(
                address,
                [*base, ("grpc.use_local_subchannel_pool", 1), ("grpc.channel_id", i)],
                name=f"lane-tx-{address}-{i}",
                security=security or INSECURE,
            )
            for i in range(connections)
        ]

    def fetch(
        self, request: lane_pb2.ResendChunkRequest, timeout: float
    ) -> lane_pb2.PushChunksRequest:
        """Pulls one chunk again from the peer (``ResendChunk``).

        Args:
            request: which chunk, and who asks.
            timeout: deadline of the call in seconds.
        Returns:
            The chunk as the peer first sent it; the caller validates it.
        Raises:
            grpc.RpcError: the peer refused, has no such chunk or did not answer.
        """
        # Connections take turns so a resend does not queue behind one busy stream.
        with self._fetch_lock:
            sender = self._senders[self._fetches % len(self._senders)]
            self._fetches += 1
        return sender.stub.ResendChunk(request, timeout=max(0.001, timeout)).chunk

    @property
    def stub(self) -> lane_pb2_grpc.LaneStub:
        """A stub on the first connection, for one-off calls (``PullState``)."""
        return self._senders[0].stub

    def begin_round(self, deadline: float) -> PeerRound:
        """Opens a round whose streams must finish by ``deadline`` (time.monotonic())."""
        return PeerRound(self._senders, deadline)

    def close(self) -> None:
        """Stops the sender threads and closes the channels."""
        for sender in self._senders:
            sender.close()
