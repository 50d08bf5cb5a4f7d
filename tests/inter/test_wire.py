"""The lane's hand-written wire form against protobuf itself (inter/data/transport/wire.py).

What the lanes write must parse as the ``PushChunksRequest`` of proto/lane.proto with
any protobuf library, and what they read must mean what protobuf says it means, or be
refused: both directions are checked against python protobuf on typed and raw inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isthmus.inter.data.transport.wire import (
    DeliverWire,
    WireError,
    encode_chunk,
    encode_delivery,
    parse_chunk,
)
from isthmus.proto import lane_pb2

U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
FIELDS = (
    "generation",
    "step",
    "group",
    "kind",
    "chunk_index",
    "num_chunks",
    "from_site",
    "total_elements",
    "num_elements",
    "codec",
    "crc32",
)


def fields_of(msg) -> dict:
    return {name: getattr(msg, name) for name in FIELDS}


headers = st.builds(
    lane_pb2.PushChunksRequest,
    generation=U64,
    step=U64,
    group=U32,
    kind=st.sampled_from([0, 1, 2]),
    chunk_index=U32,
    num_chunks=U32,
    from_site=U32,
    total_elements=U64,
    num_elements=U32,
    codec=st.text(max_size=20),
    crc32=U32,
)


@settings(max_examples=300, deadline=None)
@given(header=headers, payload=st.binary(max_size=300))
def test_encoded_chunk_is_the_protobuf_message(header, payload) -> None:
    frame = encode_chunk(header, payload)
    parsed = lane_pb2.PushChunksRequest.FromString(frame)
    assert parsed.payload == payload and fields_of(parsed) == fields_of(header)
    chunk = parse_chunk(frame)
    assert bytes(chunk.payload) == payload
    assert {k: getattr(chunk, k) for k in FIELDS} == fields_of(header)


@settings(max_examples=300, deadline=None)
@given(header=headers, payload=st.binary(max_size=300))
def test_protobuf_encodings_parse_the_same(header, payload) -> None:
    # Protobuf writes the payload between other fields (field order 11, then 12).
    header.payload = payload
    chunk = parse_chunk(header.SerializeToString())
    assert bytes(chunk.payload) == payload
    assert {k: getattr(chunk, k) for k in FIELDS} == fields_of(header)


@settings(max_examples=500, deadline=None)
@given(data=st.binary(max_size=64))
def test_arbitrary_bytes_parse_as_protobuf_does_or_are_refused(data) -> None:
    try:
        chunk = parse_chunk(data)
    except WireError:
        return  # refusing is always allowed; accepting must agree with protobuf
    want = lane_pb2.PushChunksRequest.FromString(data)
    assert bytes(chunk.payload) == want.payload
    assert {k: getattr(chunk, k) for k in FIELDS} == fields_of(want)


def test_payload_is_a_view_and_parts_are_joined() -> None:
    values = np.arange(1000, dtype=np.float32)
    frame = encode_chunk(lane_pb2.PushChunksRequest(step=3), [b"\x01\x02", values])
    chunk = parse_chunk(frame)
    assert isinstance(chunk.payload, memoryview) and chunk.payload.readonly
    assert bytes(chunk.payload) == b"\x01\x02" + values.tobytes()
    assert chunk.payload.obj is frame  # no copy of the payload was made


def test_last_payload_wins_as_in_protobuf() -> None:
    first = lane_pb2.PushChunksRequest(payload=b"first").SerializeToString()
    second = lane_pb2.PushChunksRequest(step=9, payload=b"second").SerializeToString()
    data = first + second
    assert lane_pb2.PushChunksRequest.FromString(data).payload == b"second"
    chunk = parse_chunk(data)
    assert bytes(chunk.payload) == b"second" and chunk.step == 9


@pytest.mark.parametrize(
    "data, why",
    [
        (b"\x5a\xff\xff\xff\xff\x0f", "claims"),  # payload longer than the message
        (b"\x08", "truncated varint"),
        (b"\x08" + b"\xff" * 11, "varint longer"),
        (b"\x00\x01", "field number 0"),
        (b"\x0b", "unsupported wire type"),  # start group
        (b"\x11\x01\x02", "runs past the end"),  # fixed64 cut short
        (b"\x52\x02\xff\xfe", "DecodeError"),  # codec: invalid UTF-8
    ],
)
def test_malformed_bytes_are_refused_with_a_reason(data: bytes, why: str) -> None:
    with pytest.raises(WireError, match=why):
        parse_chunk(data)


def test_delivery_round_trip() -> None:
    sent = lane_pb2.PushChunksRequest(step=4, chunk_index=2, payload=b"xyz", crc32=5)
    frame = sent.SerializeToString()
    body = encode_delivery(frame, b"n" * 32)
    parsed = lane_pb2.DeliverChunkRequest.FromString(body)
    assert parsed.chunk == sent and parsed.nonce == b"n" * 32
    delivery = DeliverWire.FromString(body)
    chunk = delivery.chunk
    assert (chunk.step, chunk.chunk_index, bytes(chunk.payload), chunk.crc32) == (4, 2, b"xyz", 5)
    assert delivery.nonce == b"n" * 32
    with pytest.raises(WireError, match="holds no chunk"):
        DeliverWire.FromString(b"")
    with pytest.raises(WireError, match="unexpected field"):
        DeliverWire.FromString(b"\x18\x01")
    with pytest.raises(WireError, match="nonce of 65 bytes"):
        DeliverWire.FromString(encode_delivery(frame, b"n" * 65))
