"""Training state between sites as named tensors in pieces (docs/design.md invariant 3).

A rank of a live site *offers* its state after a step (:class:`StateOffers`, held by
its :class:`~isthmus.inter.data.lane.LaneServer`); the rank at the same mesh coordinate of
a joining site *pulls* it with ``PullState`` (:func:`pull_state`). Nothing is pickled:
each tensor travels as its dtype name, shape and raw little-endian bytes, in pieces
of at most :data:`PIECE_BYTES`, each with a crc32; the receiver checks every field
before it builds a tensor.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping

import grpc
import torch

from isthmus.inter.data.codec import crc32
from isthmus.proto import lane_pb2, lane_pb2_grpc

__all__ = ["PIECE_BYTES", "StateOffers", "StateTransferError", "pieces", "pull_state"]

PIECE_BYTES = 1 << 20
MAX_NAME_CHARS = 512
MAX_DIMS = 8
# The dtypes a training state holds; anything else is refused.
DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "bool")
}


class StateTransferError(RuntimeError):
    """A pulled state was refused: bad piece, missing bytes, or the peer failed."""


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"cannot send a tensor of dtype {dtype}")
    return name


def pieces(state: Mapping[str, torch.Tensor]) -> Iterator[lane_pb2.StatePiece]:
    """The pieces of ``state``, tensor by tensor in name order."""
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        dtype = _dtype_name(tensor.dtype)
        # A byte view, so bfloat16 and bool travel without a numpy round trip.
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        total = len(raw)
        offset = 0
        while True:
            data = raw[offset : offset + PIECE_BYTES]
            yield lane_pb2.StatePiece(
                name=name,
                dtype=dtype,
                shape=list(tensor.shape),
                offset=offset,
                total_bytes=total,
                data=data,
                crc32=crc32(data),
            )
            offset += len(data)
            if offset >= total:
                break


class _Assembly:
    """One tensor being put together from its pieces."""

    def __init__(self, piece: lane_pb2.StatePiece) -> None:
        self.dtype = DTYPES[piece.dtype]
        self.shape = tuple(int(d) for d in piece.shape)
        self.buffer = bytearray(piece.total_bytes)
        self.filled = 0


def _check(piece: lane_pb2.StatePiece, current: _Assembly | None, limit: int) -> str | None:
    if not 0 < len(piece.name) <= MAX_NAME_CHARS:
        return f"tensor name of {len(piece.name)} characters"
    if piece.dtype not in DTYPES:
        return f"{piece.name}: dtype {piece.dtype[:32]!r} is not one of {sorted(DTYPES)}"
    if len(piece.shape) > MAX_DIMS:
        return f"{piece.name}: {len(piece.shape)} dimensions (max {MAX_DIMS})"
    numel = 1
    for d in piece.shape:
        numel *= d
    itemsize = torch.empty((), dtype=DTYPES[piece.dtype]).element_size()
    if numel * itemsize != piece.total_bytes:
        return f"{piece.name}: {piece.total_bytes} bytes for shape {list(piece.shape)[:8]}"
    if piece.total_bytes > limit:
        return f"{piece.name}: a tensor of {piece.total_bytes} bytes; state larger than {limit}"
    if crc32(piece.data) != piece.crc32:
        return f"{piece.name}: crc32 mismatch at offset {piece.offset}"
    expected = current.filled if current is not None else 0
    if piece.offset != expected or piece.offset + len(piece.data) > piece.total_bytes:
        return f"{piece.name}: piece at offset {piece.offset}, expected {expected}"
    if not piece.data and piece.total_bytes:
        return f"{piece.name}: empty piece"
    if current is not None and (
        current.dtype != DTYPES[piece.dtype] or current.shape != tuple(piece.shape)
    ):
        return f"{piece.name}: dtype or shape changed between pieces"
    return None


def assemble(
    stream: Iterator[lane_pb2.StatePiece], max_total_bytes: int
) -> dict[str, torch.Tensor]:
    """Builds the named tensors of a piece stream, refusing anything malformed.

    Raises:
        StateTransferError: a piece failed a check, or a tensor was left incomplete.
    """
    out: dict[str, torch.Tensor] = {}
    name: str | None = None
    current: _Assembly | None = None
    total = 0

    def finish() -> None:
        assert name is not None and current is not None
        if current.filled != len(current.buffer):
            raise StateTransferError(f"{name}: {current.filled} of {len(current.buffer)} bytes")
        flat = torch.frombuffer(current.buffer, dtype=torch.uint8) if current.buffer else None
        out[name] = (
            flat.view(current.dtype).reshape(current.shape).clone()
            if flat is not None
            else torch.empty(current.shape, dtype=current.dtype)
        )

    for piece in stream:
        if piece.name != name:
            if current is not None:
                finish()
            if piece.name in out:
                raise StateTransferError(f"{piece.name[:64]}: sent twice")
            name, current = piece.name, None
        problem = _check(piece, current, max_total_bytes)
        if problem is not None:
            raise StateTransferError(problem)
        if current is None:
            total += piece.total_bytes
            if total > max_total_bytes:
                raise StateTransferError(f"state larger than {max_total_bytes} bytes")
            current = _Assembly(piece)
        current.buffer[piece.offset : piece.offset + len(piece.data)] = piece.data
        current.filled += len(piece.data)
    if current is not None:
        finish()
    return out


class StateOffers:
    """The states a rank offers to joiners, by (generation, step); thread-safe.

    Only the newest offer is kept: a joiner is admitted at one step boundary.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._offer: tuple[int, int, dict[str, torch.Tensor]] | None = None

    def offer(self, generation: int, step: int, state: Mapping[str, torch.Tensor]) -> None:
        """Offers ``state`` (CPU tensors, not modified afterwards) as the one after ``step``."""
        with self._cond:
            self._offer = (generation, step, dict(state))
            self._cond.notify_all()

    def wait(self, generation: int, step: int, timeout: float) -> dict[str, torch.Tensor] | None:
        """The state offered for (generation, step), waiting up to ``timeout``; else None."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._offer is not None and self._offer[:2] == (generation, step):
                    return self._offer[2]
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def clear(self) -> None:
        with self._cond:
            self._offer = None


def pull_state(
    stub: lane_pb2_grpc.LaneStub,
    *,
    generation: int,
    step: int,
    rank: int,
    timeout_s: float,
    max_total_bytes: int = 1 << 40,
) -> dict[str, torch.Tensor]:
    """Pulls the state after ``step`` from the serving rank's lane.

    Args:
        stub: a stub on the serving rank's lane (its proxy and TLS already set).
        generation: the generation this site was admitted in.
        step: the step whose state is wanted.
        rank: the serving rank (this rank's own number between sites of one size; the
            ranks holding its rows otherwise), which the lane checks.
        timeout_s: deadline of the whole stream.
        max_total_bytes: refuse a state larger than this.
    Raises:
        StateTransferError: the peer refused, failed or sent a malformed piece.
    """
    request = lane_pb2.PullStateRequest(generation=generation, step=step, rank=rank)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stream = stub.PullState(
                request, timeout=max(0.1, deadline - time.monotonic()), wait_for_ready=True
            )
            return assemble(stream, max_total_bytes)
        except grpc.RpcError as exc:
            # UNAVAILABLE: the serving rank is not in this generation yet (it moves
            # there when it lands the step that admitted this site); ask again.
            if exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline - 0.2:
                time.sleep(0.2)
                continue
            raise StateTransferError(
                f"pulling the state after step {step}: {exc.code().name}: {exc.details()}"
            ) from exc
