"""The lane's calls besides the chunk stream and the hand-offs: a member site giving a
round up (``AbortRound``) and a joining rank pulling the training state (``PullState``).

``LaneServer`` (:mod:`isthmus.inter.data.lane`) routes them here; both only read and
note, and what they hold (a PullState waits up to :data:`OFFER_WAIT_S` for the state
it names) is bounded by the server's slots.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from isthmus.inter.data.state_transfer import pieces
from isthmus.proto import lane_pb2

if TYPE_CHECKING:
    from isthmus.inter.data.lane import LaneServer

__all__ = ["OFFER_WAIT_S", "LaneRequests"]

log = logging.getLogger(__name__)

OFFER_WAIT_S = 60.0
"""How long a PullState waits for the state of the step it names."""


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
        """Streams this rank's training state after ``request.step`` to a joining rank
        (at most ``lane.PULL_STATE_WAITS`` at once; more get RESOURCE_EXHAUSTED, logged)."""
        server = self._server
        server.pulls.hold_for_stream(context)
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
        state = server.offers.wait(request.generation, request.step, server.offer_wait_s)
        if state is None:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"site {server.site_index} rank {server.rank} offers no state after step "
                f"{request.step} in generation {request.generation}",
            )
        assert state is not None  # context.abort raised
        log.info(
            "[site %d rank %d] serving the state after step %d",
            server.site_index,
            server.rank,
            request.step,
        )
        yield from pieces(state)
