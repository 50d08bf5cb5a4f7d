"""A chunk asked again of its sender until it comes intact (a round's resend path).

A receiver that got a chunk damaged on the way (its checksum failed) or one that
decodes to NaN pulls it from the sender: ``ResendChunk`` names the chunk and a nonce,
and the sender hands the chunk to this lane (``DeliverChunk``, with the nonce) before
it answers, so the copy comes from the lane the chunk was first sent to, never from
the caller. Kept apart from round.py, whose pipeline only calls it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import grpc

from isthmus.inter.data.lane_handoff import Handoffs
from isthmus.inter.data.mailbox import MailboxKey
from isthmus.inter.data.round_types import CrossSiteError, describe
from isthmus.inter.data.wire import Chunk
from isthmus.proto import lane_pb2

if TYPE_CHECKING:
    from isthmus.inter.data.lane_peer import LanePeer

__all__ = ["pull_intact"]

_FETCH_TIMEOUT_S = 10.0  # one ResendChunk call; the round's deadline bounds retries


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
    ``check``; None if ``failed`` is set meanwhile.

    Raises:
        CrossSiteError: the deadline passed, the sender failed the call, or the chunk
            came back wrong other than by its checksum.
    """
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
