"""What the kernel knows of one TCP connection (Linux `TCP_INFO`), read without root.

Both the live lanes (each bulk flow's RTT, window and retransmits, per step) and
`isthmus probe` (a link before the job) read it; `struct tcp_info` is Linux's
`include/uapi/linux/tcp.h`, whose fields are only ever appended, so a shorter answer from
an older kernel leaves the later fields at 0 (`TcpInfo.size` says how much came back)."""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

# struct tcp_info up to tcpi_bytes_retrans (Linux 4.19+), each field by its name less
# "tcpi_"; "_" marks the fields no reader here needs.
_FIELDS = (
    "state ca_state retransmits probes backoff options wscale flags "
    "rto ato snd_mss rcv_mss unacked sacked lost retrans fackets _ _ _ _ pmtu rcv_ssthresh "
    "rtt rttvar snd_ssthresh snd_cwnd advmss reordering rcv_rtt rcv_space total_retrans "
    "pacing_rate max_pacing_rate bytes_acked bytes_received "
    "segs_out segs_in notsent_bytes min_rtt data_segs_in data_segs_out "
    "delivery_rate busy_time rwnd_limited sndbuf_limited delivered delivered_ce "
    "bytes_sent bytes_retrans"
)
_NAMES = _FIELDS.split()
_LAYOUT = struct.Struct("=8B24I4Q6I4Q2I2Q")
assert len(_NAMES) == len(_LAYOUT.unpack(bytes(_LAYOUT.size)))
_TCP_INFO = getattr(socket, "TCP_INFO", 11)
_TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)


@dataclass(kw_only=True, slots=True, frozen=True)
class TcpInfo:
    """One reading; times in microseconds, sizes in bytes, counts in segments."""

    rtt_us: int  # smoothed RTT
    rttvar_us: int
    min_rtt_us: int
    cwnd_segments: int
    mss_bytes: int
    pmtu_bytes: int
    total_retrans: int  # segments retransmitted over the connection's life
    segs_out: int
    bytes_acked: int
    bytes_sent: int  # including retransmissions
    bytes_retrans: int
    delivery_rate_bps: int  # the kernel's latest goodput sample, bits per second
    rwnd_limited_us: int  # time sending was held by the peer's receive window
    sndbuf_limited_us: int  # ... by our own send buffer
    congestion: str  # the congestion control in use, e.g. "cubic", "bbr"
    size: int  # bytes of struct tcp_info the kernel returned

    @property
    def cwnd_bytes(self) -> int:
        return self.cwnd_segments * self.mss_bytes

    @property
    def retrans_ratio(self) -> float:
        """Retransmitted segments over segments sent: the link's loss as TCP felt it."""
        return self.total_retrans / self.segs_out if self.segs_out else 0.0


def read_tcp_info(sock: socket.socket) -> TcpInfo | None:
    """The connection's `TcpInfo`, or None where the kernel has none for it (not TCP, not
    Linux, closed)."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _LAYOUT.size)
        congestion = sock.getsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, 16)
    except (OSError, ValueError):
        return None
    f = dict(zip(_NAMES, _LAYOUT.unpack(raw.ljust(_LAYOUT.size, b"\0")), strict=True))
    return TcpInfo(
        rtt_us=f["rtt"],
        rttvar_us=f["rttvar"],
        min_rtt_us=f["min_rtt"],
        cwnd_segments=f["snd_cwnd"],
        mss_bytes=f["snd_mss"],
        pmtu_bytes=f["pmtu"],
        total_retrans=f["total_retrans"],
        segs_out=f["segs_out"],
        bytes_acked=f["bytes_acked"],
        bytes_sent=f["bytes_sent"],
        bytes_retrans=f["bytes_retrans"],
        delivery_rate_bps=f["delivery_rate"] * 8,
        rwnd_limited_us=f["rwnd_limited"],
        sndbuf_limited_us=f["sndbuf_limited"],
        congestion=congestion.split(b"\0", 1)[0].decode("ascii", "replace"),
        size=len(raw),
    )
