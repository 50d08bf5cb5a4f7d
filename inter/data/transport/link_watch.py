"""Each peer site's link as this lane's senders see it, read once a step (issue 61).

A :class:`Link` is one peer site's bulk connections (all its ranks'): each tells it when
its frames in flight go from none to some and back, so the link knows its time on the
wire (the union over its connections), and counts the frame bytes acknowledged to it. A
:meth:`LinkWatch.sample` reads each connection's ``TCP_INFO`` once (one ``getsockopt``),
off the rounds' path: what moved since the last sample, at what rate, the RTT, window and
retransmits. A gRPC lane has no sockets of its own: its figures are None, not guessed.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Protocol

from isthmus.inter.tcp_info import read_tcp_info

__all__ = ["Link", "LinkWatch"]


class Flow(Protocol):
    def watch(self) -> tuple[socket.socket | None, int, bool]:
        """Its TCP socket now (None while dialling), the frame bytes acknowledged on it
        over its life, and whether it is closed for good."""


class Link:
    """One peer site's connections from this lane (see the module docstring)."""

    def __init__(self) -> None:
        self.transport = "bulk"  # LanePeer says "grpc" for a lane without sockets
        self._lock = threading.Lock()
        self._flows: dict[int, tuple[Flow, object, int, int]] = {}
        """By id: the flow, and at the last sample its socket, retransmits and bytes."""
        self._busy = 0  # connections with frames in flight
        self._since = 0.0
        self._wire_s = 0.0  # time with frames in flight, up to ``_since`` when busy
        self._sampled_wire_s = 0.0

    def add(self, flow: Flow) -> None:
        with self._lock:
            self._flows[id(flow)] = (flow, None, 0, 0)

    def wire(self, busy: bool) -> None:
        """A connection's frames in flight went from none to some (``busy``) or back."""
        now = time.monotonic()
        with self._lock:
            if busy:
                self._since = now if self._busy == 0 else self._since
                self._busy += 1
                return
            self._busy -= 1
            if self._busy == 0:
                self._wire_s += now - self._since

    def sample(self) -> dict:
        """What the link did since the last sample (units in the keys' names; None where
        the transport has no sockets, or no bytes moved)."""
        if self.transport != "bulk":
            return dict.fromkeys(_KEYS, None) | {"transport": self.transport}
        with self._lock:
            flows = list(self._flows.values())
            now = time.monotonic()
            wire_total = self._wire_s + (now - self._since if self._busy else 0.0)
            wire_s, self._sampled_wire_s = wire_total - self._sampled_wire_s, wire_total
        per_flow = []
        for flow, last_sock, last_retrans, last_bytes in flows:
            sock, acked, closed = flow.watch()
            info = read_tcp_info(sock) if sock is not None else None
            retrans = last_retrans if info is None else info.total_retrans
            moved: dict[str, float | None] = {"bytes": acked - last_bytes, "retrans": None}
            if info is not None:
                since = last_retrans if sock is last_sock else 0  # a new connection: all
                moved |= {
                    "rtt_ms": info.rtt_us / 1e3,
                    "min_rtt_ms": info.min_rtt_us / 1e3,
                    "cwnd_bytes": info.cwnd_bytes,
                    "retrans": info.total_retrans - since,
                }
            per_flow.append(moved)
            with self._lock:
                if closed:
                    self._flows.pop(id(flow), None)
                else:
                    self._flows[id(flow)] = (flow, sock, retrans, acked)
        return _link_figures(per_flow, wire_s)


_KEYS: tuple[str, ...] = ("transport", "flows", "bytes", "wire_s", "gbit_s", "rtt_ms")
_KEYS += ("min_rtt_ms", "cwnd_bytes", "retrans", "per_flow")


def _link_figures(per_flow: list[dict], wire_s: float) -> dict:
    """A link's figures from its flows': bytes, window and retransmits add up; the RTT is
    the flows' mean, the min RTT their least."""
    read = [f for f in per_flow if "rtt_ms" in f]
    moved = sum(f["bytes"] for f in per_flow)
    return {
        "transport": "bulk",
        "flows": len(per_flow),
        "bytes": moved,
        "wire_s": wire_s,
        "gbit_s": moved * 8 / wire_s / 1e9 if wire_s > 0 and moved else None,
        "rtt_ms": sum(f["rtt_ms"] for f in read) / len(read) if read else None,
        "min_rtt_ms": min((f["min_rtt_ms"] for f in read), default=None),
        "cwnd_bytes": sum(f["cwnd_bytes"] for f in read) if read else None,
        "retrans": sum(f["retrans"] for f in read) if read else None,
        "per_flow": per_flow,
    }


class LinkWatch:
    """A lane's links, one per peer site: the lane's peers hand their connections to
    :meth:`link`, and the rank reads :meth:`sample` once a step."""

    def __init__(self) -> None:
        self._links: dict[str, Link] = {}
        self._lock = threading.Lock()

    def link(self, site: str) -> Link:
        with self._lock:
            return self._links.setdefault(site, Link())

    def sample(self, sites: list[str]) -> dict[str, dict]:
        """Each of ``sites``' links since the last sample (a site this lane never sent
        to: none); links to other sites are forgotten."""
        with self._lock:
            self._links = {s: link for s, link in self._links.items() if s in sites}
            links = dict(self._links)
        return {site: links[site].sample() for site in sites if site in links}
