"""A per-host agent's votes on one open stream (``HostSession``) instead of a call each.

A site of 1,024 ranks votes with 128 ``CommitHostStep`` calls a step (one a host of 8), in
one burst when the step's rounds end; each unary call costs the coordinator ~0.3-0.8 ms of
Python gRPC (a fresh HTTP/2 stream, a hand-off to a pool thread), so the burst set the
step's decision latency (docs/benchmarks/control-plane.md, "The control plane at scale").
On an open stream a vote is a message to a thread already waiting for it.

:class:`HostSession` keeps one stream and sends a host's votes on it, one outstanding at a
time, each answered as ``CommitHostStep`` would. When the coordinator has no session slot
free (RESOURCE_EXHAUSTED: each holds one of its handler threads, at most one a rank) or
the stream breaks, the vote goes by ``CommitHostStep`` and the next one opens a new
stream: a session is a fast path, never the only one.
"""

from __future__ import annotations

import logging
import queue
import threading

import grpc

from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

__all__ = ["HostSession"]

log = logging.getLogger("isthmus.host_session")

_END = object()  # closes the request stream; ends the answers


class _Stream:
    """One open ``HostSession`` call: requests in, answers out, in order."""

    def __init__(self, stub: pb_grpc.CoordinatorStub) -> None:
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.answers: queue.SimpleQueue = queue.SimpleQueue()
        self.call = stub.HostSession(iter(self.requests.get, _END))
        self._reader = threading.Thread(target=self._read, name="host-session", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for decision in self.call:
                self.answers.put(decision)
        except grpc.RpcError as exc:
            self.answers.put(exc)
        self.answers.put(_END)

    def close(self) -> None:
        self.requests.put(_END)
        self.call.cancel()


class HostSession:
    """A host agent's votes at its site's coordinator, on one stream while it lasts.

    Args:
        stub: a stub on a channel to the site's coordinator.
        rpc_slack_s: how long past a vote's ``wait_ms`` an answer may take before the
            stream counts as broken (it is closed and the vote raises ``TimeoutError``).
    """

    def __init__(self, stub: pb_grpc.CoordinatorStub, *, rpc_slack_s: float = 5.0) -> None:
        self.stub = stub
        self.rpc_slack_s = rpc_slack_s
        self._stream: _Stream | None = None
        self._lock = threading.Lock()  # one vote on the stream at a time: answers come in order
        self._closed = False  # close() was called since the stream opened
        self.unary_votes = 0
        """Votes that went by CommitHostStep (no session slot, or a broken stream)."""

    def vote(
        self, request: pb.CommitHostStepRequest, timeout_s: float | None = None
    ) -> pb.Decision:
        """Sends the host's ballots on ``request.step`` and returns the answer (PENDING
        when ``request.wait_ms`` passed without a decision: send it again); no answer in
        ``timeout_s`` (default: the wait and ``rpc_slack_s``) breaks the stream.

        Raises:
            grpc.RpcError: the coordinator refused the vote (INVALID_ARGUMENT,
                PERMISSION_DENIED, FAILED_PRECONDITION: nothing of it was recorded), or
                neither the stream nor ``CommitHostStep`` got an answer.
            TimeoutError: the stream took longer than the wait and its slack.
        """
        if timeout_s is None:
            timeout_s = request.wait_ms / 1000 + self.rpc_slack_s
        with self._lock:
            return self._vote(request, timeout_s)

    def _vote(self, request: pb.CommitHostStepRequest, timeout_s: float) -> pb.Decision:
        if self._stream is None:
            self._closed = False
            self._stream = _Stream(self.stub)
        stream = self._stream
        stream.requests.put(request)
        try:
            answer = stream.answers.get(timeout=timeout_s)
        except queue.Empty:
            self._drop()
            raise TimeoutError(f"no answer on the host session within {timeout_s:.1f}s") from None
        if isinstance(answer, pb.Decision):
            return answer
        self._drop()
        if isinstance(answer, grpc.RpcError) and (
            self._closed
            or answer.code()
            not in (
                grpc.StatusCode.RESOURCE_EXHAUSTED,  # no session slot free
                grpc.StatusCode.UNAVAILABLE,  # the stream broke
                grpc.StatusCode.CANCELLED,  # the coordinator stopping
            )
        ):
            raise answer  # refused for what it says (a call would be too), or closed here
        log.debug("host session unavailable (%s); voting by CommitHostStep", answer)
        self.unary_votes += 1
        return self.stub.CommitHostStep(request, timeout=timeout_s)

    def close(self) -> None:
        """Ends the stream (the coordinator frees its session's thread) and any vote
        waiting on it: that vote raises CANCELLED; a later vote opens another stream."""
        self._closed = True
        self._drop()

    def _drop(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def __enter__(self) -> HostSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
