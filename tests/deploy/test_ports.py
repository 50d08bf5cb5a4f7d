"""Ports named ahead of their listeners (deploy/chaos/ports.py): free, distinct, and out
of the kernel's ephemeral range, where no bind(0) or outgoing connect can take them
between the choice and the bind."""

import random
import socket

from isthmus.deploy.chaos import ports
from isthmus.deploy.chaos.ports import free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low, _ = ports.ephemeral_range()
    chosen = free_ports(8)
    assert len(set(chosen)) == 8
    assert all(ports.LOWEST_PORT <= p < low for p in chosen)
    listeners = []
    try:
        for port in chosen:  # each one takes a listener on every address at once
            s = socket.socket()
            listeners.append(s)
            s.bind(("", port))
            s.listen()
    finally:
        for s in listeners:
            s.close()


def test_a_port_something_listens_on_is_passed_over(monkeypatch):
    low, _ = ports.ephemeral_range()
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    port = free_ports(1)[0]
    held.bind(("127.0.0.1", port))  # one address only: the probe binds them all
    held.listen()
    sample = random.sample

    def held_first(population, k):
        return [port, *(p for p in sample(population, k) if p != port)]

    monkeypatch.setattr(ports.random, "sample", held_first)
    try:
        assert port not in free_ports(3)
    finally:
        held.close()


def test_a_range_with_no_room_below_falls_back_to_the_kernels_choice(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST_PORT + 10, 60999))
    chosen = free_ports(2)
    assert len(set(chosen)) == 2 and all(p > 0 for p in chosen)
