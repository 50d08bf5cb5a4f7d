"""Fixtures of the emulator's tests."""

from __future__ import annotations

import pytest

from isthmus.sim import RelayServer


@pytest.fixture
def relay():
    """A relay with no links yet; its listeners and connections are closed after the test."""
    with RelayServer() as r:
        yield r


@pytest.fixture(params=[False, True], ids=["threads", "processes"])
def either_relay(request):
    """A test twice: each link direction pumped by a thread of the relay, and by a
    process of its own (`RelayServer(processes=True)`, sim/pump_process.py; a direction
    that resets then has the other direction's process reset too). test_relay.py's rate
    tests hold the thread mode to +-10 % only: with two more processes a direction, a
    2-core machine's load moved processes-mode rates by 25 %; benchmarks measure that
    mode's rates (docs/benchmarks/wan-emulator.md), test_wan_cli.py its rate limit, loosely."""
    with RelayServer(processes=request.param) as r:
        yield r
