"""Training state between sites as named tensors in pieces (docs/design.md invariant 3).

A rank of a live site *offers* its state after a step (:class:`.offers.StateOffers`,
held by its lane server); the rank at the same mesh coordinate of a joining site
*pulls* it with ``PullState`` (:func:`pull_state`). Nothing is pickled:
each tensor travels as its dtype name, shape and raw little-endian bytes, in pieces
of at most :data:`PIECE_BYTES`, each with a crc32; the receiver checks every field
before it builds a tensor.

An offer is for the sites the commit admitted (``state_offers.Admitted``) and no one else: the
weights, optimizer state and RNG of a site once stayed served to any token holder, 70
steps after the rejoin they were offered for (issue 63). Each rank of an admitted site
pulls it once: the serving lane asks that rank's own lane, at the address the commit
names, whether it made the request's nonce (``ConfirmPull``, inter/data/lane/requests.py),
and under TLS the caller's certificate must name the site. The offer is dropped once
every rank it waits for has pulled it, or at its deadline.

The puller, not the source, sets what a pull may allocate (:class:`ExpectedState`): it
built the same model and optimizer, so it knows each tensor's name, dtype and shape, and
a piece that claims anything else is refused before its tensor is allocated.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping

import grpc
import torch

from isthmus.inter.data.codecs.chain import crc32
from isthmus.proto import lane_pb2, lane_pb2_grpc

__all__ = ["PIECE_BYTES", "ExpectedState", "StateTransferError", "pieces", "pull_state"]

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


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel * torch.empty((), dtype=dtype).element_size()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExpectedState:
    """What a pulling rank expects, known before it asks: the first piece of each tensor
    is checked against it before the tensor is allocated, so the source does not set the
    puller's memory (issue 63: one 4-byte piece claiming ``shape=[2**32]`` made the
    joiner allocate 16 GiB at once, under a cap of 1 TiB).
    """

    tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    """Name -> (shape, dtype) of each tensor expected as it is (``expected_layout``)."""
    open_prefix: str | None = None
    """Names under this prefix may take any dtype and shape (what the puller cannot
    know exactly: the codec residuals the source's lane made); None: no name is open,
    "": every name is (a bare byte cap)."""
    open_bytes: int = 0  # bytes all tensors under ``open_prefix`` may take together

    @property
    def max_total_bytes(self) -> int:
        return sum(_nbytes(shape, dtype) for shape, dtype in self.tensors.values()) + (
            self.open_bytes if self.open_prefix is not None else 0
        )

    def is_open(self, name: str) -> bool:
        """Whether ``name`` is under the open prefix (any dtype and shape)."""
        return (
            self.open_prefix is not None
            and name not in self.tensors
            and name.startswith(self.open_prefix)
        )

    def refusal(self, piece: lane_pb2.StatePiece) -> str | None:
        """Why the first piece of a tensor claims one this rank does not expect, or None
        (the piece's own fields were checked already)."""
        name = piece.name[:80]
        if self.is_open(piece.name):
            return None
        want = self.tensors.get(piece.name)
        if want is None:
            return f"{name!r} claimed ({piece.total_bytes} bytes): this rank holds no such tensor"
        shape, dtype = want
        claimed = (tuple(int(d) for d in piece.shape), DTYPES[piece.dtype])
        if claimed != (shape, dtype):
            return (
                f"{name}: claimed {_dtype_name(claimed[1])} {list(claimed[0])[:MAX_DIMS]} "
                f"({piece.total_bytes} bytes), expected {str(dtype).removeprefix('torch.')} "
                f"{list(shape)} ({_nbytes(shape, dtype)} bytes)"
            )
        return None


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


class Assembly:
    """One tensor being put together from its pieces."""

    def __init__(self, piece: lane_pb2.StatePiece) -> None:
        self.dtype = DTYPES[piece.dtype]
        self.shape = tuple(int(d) for d in piece.shape)
        self.buffer = bytearray(piece.total_bytes)
        self.filled = 0


def _check(
    piece: lane_pb2.StatePiece, current: Assembly | None, expected: ExpectedState, limit: int
) -> str | None:
    if not 0 < len(piece.name) <= MAX_NAME_CHARS:
        return f"tensor name of {len(piece.name)} characters"
    if piece.dtype not in DTYPES:
        return f"{piece.name}: dtype {piece.dtype[:32]!r} is not one of {sorted(DTYPES)}"
    if len(piece.shape) > MAX_DIMS:
        return f"{piece.name}: {len(piece.shape)} dimensions (max {MAX_DIMS})"
    if _nbytes(tuple(piece.shape), DTYPES[piece.dtype]) != piece.total_bytes:
        return f"{piece.name}: {piece.total_bytes} bytes for shape {list(piece.shape)[:8]}"
    if current is None and (refused := expected.refusal(piece)) is not None:
        return refused
    if piece.total_bytes > limit:
        return (
            f"{piece.name[:80]}: a tensor of {piece.total_bytes} bytes claimed, larger than "
            f"the {limit} bytes of this rank's whole state"
        )
    if crc32(piece.data) != piece.crc32:
        return f"{piece.name}: crc32 mismatch at offset {piece.offset}"
    at = current.filled if current is not None else 0
    if piece.offset != at or piece.offset + len(piece.data) > piece.total_bytes:
        return f"{piece.name}: piece at offset {piece.offset}, expected {at}"
    if not piece.data and piece.total_bytes:
        return f"{piece.name}: empty piece"
    if current is not None and (
        current.dtype != DTYPES[piece.dtype] or current.shape != tuple(piece.shape)
    ):
        return f"{piece.name}: dtype or shape changed between pieces"
    return None


def assemble(
    stream: Iterator[lane_pb2.StatePiece], expected: ExpectedState
) -> dict[str, torch.Tensor]:
    """Builds the named tensors of a piece stream, refusing anything malformed or not
    ``expected``, before it allocates the tensor the refused piece begins: a piece that
    fails a check or takes the state past ``expected.max_total_bytes`` (its open names
    past ``expected.open_bytes``), or a tensor left incomplete, is a StateTransferError.
    """
    limit = expected.max_total_bytes
    out: dict[str, torch.Tensor] = {}
    name: str | None = None
    current: Assembly | None = None
    total = opened = 0

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
        problem = _check(piece, current, expected, limit)
        if problem is not None:
            raise StateTransferError(problem)
        if current is None:  # the tensor's first piece: bound it, then allocate it
            total += piece.total_bytes
            if total > limit:
                raise StateTransferError(
                    f"{piece.name[:80]}: {piece.total_bytes} bytes take the state to {total}, "
                    f"beyond the {limit} this rank's own state takes"
                )
            if expected.is_open(piece.name):
                opened += piece.total_bytes
                if opened > expected.open_bytes:
                    raise StateTransferError(
                        f"{piece.name[:80]}: {piece.total_bytes} bytes take the entries under "
                        f"{expected.open_prefix!r} to {opened}, beyond the "
                        f"{expected.open_bytes} this rank allows them"
                    )
            current = Assembly(piece)
        current.buffer[piece.offset : piece.offset + len(piece.data)] = piece.data
        current.filled += len(piece.data)
    if current is not None:
        finish()
    return out


_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
"""Answers to a pull that mean "ask again": not offered yet, the joiner's lane not
reachable for the check, or the asking site's slots busy."""


def pull_state(
    stub: lane_pb2_grpc.LaneStub,
    *,
    generation: int,
    step: int,
    rank: int,
    site: str,
    from_rank: int,
    nonce: bytes,
    timeout_s: float,
    expected: ExpectedState,
) -> dict[str, torch.Tensor]:
    """Pulls the state after ``step`` from the serving rank's lane (``stub``: its proxy
    and TLS already set), as ``from_rank`` of joining ``site``, admitted in
    ``generation``. ``rank`` is the serving rank (this rank's own number between sites
    of one size; the ranks holding its rows otherwise). ``nonce`` is what this rank's
    lane made for this pull (``LaneHandoff.expect_pull``): the serving lane asks that
    lane to confirm it before it sends anything. ``timeout_s`` bounds the whole stream.

    Raises StateTransferError when the peer refused, failed, or sent a malformed or
    unexpected piece (the message names the piece, what it claimed and what was expected).
    """
    request = lane_pb2.PullStateRequest(
        generation=generation, step=step, rank=rank, site=site, from_rank=from_rank, nonce=nonce
    )
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stream = stub.PullState(
                request, timeout=max(0.1, deadline - time.monotonic()), wait_for_ready=True
            )
            try:
                return assemble(stream, expected)
            except StateTransferError as exc:
                stream.cancel()  # the source stops sending what was refused
                raise StateTransferError(
                    f"refused the state after step {step} from rank {rank}: {exc}"
                ) from None
        except grpc.RpcError as exc:
            # UNAVAILABLE: the serving rank is not in this generation yet (it moves
            # there when it lands the step that admitted this site), or has not offered
            # the state yet (it does after that step); ask again.
            if exc.code() in _RETRIED and time.monotonic() < deadline - 0.2:
                time.sleep(0.2)
                continue
            raise StateTransferError(
                f"pulling the state after step {step}: {exc.code().name}: {exc.details()}"
            ) from exc
