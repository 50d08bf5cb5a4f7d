"""TCP_INFO read from real loopback connections (inter/tcp_info.py)."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from isthmus.inter.tcp_info import read_tcp_info


def test_a_connection_reports_what_it_moved_and_its_kernels_settings() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    received = []
    reader = threading.Thread(
        target=lambda: received.append(len(peer.recv(1 << 22, socket.MSG_WAITALL)))
    )
    reader.start()
    client.sendall(b"x" * (4 << 20))
    reader.join(timeout=30)
    info = read_tcp_info(client)
    assert info is not None and received == [4 << 20]
    assert info.bytes_acked >= 4 << 20 and info.bytes_sent >= info.bytes_acked - 1
    assert info.segs_out > 0 and info.mss_bytes > 0 and info.pmtu_bytes >= info.mss_bytes
    assert info.rtt_us > 0 and info.cwnd_bytes == info.cwnd_segments * info.mss_bytes
    assert 0.0 <= info.retrans_ratio <= 1.0
    default = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    assert info.congestion == default
    for s in (client, peer, server):
        s.close()


def test_a_socket_that_is_not_tcp_has_no_tcp_info() -> None:
    with socket.socket(socket.AF_UNIX) as unix, socket.socket(type=socket.SOCK_DGRAM) as udp:
        assert read_tcp_info(unix) is None and read_tcp_info(udp) is None
