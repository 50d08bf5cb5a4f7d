"""A round's calls back to its peers: a chunk asked again of its sender until it comes
intact (the resend path), and the word that this site gave a round up.

A receiver that got a chunk damaged on the way (its checksum failed) or one that
decodes to NaN pulls it from the sender: ``ResendChunk`` names the chunk and a nonce,
and the sender hands the chunk to this lane (``DeliverChunk``, with the nonce) before
it answers, so the copy comes from the lane the chunk was first sent to, never from
the caller. Kept apart from pipeline.py, which only calls it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import grpc

from isthmus.inter.data.lane.mailbox import Handoffs, MailboxKey
from isthmus.inter.data.round.context import POLL_S, CrossSiteError, RoundView, describe
from isthmus.inter.data.transport.wire import Chunk
from isthmus.proto import lane_pb2

if TYPE_CHECKING:
    from isthmus.inter.data.lane.peer import LanePeer
    from isthmus.inter.data.transport.peer_round import PeerRound

__all__ = ["pull_intact", "tell_peers_abort", "wait_acks"]

log = logging.getLogger("isthmus.round")

_FETCH_TIMEOUT_S = 10.0  # one ResendChunk call; the round's deadline bounds retries
_ABORT_TIMEOUT_S = 5.0  # one AbortRound call, sent without waiting for its answer


def tell_peers_abort(
    peers: dict[int, LanePeer], view: RoundView, step: int, group: int, reason: str
) -> None:
    """Tells every peer of the round that this site gave it up, so that none waits for
    chunks that will not come until its deadline (issue 38: a refused chunk cost the
    sender's site 120 s)."""
    ask = lane_pb2.AbortRoundRequest(
        generation=view.generation,
        step=step,
        group=group,
        from_site=view.site_index,
        reason=reason[:512],
    )
    for peer in peers.values():
        try:
            peer.abort_round(ask, _ABORT_TIMEOUT_S)
        except Exception:  # noqa: BLE001 (best effort: the peer's deadline remains)
            log.debug("site %d step %d group %d: could not send AbortRound",
                      view.site_index, step, group, exc_info=True)  # fmt: skip


def pull_intact(
    key: MailboxKey,
    *,
    peer: LanePeer,
    handoffs: Handoffs,
    check: Callable[[Chunk], str | None],
    generation: int,
    site_index: int,
    deadline: float,
    failed: threading.Event,
    where: str,
    on_corrupt: Callable[[], None],
) -> Chunk | None:
    """The chunk ``key`` from ``peer`` (its sender), asked again until it passes
    ``check``; None if ``failed`` is set meanwhile. CrossSiteError when the deadline
    passed, the sender failed the call, or the chunk came back wrong other than by its
    checksum."""
    step, group, kind, c, sender = key
    while not failed.is_set():
        ask = lane_pb2.ResendChunkRequest(
            generation=generation,
            step=step,
            group=group,
            kind=kind,
            chunk_index=c,
            from_site=site_index,
            nonce=handoffs.expect(("chunk", key)),
        )
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CrossSiteError(f"{where}: chunk {c} from site {sender} never came intact")
        try:
            peer.fetch(ask, min(_FETCH_TIMEOUT_S, remaining))
        except grpc.RpcError as exc:
            handoffs.collect(ask.nonce, 0.0)  # forget the nonce
            raise CrossSiteError(f"{where}: pulling chunk {c}: {describe(sender, exc)}") from exc
        chunk = cast("Chunk | None", handoffs.collect(ask.nonce, 0.0))
        if chunk is None:
            raise CrossSiteError(
                f"{where}: site {sender} answered for chunk {c} but never handed it over"
            )
        problem = check(chunk)  # the key matched the nonce's (take_delivery)
        if problem is None:
            return chunk
        if not problem.startswith("crc32 mismatch"):
            raise CrossSiteError(f"{where}: pulled chunk {c}: {problem}")
        on_corrupt()  # corrupt again on the way back: ask again
    return None


def wait_acks(
    site: int,
    rnd: PeerRound,
    deadline: float,
    raise_failures: Callable[[], None],
    where: str,
) -> None:
    """Waits until ``site`` acknowledged every chunk the round sent it, calling
    ``raise_failures`` between waits (an abort ends the wait for a silent peer).
    CrossSiteError when the deadline passed, the connection broke, or the peer took
    fewer chunks than were sent."""
    while True:
        raise_failures()
        left = deadline - time.monotonic()
        try:
            took = rnd.wait(max(0.0, min(POLL_S * 4, left)))
            break
        except TimeoutError as exc:
            if left <= POLL_S * 4:
                raise CrossSiteError(f"{where}: site {site} did not acknowledge in time") from exc
        except (grpc.RpcError, OSError) as exc:  # OSError: a bulk connection broke
            raise CrossSiteError(f"{where}: {describe(site, exc)}") from exc
    if took != rnd.sent:
        raise CrossSiteError(f"{where}: site {site} took {took} of {rnd.sent} chunks")
