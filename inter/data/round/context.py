"""What one cross-site round is run under and reports: the rank's membership, the
round's view of it, its statistics, the flag that aborts it, and the errors it raises
(``round.py`` runs it)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from types import FrameType

import grpc

from isthmus.inter.data.codecs.chain import CodecChain

__all__ = [
    "POLL_S",
    "describe",
    "AbortSignal",
    "CrossSiteError",
    "EncodingFault",
    "Members",
    "ModelMismatch",
    "NonFiniteGradient",
    "PeerAborted",
    "RoundStats",
    "RoundView",
    "RunningTasks",
    "contribution_fault",
    "settle",
    "sum_fault",
]


POLL_S = 0.05
"""How often a waiting round looks for failed tasks, aborts and acknowledgements."""


class CrossSiteError(RuntimeError):
    """A cross-site round failed: a peer timed out, refused or sent bad data.

    ``stats`` holds what the round had counted when it failed (refused and corrupt
    chunks, bytes), so a failed attempt's refusals still reach the step's metrics."""

    stats: RoundStats | None = None


class EncodingFault(CrossSiteError):
    """A finite chunk came out of this site's encode as NaN or Inf: a bug, caught
    before the chunk left; the round fails, and running the step again may help."""


def contribution_fault(
    where: str, c: int, lo: int, hi: int, codec: str, why: object
) -> EncodingFault:
    """The error of a finite chunk whose contribution came out of the encode non-finite."""
    return EncodingFault(
        f"{where}: chunk {c} (elements {lo}..{hi}) is finite, but its contribution came "
        f"out of the {codec} encode non-finite ({why}); not sent"
    )


def sum_fault(
    where: str, c: int, lo: int, hi: int, cause: str, codec: str, why: object
) -> EncodingFault:
    """The error of a chunk's sum that overflowed, or whose encode is not finite."""
    return EncodingFault(
        f"{where}: the sum of chunk {c} (elements {lo}..{hi}) {cause} ({codec}: {why}); "
        "the result is not sent"
    )


def settle(tasks: list[futures.Future], deadline: float) -> None:
    """Waits until ``deadline`` for ``tasks`` to end. A task that ``shutdown(cancel_futures
    =True)`` cancelled is ``done()``, which ``futures.wait`` alone never counts."""
    while (left := [task for task in tasks if not task.done()]) and time.monotonic() < deadline:
        futures.wait(left, timeout=min(POLL_S, max(0.0, deadline - time.monotonic())))


class PeerAborted(CrossSiteError):
    """Another site gave this round up (``AbortRound``): its chunks will not come."""


class NonFiniteGradient(CrossSiteError):
    """This site's own gradient holds NaN or Inf: running the step again cannot help,
    and sending it would spread it to every site."""


class ModelMismatch(CrossSiteError):
    """A peer site's own chunk (asked again of the sender itself) holds another number
    of elements than this rank's gradient: the sites train different models, and
    running the step again cannot help. Before this, such a job retried its first step
    for ever with nothing on the console (issue 60)."""


