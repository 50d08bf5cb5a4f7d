"""A bare gRPC client over HTTP/2 for the simulated ranks of benchmarks/control_plane.py.

The benchmark simulates thousands of ranks in a few processes on the same cores as the
coordinators and host agents it measures. Through grpc.aio a simulated rank's call cost
its process ~150-250 us of CPU (gRPC's completion queues, a poller thread handing every
event to the event loop: docs/benchmarks/control-plane.md, "Real host agents, a process each"), so
2 x 1,024 ranks took a third of the 2 cores and their own fan-out set the decision's
latency. A real rank pays that on its own core. Here a call is a few frames written to
and parsed from the socket by the event loop itself: the same bytes on the wire (HTTP/2,
gRPC's 5-byte message framing, the same protobuf), so the agents and coordinators see
what ranks send them, at a tenth of the client's CPU.

Enough of HTTP/2 for that and no more: plaintext with prior knowledge (as gRPC's own
insecure channels), requests' headers as HPACK literals (no table, no Huffman), the
server's headers not decoded (a call that ends without a message failed; its status is
not read: the benchmark counts it and sends again), receive windows opened wide once,
send windows kept, SETTINGS and PING acknowledged. Not for anything but the benchmark.
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque

__all__ = ["H2Channel", "H2CallError"]

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST, _SETTINGS, _PING, _GOAWAY, _WINDOW = 0, 1, 3, 4, 6, 7, 8
_END_STREAM, _END_HEADERS, _ACK, _PADDED, _PRIORITY = 0x1, 0x4, 0x1, 0x8, 0x20
_WIDE = (1 << 31) - 1


class H2CallError(Exception):
    """A call ended without an answer (a refusal, a reset, the connection gone)."""


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return bytes((n >> 16, (n >> 8) & 0xFF, n & 0xFF, kind, flags)) + stream.to_bytes(4) + payload


def _literal(name_index: int, value: bytes, name: bytes = b"") -> bytes:
    """One HPACK "literal without indexing" (RFC 7541 6.2.2), no Huffman; short strings."""
    if name:
        head = b"\x00" + bytes((len(name),)) + name
    elif name_index < 15:
        head = bytes((name_index,))
    else:
        head = bytes((15, name_index - 15))
    return head + bytes((len(value),)) + value


def _headers(path: str, timeout_s: float | None) -> bytes:
    block = (
        b"\x83\x86"  # :method POST, :scheme http (static table 3, 6)
        + _literal(4, path.encode())  # :path
        + _literal(1, b"localhost")  # :authority
        + _literal(31, b"application/grpc")  # content-type
        + _literal(0, b"trailers", b"te")
    )
    if timeout_s is not None:
        block += _literal(0, f"{max(1, int(timeout_s * 1000))}m".encode(), b"grpc-timeout")
    return block


class _Call:
    """One stream: its answers (gRPC messages) as they come, and its end."""

    def __init__(self) -> None:
        self.messages: deque[bytes] = deque()
        self.buffer = bytearray()
        self.waiter: asyncio.Future | None = None
        self.ended = False
        self.window = 0  # what the server lets this stream send (set on open)

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def next(self) -> bytes:
        while not self.messages:
            if self.ended:
                raise H2CallError("the call ended without an answer")
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return self.messages.popleft()


class H2Channel(asyncio.Protocol):
    """One HTTP/2 connection to a gRPC server; many calls on it, from one event loop.

    Open with :meth:`connect`; ``await channel.unary(path, request)`` for a unary call,
    ``channel.stream(path)`` for a bidi one (``send`` then ``await recv`` each message).
    """

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._calls: dict[int, _Call] = {}
        self._next_stream = 1
        self._send_window = 65_535  # the connection's, from the server's updates
        self._initial_window = 65_535  # each new stream's, from the server's SETTINGS
        self._blocked: deque[tuple[int, bytes, int]] = deque()  # DATA waiting for window
        self.closed = False

    @classmethod
    async def connect(cls, address: str) -> H2Channel:
        """``address``: "unix:/path" or "host:port"."""
        loop = asyncio.get_running_loop()
        if address.startswith("unix:"):
            _, channel = await loop.create_unix_connection(cls, address[5:])
        else:
            host, _, port = address.rpartition(":")
            _, channel = await loop.create_connection(cls, host, int(port))
        return channel

    # -- the protocol ----------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self._transport = transport
        settings = struct.pack(">HI", 0x2, 0) + struct.pack(">HI", 0x4, _WIDE)  # no push
        transport.write(
            _PREFACE
            + _frame(_SETTINGS, 0, 0, settings)
            + _frame(_WINDOW, 0, 0, struct.pack(">I", _WIDE - 65_535))
        )

    def _write(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def connection_lost(self, exc) -> None:
        self.closed = True
        for call in self._calls.values():
            call.ended = True
            call.wake()
        self._calls.clear()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        at = 0
        while len(buffer) - at >= 9:
            n = (buffer[at] << 16) | (buffer[at + 1] << 8) | buffer[at + 2]
            if len(buffer) - at < 9 + n:
                break
            kind, flags = buffer[at + 3], buffer[at + 4]
            stream = int.from_bytes(buffer[at + 5 : at + 9]) & _WIDE
            self._on_frame(kind, flags, stream, bytes(buffer[at + 9 : at + 9 + n]))
            at += 9 + n
        del buffer[:at]

    def _on_frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == _DATA:
            call = self._calls.get(stream)
            if call is not None:
                if flags & _PADDED:
                    payload = payload[1 : len(payload) - payload[0]]
                self._messages(call, payload)
                if flags & _END_STREAM:
                    self._end(stream)
        elif kind == _HEADERS:
            if flags & _END_STREAM:  # the trailers (or a refusal: trailers only)
                self._end(stream)
        elif kind == _SETTINGS:
            if not flags & _ACK:
                for i in range(0, len(payload) - 5, 6):
                    key, value = struct.unpack_from(">HI", payload, i)
                    if key == 0x4:  # INITIAL_WINDOW_SIZE: every open stream moves by the change
                        change, self._initial_window = value - self._initial_window, value
                        for call in self._calls.values():
                            call.window += change
                self._write(_frame(_SETTINGS, _ACK, 0))
                self._flush()
        elif kind == _PING:
            if not flags & _ACK:
                self._write(_frame(_PING, _ACK, 0, payload))
        elif kind == _WINDOW:
            increment = int.from_bytes(payload[:4]) & _WIDE
            if stream == 0:
                self._send_window += increment
            elif stream in self._calls:
                self._calls[stream].window += increment
            self._flush()
        elif kind == _RST:
            self._end(stream)
        elif kind == _GOAWAY:
            self.closed = True
            last = int.from_bytes(payload[:4]) & _WIDE
            for stream_id in [s for s in self._calls if s > last]:
                self._end(stream_id)

    @staticmethod
    def _messages(call: _Call, payload: bytes) -> None:
        buffer = call.buffer
        buffer += payload
        while len(buffer) >= 5:
            n = int.from_bytes(buffer[1:5])
            if len(buffer) < 5 + n:
                break
            call.messages.append(bytes(buffer[5 : 5 + n]))
            del buffer[: 5 + n]
        call.wake()

    def _end(self, stream: int) -> None:
        call = self._calls.pop(stream, None)
        if call is not None:
            call.ended = True
            call.wake()

    # -- sending ---------------------------------------------------------------------------

    def _open(self, path: str, timeout_s: float | None) -> tuple[int, _Call]:
        if self.closed or self._transport is None:
            raise H2CallError("the connection is closed")
        stream, self._next_stream = self._next_stream, self._next_stream + 2
        call = self._calls[stream] = _Call()
        call.window = self._initial_window
        self._write(_frame(_HEADERS, _END_HEADERS, stream, _headers(path, timeout_s)))
        return stream, call

    def _data(self, stream: int, message: bytes, flags: int = 0) -> None:
        payload = b"\x00" + len(message).to_bytes(4) + message
        self._blocked.append((stream, payload, flags))
        self._flush()

    def _flush(self) -> None:
        """Sends the DATA frames that the windows now allow, in order."""
        while self._blocked:
            stream, payload, flags = self._blocked[0]
            call = self._calls.get(stream)
            if call is None:  # the call ended meanwhile
                self._blocked.popleft()
                continue
            if len(payload) > min(self._send_window, call.window):
                return
            self._blocked.popleft()
            self._send_window -= len(payload)
            call.window -= len(payload)
            self._write(_frame(_DATA, flags, stream, payload))

    async def unary(self, path: str, request: bytes, timeout_s: float | None = None) -> bytes:
        """One unary call (``path``: "/package.Service/Method"); its answer's bytes.

        Raises:
            H2CallError: no answer came (refused, reset, or the connection gone).
            TimeoutError: none within ``timeout_s``.
        """
        stream, call = self._open(path, timeout_s)
        self._data(stream, request, _END_STREAM)
        try:
            return await asyncio.wait_for(call.next(), timeout_s)
        finally:
            if not call.ended:  # cancelled or timed out: reset the stream
                self._calls.pop(stream, None)
                if not self.closed:
                    self._write(_frame(_RST, 0, stream, b"\x00\x00\x00\x08"))

    def stream(self, path: str) -> H2Stream:
        """A bidi call, open until :meth:`H2Stream.cancel` or the server ends it."""
        stream, call = self._open(path, None)
        return H2Stream(self, stream, call)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class H2Stream:
    """One bidi call of an :class:`H2Channel`."""

    def __init__(self, channel: H2Channel, stream: int, call: _Call) -> None:
        self._channel, self._stream, self._call = channel, stream, call

    def send(self, message: bytes) -> None:
        if self._call.ended:
            raise H2CallError("the stream ended")
        self._channel._data(self._stream, message)  # noqa: SLF001

    async def recv(self) -> bytes:
        return await self._call.next()

    def cancel(self) -> None:
        channel = self._channel
        if not self._call.ended and not channel.closed:
            channel._calls.pop(self._stream, None)  # noqa: SLF001
            channel._write(_frame(_RST, 0, self._stream, b"\x00\x00\x00\x08"))  # noqa: SLF001
        self._call.ended = True
