"""Precise wake-ups for the relay's pumps: a timerfd polled with the sockets.

An asyncio loop wakes its timers on millisecond ticks (+0.5 ms per hop measured through
the old relay), so a link could not be shorter than ~2 ms. A pump thread instead arms a
timerfd (CLOCK_MONOTONIC, `time.monotonic()`'s clock) at its next release, polls it with
its sockets, and busy-polls the last `SPIN_S` (a timerfd with 1 ns slack wakes ~10 us
late on an idle machine; after a long wait longer: `spin_for`). Python 3.13 has
`os.timerfd_create`; before it, libc's is called through ctypes; without either,
`Timer.fd` is None and the pump falls back to poll's millisecond timeouts."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import math
import os
import select
import sys
import threading
import time

__all__ = ["IDLE_S", "IDLE_SPIN_S", "PUMP_NICE", "SPIN_S", "Timer", "precise_thread", "spin_for"]

SPIN_S = 50e-6
"""The last stretch before a release is waited with non-blocking polls (in seconds)."""
IDLE_S = 2e-3
IDLE_SPIN_S = 300e-6
"""The busy stretch after a wait longer than `IDLE_S`: a CPU idle that long wakes
slower (measured on a 2-core VM: a timerfd 70-100 us late after 5-50 ms, against
10 us after 0.3 ms), and at most one such wait per `IDLE_S` costs little CPU."""


def spin_for(delay_s: float) -> float:
    """How long to busy-poll at the end of a wait of `delay_s` seconds."""
    return IDLE_SPIN_S if delay_s > IDLE_S else SPIN_S


_CLOCK_MONOTONIC = 1
_TFD_TIMER_ABSTIME = 1
_PR_SET_TIMERSLACK = 29


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.timerfd_create  # noqa: B018 (raises AttributeError where there is none)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


PUMP_NICE = -10
"""Nice value of a pump thread where the process may raise its threads' priority
(root, CAP_SYS_NICE). An emulated link does not slow down when the machine's CPUs are
busy, as a real one does not: with other jobs on both cores of the dev machine, pumps
at the default priority woke 10-20 ms late (a 100 ms round trip measured 110-120 ms).
A pump uses CPU only while bytes move, so the others keep the rest."""


def precise_thread() -> None:
    """Give the calling thread 1 ns of timer slack (Linux's default is 50 us) and,
    where allowed, the priority `PUMP_NICE`."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
    with contextlib.suppress(OSError):  # not permitted: keep the default priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PUMP_NICE)


class Timer:
    """A timerfd on CLOCK_MONOTONIC: readable once the armed time has passed."""

    def __init__(self) -> None:
        self.fd: int | None = None
        # The version check lets mypy (pinned to 3.11) skip what 3.13 added to os.
        if sys.version_info >= (3, 13) and hasattr(os, "timerfd_create"):
            self.fd = os.timerfd_create(os.CLOCK_MONOTONIC, flags=os.TFD_NONBLOCK | os.TFD_CLOEXEC)
        elif _LIBC is not None:
            fd = _LIBC.timerfd_create(_CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
            self.fd = fd if fd >= 0 else None
        self._spec = _Itimerspec()

    def arm(self, at_s: float) -> None:
        """Fire at `at_s` (`time.monotonic()` seconds, absolute; > 0)."""
        if self.fd is None:
            return
        if sys.version_info >= (3, 13) and hasattr(os, "timerfd_settime_ns"):
            os.timerfd_settime_ns(self.fd, flags=os.TFD_TIMER_ABSTIME, initial=int(at_s * 1e9))
            return
        assert _LIBC is not None  # the fd came from libc's timerfd_create
        ns = int(at_s * 1e9)
        self._spec.it_value.tv_sec, self._spec.it_value.tv_nsec = divmod(ns, 1_000_000_000)
        _LIBC.timerfd_settime(self.fd, _TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None)

    def clear(self) -> None:
        """Consume an expiry, so that the fd polls as not readable again."""
        if self.fd is not None:
            with contextlib.suppress(BlockingIOError):
                os.read(self.fd, 8)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def wait(self, poller: select.poll, wake_at: float, precise: bool) -> list[tuple[int, int]]:
        """Poll (which holds this timer's fd) until an fd is ready or `wake_at`: this
        timer (~10-40 us late), then, if `precise`, a busy poll for the last 50-300 us
        (`spin_for`), so that a release is microseconds late, not a scheduler tick."""
        if wake_at == math.inf:
            return poller.poll()
        delay = wake_at - time.monotonic()
        spin = spin_for(delay) if precise else 0.0
        if delay > spin:
            if self.fd is not None:
                self.arm(wake_at - spin)
                events = poller.poll()
            else:
                events = poller.poll(max(0, int((delay - spin) * 1000)))
            if any(fd != self.fd for fd, _ in events):
                return events
            self.clear()
        while True:
            events = poller.poll(0)  # releases the GIL for the other threads
            if events or time.monotonic() >= wake_at:
                return events
