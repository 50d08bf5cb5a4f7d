"""WAN simulator: emulated long-haul links."""
