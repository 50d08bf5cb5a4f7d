"""Wake a coordinator's long polls only with the news each one waits for.

A coordinator holds two long polls per rank of its site (a vote and a membership
watcher's poll), each a thread of the gRPC server. Waiting on the state's one condition
woke all 2N of them on every transition and heartbeat, each re-taking the lock to find
nothing new: a herd that filled the GIL at 1,024 ranks (docs/benchmarks/control-plane.md,
"The control plane at scale"). Here a vote waits for the decision on its own (step,
generation) and a watcher for a change of the membership; the few other waiters (the
failover loop, ``wait_ready``) keep the condition.

Both are published with the state's condition held, and a waiter takes its
:class:`threading.Event` under that condition before releasing it: news published after
its check sets the event it holds, so none is lost.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["Broadcast", "KeyedWakeups"]

K = TypeVar("K", bound=Hashable)


class Broadcast:
    """News anyone may wait for: :meth:`publish` wakes those who took :meth:`event`
    before it, once, and later takers wait for the next news."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def event(self) -> threading.Event:
        """The event the next :meth:`publish` sets (take it with the guarding lock held)."""
        return self._event

    def publish(self) -> None:
        """Wakes everyone holding the current event; the next takers get a fresh one."""
        event, self._event = self._event, threading.Event()
        event.set()


class KeyedWakeups(Generic[K]):
    """One event per key that someone waits on: :meth:`publish` wakes the waiters of
    one key only. Guarded by the caller's lock (no lock of its own)."""

    def __init__(self) -> None:
        self._events: dict[K, threading.Event] = {}

    def event(self, key: K) -> threading.Event:
        """The event :meth:`publish` of ``key`` sets."""
        event = self._events.get(key)
        if event is None:
            event = self._events[key] = threading.Event()
        return event

    def publish(self, key: K) -> None:
        """Wakes the waiters of ``key`` (a later waiter of it takes a fresh event)."""
        event = self._events.pop(key, None)
        if event is not None:
            event.set()

    def publish_all(self, which: Callable[[K], bool] | None = None) -> None:
        """Wakes the waiters of every key, or of the keys ``which`` accepts (news that
        concerns them all: a stop, a readmission; or keys too old to be kept)."""
        for key in [k for k in self._events if which is None or which(k)]:
            self._events.pop(key).set()

    def __len__(self) -> int:
        return len(self._events)
