"""The C receive path (inter/data/transport/wirecore.c) against Python's, on real sockets.

Both backends must give the same CRC-32C, the same finite verdicts and the same errors
(a peer that closes mid-frame, one that stalls); the library is built only into a
private folder and never loaded from one that others can write.
"""

from __future__ import annotations

import os
import socket
import threading

import crc32c
import numpy as np
import pytest

from isthmus.inter.data.transport import wirecore

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["native", "python"])
def backend(request, monkeypatch, tmp_path):
    """wirecore loaded afresh with the C library (built into a temp ISTHMUS_HOME) or
    with ISTHMUS_NATIVE=0."""
    monkeypatch.setenv("ISTHMUS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ISTHMUS_NATIVE", "1" if request.param == "native" else "0")
    monkeypatch.setattr(wirecore, "_tried", False)
    monkeypatch.setattr(wirecore, "_lib", None)
    monkeypatch.setattr(wirecore, "BACKEND", "python")
    wirecore.load()
    assert request.param == wirecore.BACKEND
    return request.param


def _pair() -> tuple[socket.socket, socket.socket]:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    return client, server


def _send_later(sock: socket.socket, data: bytes, close: bool = True) -> threading.Thread:
    def run() -> None:
        # In pieces, so the receive sees partial reads and words split across them.
        for i in range(0, len(data), 70001):
            sock.sendall(data[i : i + 70001])
        if close:
            sock.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("size", [1, 7, 4096 + 3, 3 * 8192 * 5 + 17, 5 << 20])
def test_a_payload_arrives_whole_with_the_checksum_of_its_bytes(backend, size) -> None:
    data = os.urandom(size)
    client, server = _pair()
    with server:
        sender = _send_later(client, data)
        buf = memoryview(np.empty(size, dtype=np.uint8)).cast("B")
        crc, finite = wirecore.recv_payload(server, buf, stall_s=10, f32=False)
        sender.join()
    assert bytes(buf) == data and crc == crc32c.crc32c(data) and finite is None


@pytest.mark.parametrize("bad", [None, np.nan, np.inf, -np.inf])
def test_fp32_payloads_are_checked_for_nan_and_inf_as_they_arrive(backend, bad) -> None:
    values = np.random.default_rng(1).standard_normal(300_001).astype("<f4")
    values[-1] = 3.0e38  # large but finite
    if bad is not None:
        values[123_457] = bad
    data = values.tobytes()
    client, server = _pair()
    with server:
        _send_later(client, data).join()
        buf = memoryview(np.empty(len(data), dtype=np.uint8)).cast("B")
        crc, finite = wirecore.recv_payload(server, buf, stall_s=10, f32=True)
    assert crc == crc32c.crc32c(data)
    # Python's path leaves the check to the round (None); C's answers it.
    expected = None if backend == "python" else bad is None
    assert finite is expected
    assert wirecore.all_finite(np.frombuffer(buf, dtype="<f4")) is (bad is None)


def test_a_peer_that_closes_mid_frame_is_reported(backend) -> None:
    client, server = _pair()
    with server:
        _send_later(client, b"x" * 1000).join()
        buf = memoryview(np.empty(5000, dtype=np.uint8)).cast("B")
        with pytest.raises(wirecore.FrameClosed):
            wirecore.recv_payload(server, buf, stall_s=10, f32=False)


def test_a_peer_that_stalls_mid_frame_times_out(backend) -> None:
    client, server = _pair()
    with server, client:
        client.sendall(b"x" * 1000)
        server.settimeout(30)  # non-blocking underneath, as the bulk listener's is
        buf = memoryview(np.empty(5000, dtype=np.uint8)).cast("B")
        with pytest.raises(TimeoutError):
            wirecore.recv_payload(server, buf, stall_s=0.3, f32=False)


def test_a_library_others_can_write_is_not_loaded(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("ISTHMUS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ISTHMUS_NATIVE", "1")
    monkeypatch.setattr(wirecore, "_tried", False)
    monkeypatch.setattr(wirecore, "_lib", None)
    monkeypatch.setattr(wirecore, "BACKEND", "python")
    assert wirecore.load() is not None  # built
    path = wirecore.library_path()
    assert path.stat().st_mode & 0o777 == 0o700
    assert path.parent.stat().st_mode & 0o777 == 0o700
    path.chmod(0o722)  # writable by group and others: someone could swap its code
    monkeypatch.setattr(wirecore, "_tried", False)
    monkeypatch.setattr(wirecore, "_lib", None)
    monkeypatch.setattr(wirecore, "BACKEND", "python")
    with caplog.at_level("WARNING"):
        assert wirecore.load() is None
    assert wirecore.BACKEND == "python"
    assert "writable by other users" in caplog.text


def test_without_a_compiler_the_python_path_is_used(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("ISTHMUS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ISTHMUS_NATIVE", "1")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(wirecore, "_tried", False)
    monkeypatch.setattr(wirecore, "_lib", None)
    monkeypatch.setattr(wirecore, "BACKEND", "python")
    with caplog.at_level("WARNING"):
        assert wirecore.load() is None
    assert "the C receive path is off" in caplog.text
    client, server = _pair()
    with server:
        _send_later(client, b"abc").join()
        buf = memoryview(np.empty(3, dtype=np.uint8)).cast("B")
        assert wirecore.recv_payload(server, buf, 5, f32=False)[0] == crc32c.crc32c(b"abc")
