"""Fixtures of the emulator's tests."""

from __future__ import annotations

import pytest

from isthmus.sim import RelayServer


@pytest.fixture
def relay():
    """A relay with no links yet; its listeners and connections are closed after the test."""
    with RelayServer() as r:
        yield r
