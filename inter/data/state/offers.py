"""The state a live rank offers a joining site's ranks after the step that admitted them
(issue 63): for the admitted sites' ranks only, once each, each pull confirmed by the
joining rank's own lane, dropped after the pulls or at a deadline (see transfer.py)."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping

import grpc
import torch

from isthmus.proto import lane_pb2

__all__ = ["Admitted", "Confirm", "Offer", "StateOffers"]

Confirm = Callable[[str, int, lane_pb2.ConfirmPullRequest, float], None]
"""``confirm(site, rank, request, timeout_s)`` asks the lane of ``rank`` of admitted
``site``, at the address the admitting commit names (through the link's proxy), whether
it made ``request.nonce`` for this pull; returns if it did, raises ``grpc.RpcError``
otherwise (PERMISSION_DENIED: it did not, the pull was forged)."""

_GONE_KEPT = 8  # (generation, step) of offers dropped, remembered to say so


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Admitted:
    """Who may pull an offered state: the sites a commit admitted, one pull a rank."""

    source: str  # this site's name (the joiner's lane checks that it asked this site)
    ranks: int  # this site's rank count
    rank: int  # the offering rank
    joiners: Mapping[str, int]  # each site the commit admitted, with its rank count
    confirm: Confirm  # how a pull's nonce is checked with the asking rank's own lane

    def pullers(self) -> set[tuple[str, int]]:
        """The (site, rank) pairs the offer waits for. Between sites of one size, a
        joining rank pulls from its own mesh coordinate only; from a site of another
        size any rank of the joiner may need rows of this one (``source_shards``)."""
        return {
            (site, r)
            for site, n in self.joiners.items()
            for r in ([self.rank] if n == self.ranks else range(n))
        }

    def refusal(self, site: str, rank: int) -> tuple[grpc.StatusCode, str] | None:
        """Why rank ``rank`` of ``site`` may not pull this offer (a code and a line), or
        None."""
        count = self.joiners.get(site)
        if count is None:
            admitted = ", ".join(sorted(self.joiners)) or "no site"
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                f"the state is offered to {admitted}, not to {site[:64]!r}",
            )
        if rank >= count:
            return grpc.StatusCode.INVALID_ARGUMENT, f"{site} has {count} ranks, not {rank + 1}"
        if count == self.ranks and rank != self.rank:
            return (
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rank {rank} of {site} asked the lane of rank {self.rank}: pull from your "
                "own mesh coordinate",
            )
        return None


@dataclasses.dataclass(slots=True)
class Offer:
    """One offered state and who has pulled it (changed under ``StateOffers``' lock)."""

    generation: int
    step: int
    state: dict[str, torch.Tensor]
    admitted: Admitted
    deadline: float  # when the offer is dropped, pulled or not (on the offers' clock)
    waiting: set[tuple[str, int]]  # the (site, rank) pairs that have not pulled it yet
    serving: set[tuple[str, int]] = dataclasses.field(default_factory=set)
    """The pairs being served now (a second pull of one is refused meanwhile)."""


class StateOffers:
    """The state a rank offers to the sites a commit admitted; thread-safe.

    Only the newest offer is kept: a joiner is admitted at one step boundary. It is
    dropped once each rank it waits for has pulled it, or at its deadline (``clock``).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._offer: Offer | None = None
        self._timer: threading.Timer | None = None
        self._gone: collections.deque[tuple[int, int]] = collections.deque(maxlen=_GONE_KEPT)

    def offer(
        self,
        generation: int,
        step: int,
        state: Mapping[str, torch.Tensor],
        admitted: Admitted,
        ttl_s: float,
    ) -> None:
        """Offers ``state`` (CPU tensors, not modified afterwards) as the one after
        ``step`` to the ranks of ``admitted``'s sites, for ``ttl_s`` seconds at most."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        offer = Offer(
            generation,
            step,
            dict(state),
            admitted,
            deadline=self._clock() + ttl_s,
            waiting=admitted.pullers(),
        )
        timer = threading.Timer(ttl_s, self.expire)
        timer.daemon = True
        with self._lock:
            self._drop_locked()
            self._offer, self._timer = offer, timer
        timer.start()

    def find(self, generation: int, step: int) -> Offer | None:
        """The live offer of the state after ``step`` in ``generation``, or None."""
        with self._lock:
            self._expire_locked()
            offer = self._offer
            if offer is None or (offer.generation, offer.step) != (generation, step):
                return None
            return offer

    def gone(self, generation: int, step: int) -> bool:
        """Whether the state after ``step`` in ``generation`` was offered and dropped
        (every rank pulled it, or its deadline passed)."""
        with self._lock:
            self._expire_locked()
            return (generation, step) in self._gone

    def begin(self, offer: Offer, site: str, rank: int) -> str | None:
        """Rank ``rank`` of ``site`` (confirmed) starts its pull of ``offer``; why not,
        or None."""
        key = (site, rank)
        with self._lock:
            if self._offer is not offer:
                return f"the state after step {offer.step} is no longer offered"
            if key in offer.serving:
                return f"the state after step {offer.step} is being served to {site} rank {rank}"
            if key not in offer.waiting:
                return f"the state after step {offer.step} was served to {site} rank {rank}"
            offer.serving.add(key)
            return None

    def end(self, offer: Offer, site: str, rank: int, *, complete: bool) -> None:
        """The pull :meth:`begin` started ended (``complete``: every piece went out);
        the offer is dropped once no rank it waits for is left. Idempotent."""
        key = (site, rank)
        with self._lock:
            if key not in offer.serving:
                return
            offer.serving.discard(key)
            if complete:
                offer.waiting.discard(key)
                if not offer.waiting and self._offer is offer:
                    self._drop_locked()

    def expire(self) -> None:
        with self._lock:
            self._expire_locked()

    def clear(self) -> None:
        with self._lock:
            self._drop_locked()

    @property
    def current(self) -> Offer | None:
        """The offer kept now (dropped ones are not), for tests and reports."""
        with self._lock:
            return self._offer

    def _expire_locked(self) -> None:
        if self._offer is not None and self._clock() >= self._offer.deadline:
            self._drop_locked()

    def _drop_locked(self) -> None:
        if self._offer is not None:
            self._gone.append((self._offer.generation, self._offer.step))
        self._offer = None  # a pull in flight keeps its own reference until it ends
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
