"""`isthmus probe`'s host audit: this host's TCP settings against the links it measured,
one line of advice (with the sysctl to set) per finding. Reads ``root`` (/proc/sys), so
a test or an operator can audit a copy of another host's settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 1 << 20
LOSSY = 1e-4
"""Loss from which the congestion control's answer to it matters (cubic's rate falls
as 1/sqrt(loss): 1e-4 at 50 ms holds a 1448-byte-MSS flow to ~0.28 Gbit/s)."""


def read_sysctl(root: str | Path, name: str) -> str | None:
    try:
        return Path(root, *name.split(".")).read_text().strip()
    except OSError:
        return None


def _mib(n: float) -> str:
    return f"{n / MIB:,.1f} MiB" if n >= MIB else f"{n / 1024:,.0f} KiB"


def _buffer_findings(root: str | Path, bdp: float, rtt_s: float) -> list[dict[str, str]]:
    """A flow keeps at most half its autotuned buffer in flight (tcp_adv_win_scale = 1,
    as inter/data/transport/chunk_size.py's tcp_receive_window counts it), so each
    buffer maximum below 2 x the flow's bandwidth-delay product holds it back."""
    need = max(4 * MIB, int(2 * bdp + MIB - 1) // MIB * MIB)
    out: list[dict[str, str]] = []
    for name in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
        value = read_sysctl(root, name)
        fields = (value or "").split()
        if len(fields) == 3 and fields[2].isdigit() and int(fields[2]) < 2 * bdp:
            ceiling = int(fields[2]) / 2 * 8 / rtt_s / 1e9
            advice = (
                f"{name} max {_mib(int(fields[2]))} holds one flow to {ceiling:.3g} Gbit/s "
                f"at {rtt_s * 1e3:.0f} ms (a flow needs {_mib(2 * bdp)}): "
                f"sysctl -w {name}='{fields[0]} {fields[1]} {need}'"
            )
            out.append({"setting": name, "value": value or "", "advice": advice})
    for name in ("net.core.rmem_max", "net.core.wmem_max"):
        value = read_sysctl(root, name)
        if value is not None and value.isdigit() and int(value) < 2 * bdp:
            advice = (
                f"{name} {_mib(int(value))} caps a program that sets its socket buffer "
                f"(isthmus leaves them to autotuning; iperf -w does not): sysctl -w {name}={need}"
            )
            out.append({"setting": name, "value": value, "advice": advice})
    return out


def audit(links: list[dict[str, Any]], root: str | Path = "/proc/sys") -> list[dict[str, str]]:
    """This host's findings against ``links`` (measure_link's dicts): socket buffers
    against the largest per-flow bandwidth-delay product, the congestion control
    against loss, slow start after idle, MTU probing. Each: setting, value, advice."""
    if not links:
        return []
    # A flow's share of the link: the cap where the link has one, else all of it.
    bdps = [
        (link["per_flow_cap_gbit"] or link["gbit_nflows"]) * 1e9 / 8 * link["rtt_ms"] / 1e3
        for link in links
    ]
    worst = max(range(len(links)), key=bdps.__getitem__)
    out = _buffer_findings(root, bdps[worst], links[worst]["rtt_ms"] / 1e3)
    loss = max(link["loss"] for link in links)
    cc = read_sysctl(root, "net.ipv4.tcp_congestion_control")
    if cc is not None and cc != "bbr" and loss >= LOSSY:
        rtt = max(link["rtt_ms"] for link in links) / 1e3
        mathis = 1448 * 8 / rtt * 1.22 / loss**0.5 / 1e9  # Mathis et al. 1997
        advice = (
            f"{cc} backs off at every loss: at {loss:.2%} and {rtt * 1e3:.0f} ms one flow "
            f"gets ~{mathis:.2f} Gbit/s; bbr does not: modprobe tcp_bbr; "
            "sysctl -w net.ipv4.tcp_congestion_control=bbr"
        )
        out.append({"setting": "net.ipv4.tcp_congestion_control", "value": cc, "advice": advice})
    for name, bad, advice in (
        (
            "net.ipv4.tcp_slow_start_after_idle",
            "1",
            "a flow idle between rounds restarts from slow start (a window of 10 "
            "segments) every round: sysctl -w net.ipv4.tcp_slow_start_after_idle=0",
        ),
        (
            "net.ipv4.tcp_mtu_probing",
            "0",
            "a path that drops ICMP (a black hole below 1500 bytes) stalls large "
            "segments for good: sysctl -w net.ipv4.tcp_mtu_probing=1",
        ),
    ):
        if (value := read_sysctl(root, name)) == bad:
            out.append({"setting": name, "value": value, "advice": advice})
    return out
