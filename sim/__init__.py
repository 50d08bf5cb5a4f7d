"""WAN simulator: emulated long-haul links, their impairments and topologies."""

from .control import ControlServer, control_request
from .impairments import KINDS, Corrupt, Flap, FlowStall, Impairment, Jitter, Loss, Reset, Slice
from .link import DirectionPipe
from .relay import Link, RelayServer, is_loopback, proxy_channel_options
from .spec import DirectionSpec, LinkSpec
from .topology import Topology, TopologyLink, load_topology, topology_links

__all__ = [
    "KINDS",
    "ControlServer",
    "Corrupt",
    "DirectionPipe",
    "DirectionSpec",
    "Flap",
    "FlowStall",
    "Impairment",
    "Jitter",
    "Link",
    "LinkSpec",
    "Loss",
    "RelayServer",
    "Reset",
    "Slice",
    "Topology",
    "TopologyLink",
    "control_request",
    "is_loopback",
    "load_topology",
    "proxy_channel_options",
    "topology_links",
]
