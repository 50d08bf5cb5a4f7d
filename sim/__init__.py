"""WAN simulator: emulated long-haul links."""

from .link import DirectionPipe, DirectionSpec, LinkSpec
from .relay import Link, RelayServer, is_loopback, proxy_channel_options

__all__ = [
    "DirectionPipe",
    "DirectionSpec",
    "Link",
    "LinkSpec",
    "RelayServer",
    "is_loopback",
    "proxy_channel_options",
]
