"""A gRPC channel that may be closed while other threads still call on it.

Every isthmus client channel is one (``SiteSecurity.channel``): closing a plain one under
a caller crashed the process (below).
"""

from __future__ import annotations

import threading

import grpc

__all__ = ["ClosableChannel", "ClosedChannelError"]


class ClosedChannelError(grpc.RpcError, grpc.Call, grpc.Future):
    """A call started on a channel after it was closed: CANCELLED, as a call in flight
    when the channel closes ends. Also the ended call and future that gRPC's
    interceptors hand on in place of one that failed (as gRPC's own errors are)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return "the channel was closed"

    def initial_metadata(self) -> tuple:
        return ()

    def trailing_metadata(self) -> tuple:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None

    def add_callback(self, callback) -> bool:
        return False

    def cancel(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def running(self) -> bool:
        return False

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None):
        raise self

    def exception(self, timeout: float | None = None) -> ClosedChannelError:
        return self

    def traceback(self, timeout: float | None = None):
        return None

    def add_done_callback(self, fn) -> None:
        fn(self)

    def __iter__(self):  # a response stream that ends at once, in this error
        return self

    def __next__(self):
        raise self


class ClosableChannel(grpc.Channel):
    """A channel whose calls, once it is closed, fail with :class:`ClosedChannelError`
    rather than crash the process.

    gRPC Python (1.84, 1.85) dereferences a freed core channel when a method is
    registered on a closed channel (``Channel._get_registered_call_handle``): SIGSEGV. A
    channel with an interceptor (the token's) registers its method on every call, so a
    thread that started a call while another closed the channel took the whole process
    down (a rank, and the launcher through its host agent, in CI on 2026-12-02). Making
    a call's handle and closing are held apart by a lock, and a closed channel makes
    none.
    """

    def __init__(self, channel: grpc.Channel) -> None:
        self._inner = channel
        self._lock = threading.Lock()
        self._closed = False

    def _callable(self, kind: str, *args, **kwargs):
        with self._lock:
            if self._closed:
                raise ClosedChannelError()
            return getattr(self._inner, kind)(*args, **kwargs)

    def unary_unary(self, *args, **kwargs):
        return self._callable("unary_unary", *args, **kwargs)

    def unary_stream(self, *args, **kwargs):
        return self._callable("unary_stream", *args, **kwargs)

    def stream_unary(self, *args, **kwargs):
        return self._callable("stream_unary", *args, **kwargs)

    def stream_stream(self, *args, **kwargs):
        return self._callable("stream_stream", *args, **kwargs)

    def subscribe(self, callback, try_to_connect: bool = False) -> None:
        self._inner.subscribe(callback, try_to_connect=try_to_connect)

    def unsubscribe(self, callback) -> None:
        self._inner.unsubscribe(callback)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._inner.close()

    def __enter__(self) -> ClosableChannel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