class AbortSignal:
    """One flag with its reason: set to fail the running rounds at once (a member site
    fell silent, so waiting for it until the deadline is pointless)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def set(self, reason: str) -> None:
        """Raises the flag; the first reason stands."""
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def clear(self) -> None:
        self.reason = ""
        self._event.clear()


@dataclasses.dataclass(frozen=True, slots=True)
class Members:
    """A rank's membership of the job: one generation, replaced whole, never mutated.

    The rank's lane server holds the current one (it checks every incoming chunk
    against it); the all-reduce and its rounds read it from there, and only
    :class:`~isthmus.inter.data.sync.membership.SiteMembership` moves it to a new generation.
    """

    generation: int
    site_index: int  # this site's position among the members
    num_sites: int
    site_names: tuple[str, ...] | None = None
    """The members' names in order; with mutual TLS a chunk "from site i" is taken only
    from a certificate naming the i-th. None before a membership names them."""

    def __post_init__(self) -> None:
        if not 0 <= self.site_index < self.num_sites:
            raise ValueError(f"site_index must be in [0, {self.num_sites}), got {self.site_index}")
        if self.site_names is not None and len(self.site_names) != self.num_sites:
            raise ValueError(f"{len(self.site_names)} site names for {self.num_sites} sites")


@dataclasses.dataclass(frozen=True, slots=True)
class RoundView:
    """The membership and settings one round runs under; fixed for its life."""

    site_index: int
    num_sites: int
    generation: int
    codec: CodecChain
    chunk_bytes: int
    timeout_s: float

    def owner(self, chunk: int, step: int, group: int) -> int:
        """The site that reduces ``chunk`` of round (step, group): rotating with step
        and group spreads the owners' extra work."""
        return (chunk + step + group) % self.num_sites


@dataclasses.dataclass(slots=True)
class RoundStats:
    """What one ``allreduce`` call moved and how long it took."""

    bytes_sent: int = 0  # payload bytes this site sent (after encoding)
    bytes_received: int = 0  # payload bytes this site received and used
    raw_bytes: int = 0  # fp32 bytes of the chunks this site sent, before encoding
    tensor_bytes: int = 0  # fp32 bytes of the whole round's buffer
    num_chunks: int = 0
    corrupt_chunks: int = 0  # chunks that arrived failing a checksum and were pulled or sent again
    nonfinite_chunks: int = 0  # decoded to NaN or Inf: refused before summing, pulled again
    stalled_flows: int = 0
    """Connections that missed the deadline of one of this round's frames: left, their
    frames in flight sent again on new ones (each stall counted once)."""
    wall_s: float = 0.0
    encode_s: float = 0.0  # seconds spent encoding, summed over the pool's threads
    decode_s: float = 0.0  # seconds spent decoding, summed over the pool's threads


def describe(site: int, exc: BaseException) -> str:
    """One line for a failed call to ``site``."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        code = exc.code()
        kind = "timed out" if code == grpc.StatusCode.DEADLINE_EXCEEDED else "failed"
        return f"sending to site {site} {kind}: {code.name}: {exc.details()}"
    return f"sending to site {site} failed: {exc}"


def current_frames() -> dict[int, FrameType]:
    """``sys._current_frames()`` with the cyclic collector off. CPython 3.11 builds its
    dict under the runtime's lock of thread states; a collection that the dict's
    allocation starts there can run a gRPC object's finalizer, which waits for a gRPC
    thread that needs that very lock to take the GIL. The suite's main thread hung there
    for good once (CI, 2026-12-05: ``_PyThread_CurrentFrames`` > ``gc_collect_main`` >
    cygrpc > ``pthread_cond_timedwait``)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()


class RunningTasks:
    """The round's tasks running now, by thread: where a task that hangs is stuck.

    A failed round's warning names the innermost frames of each thread still in one
    (CI once saw two codec threads per site stuck in a first round, and nothing said
    where)."""

    _FRAMES = 3

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[int, str] = {}

    @contextlib.contextmanager
    def track(self, name: str) -> Iterator[None]:
        ident = threading.get_ident()
        with self._lock:
            self._running[ident] = name
        try:
            yield
        finally:
            with self._lock:
                self._running.pop(ident, None)

    def where(self) -> list[str]:
        """One line per running task: its name and its thread's innermost frames."""
        frames = current_frames()
        with self._lock:
            running = dict(self._running)
        lines = []
        for ident, name in running.items():
            frame = frames.get(ident)
            stack = traceback.extract_stack(frame)[-self._FRAMES :] if frame else []
            at = " < ".join(
                f"{s.name} ({Path(s.filename).name}:{s.lineno})" for s in reversed(stack)
            )
            lines.append(f"{name}: {at or 'ended'}")
        return lines
