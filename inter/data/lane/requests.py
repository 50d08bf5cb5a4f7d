"""The lane's calls besides the chunk stream and the hand-offs: a member site giving a
round up (``AbortRound``) and a joining rank pulling the training state (``PullState``).

``LaneServer`` (:mod:`isthmus.inter.data.lane.server`) routes them here. ``AbortRound`` only
notes. ``PullState`` streams the state this rank offers (inter/data/state/transfer.py) to
a rank of a site the commit admitted, once, and to no one else (issue 63: the state
offered at a rejoin stayed served to any token holder, and a holder could take both
pull slots). A pull waits for nothing: a state not offered yet is answered UNAVAILABLE
at once, and the joining rank asks again. Before a byte goes out the pull is checked
with the asking rank's own lane, at the address the commit names (``ConfirmPull``); the
asking site's share of the slots (:data:`PULL_STATE_SHARE`) is held only for that check
and the stream.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from isthmus.inter.data.lane.handoff import NONCE_BYTES
from isthmus.inter.data.state.transfer import pieces
from isthmus.inter.security import refuse_unless_named
from isthmus.proto import lane_pb2

if TYPE_CHECKING:
    from isthmus.inter.data.lane.server import LaneServer

__all__ = ["CONFIRM_TIMEOUT_S", "LaneRequests"]

log = logging.getLogger(__name__)

CONFIRM_TIMEOUT_S = 10.0
"""How long asking a joining rank's lane to confirm its pull may take."""


class LaneRequests:
    """``AbortRound`` and ``PullState`` of one lane."""

    def __init__(self, server: LaneServer) -> None:
        self._server = server

    def abort_round(
        self, request: lane_pb2.AbortRoundRequest, context: grpc.ServicerContext
    ) -> lane_pb2.AbortRoundResponse:
        """Notes that a member site gave up a round of this generation: this rank's
        part of it fails at once (``RoundPipeline``) instead of at its deadline."""
        server = self._server
        server.refuse_unless_sender(context, request.from_site, "AbortRound")
        members = server.members
        if request.generation != members.generation:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"site {members.site_index}: generation {request.generation} != "
                f"{members.generation}",
            )
        if request.from_site >= members.num_sites or request.from_site == members.site_index:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"from_site {request.from_site} is not another member of {members.num_sites} sites",
            )
        refused = server.mailbox.note_abort(
            request.step, request.group, request.from_site, request.reason
        )
        if refused is not None:
            server.refusals.note(
                context.peer(),
                f"AbortRound of step {request.step} group {request.group}: {refused}",
            )
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"site {members.site_index} did not note the abort: {refused}",
            )
        return lane_pb2.AbortRoundResponse()

    def pull_state(
        self, request: lane_pb2.PullStateRequest, context: grpc.ServicerContext
    ) -> Iterator[lane_pb2.StatePiece]:
        """Streams this rank's training state after ``request.step`` to the rank of an
        admitted site that asked for it, once (see the module docstring)."""
        server = self._server
        generation = server.generation
        if request.generation > generation:
            # Admitted by a round voted ahead: this rank moves there when it lands it.
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"site {server.site_index} is in generation {generation}, not yet "
                f"{request.generation}: ask again",
            )
        if request.generation != generation:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"site {server.site_index}: generation {request.generation} != {generation}",
            )
        if request.rank != server.rank:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rank {request.rank} asked the lane of rank {server.rank}: pull from your "
                "own mesh coordinate",
            )
        if len(request.nonce) != NONCE_BYTES:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"nonce of {len(request.nonce)} bytes, not {NONCE_BYTES}",
            )
        offers, where = server.offers, f"site {server.site_index} rank {server.rank}"
        offer = offers.find(request.generation, request.step)
        if offer is None:
            if offers.gone(request.generation, request.step):
                context.abort(
                    grpc.StatusCode.NOT_FOUND,
                    f"{where} offers the state after step {request.step} no more: pulled "
                    "by every rank it was offered to, or its deadline passed",
                )
            # Not offered yet (it is, after the step that admitted the joiner): the
            # joining rank asks again. Nothing is held while it waits.
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{where} offers no state after step {request.step} in generation "
                f"{request.generation} yet: ask again",
            )
        assert offer is not None  # context.abort raised
        site, rank = request.site, request.from_rank
        what = f"PullState in {site[:64]!r}'s name (rank {rank})"
        refused = offer.admitted.refusal(site, rank)
        if refused is not None:
            server.refusals.note(context.peer(), f"{what}: {refused[1]}")
            context.abort(refused[0], f"{where}: {refused[1]}")
        # With TLS the certificate must name the site; without, the check below.
        refuse_unless_named(server.security, context, server.where, site, "PullState")
        # The asking site's share of the slots, for the check and the stream only.
        server.pulls.hold_for_stream(context, site, PULL_STATE_SHARE)
        ask = lane_pb2.ConfirmPullRequest(
            nonce=request.nonce,
            generation=request.generation,
            step=request.step,
            rank=server.rank,
            source=offer.admitted.source,
        )
        try:
            offer.admitted.confirm(site, rank, ask, _budget(context))
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code == grpc.StatusCode.PERMISSION_DENIED:
                server.refusals.note(context.peer(), f"{what} that the rank did not ask for")
                context.abort(
                    grpc.StatusCode.PERMISSION_DENIED, f"{where}: {what}: the rank did not ask"
                )
            details = exc.details() if hasattr(exc, "details") else str(exc)
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{where}: could not ask {site} rank {rank}'s lane to confirm the pull: "
                f"{getattr(code, 'name', code)}: {details}",
            )
        why = offers.begin(offer, site, rank)
        if why is not None:
            server.refusals.note(context.peer(), f"{what}: {why}")
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{where}: {why}")
        context.add_callback(lambda: offers.end(offer, site, rank, complete=False))
        log.info(
            "[site %d rank %d] serving the state after step %d to %s rank %d",
            server.site_index,
            server.rank,
            request.step,
            site,
            rank,
        )
        complete = False
        try:
            yield from pieces(offer.state)
            complete = True
        finally:
            offers.end(offer, site, rank, complete=complete)


PULL_STATE_SHARE = 2
"""``PullState`` calls one asking site holds at once (its ranks between sites of
another size may pull from this one rank; a rank pulls once at a time)."""


def _budget(context: grpc.ServicerContext) -> float:
    """Seconds the check with the joining rank's lane may take: the caller's deadline,
    less a margin for the answer."""
    left = context.time_remaining()
    if left is None:
        return CONFIRM_TIMEOUT_S
    return max(0.001, min(CONFIRM_TIMEOUT_S, left - 0.2))
