"""The C receive path (inter/data/transport/wirecore.c) against Python's, on real sockets.

Both backends must give the same CRC-32C, the same finite verdicts and the same errors
(a peer that closes mid-frame, one that stalls). The C one is the extension the
package's build compiled (setup.py); ISTHMUS_NATIVE=0 turns it off.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import crc32c
import numpy as np
import pytest

from isthmus.inter.data.transport import wirecore

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["native", "python"])
def backend(request, monkeypatch):
    """wirecore with its C extension, or without it (as where it was not built)."""
    if request.param == "native":
        # The install builds it (setup.py): without it there is nothing to compare.
        assert wirecore.load() is not None, "wirecore's C extension is not built"
    else:
        monkeypatch.setattr(wirecore, "load", lambda: None)
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


def test_the_extension_is_the_one_the_build_put_beside_wirecore() -> None:
    native = wirecore.load()
    assert native is not None and os.path.dirname(native.__file__) == os.path.dirname(
        wirecore.__file__
    )


def test_isthmus_native_0_turns_the_extension_off_and_says_so_once() -> None:
    code = """if True:
        import logging, socket
        import numpy as np
        from isthmus.inter.data.transport import wirecore
        logging.basicConfig(format="%(message)s")
        assert wirecore.load() is None and wirecore.load() is None
        assert not wirecore.one_pass_sums()
        a, b = socket.socketpair()
        a.sendall(b"abc")
        buf = memoryview(np.empty(3, dtype=np.uint8)).cast("B")
        print(wirecore.recv_payload(b, buf, 5, f32=False))
    """
    env = {**os.environ, "ISTHMUS_NATIVE": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"({crc32c.crc32c(b'abc')}, None)"
    assert done.stderr.count("wirecore: no C extension (ISTHMUS_NATIVE=0)") == 1, done.stderr
