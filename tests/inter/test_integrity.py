"""Integrity: a chunk that fails its checksum is pulled again, never summed.

Corruption is injected at the lane level: the sender's copy in the outbox stays
intact while the bytes put on the wire have one bit flipped (what a faulty link or
NIC does), so the receiver's crc32 check fails and it pulls the chunk again.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import torch
from lanes import inputs, lane_pair, run_all, same_bits, two_sites_over

from isthmus.inter.data.codecs.chain import crc32
from isthmus.inter.data.codecs.int8 import BLOCK
from isthmus.inter.data.lane.peer import LanePeer
from isthmus.inter.data.round.context import ModelMismatch, NonFiniteGradient, PeerAborted
from isthmus.inter.data.transport.peer_round import PeerRound
from isthmus.inter.data.transport.wire import Frame
from isthmus.proto import lane_pb2

pytestmark = pytest.mark.timeout(60)


def _flipped(frame: bytes) -> bytes:
    """The serialized chunk with one payload bit flipped (the outbox keeps the original)."""
    bad = lane_pb2.PushChunksRequest.FromString(frame)
    payload = bytearray(bad.payload)
    payload[len(payload) // 2] ^= 0x10
    bad.payload = bytes(payload)
    return bad.SerializeToString()


@pytest.fixture()
def corrupt_every(monkeypatch: pytest.MonkeyPatch):
    """Flips a bit in every n-th chunk put on the wire (both kinds); returns a counter."""
    sent = {"n": 0, "every": 0}
    counter = itertools.count(1)
    lock = threading.Lock()

    def send(self, frame: Frame, original=PeerRound.send) -> None:  # either transport
        with lock:
            hit = sent["every"] and next(counter) % sent["every"] == 0
            sent["n"] += bool(hit)
        original(self, Frame.from_message(_flipped(frame.joined())) if hit else frame)

    monkeypatch.setattr(PeerRound, "send", send)
    return sent


@pytest.mark.parametrize("num_sites", [2, 3])
@pytest.mark.parametrize("codec", ["raw", "raw+shuffle+zstd:1"])
@pytest.mark.parametrize("transport", ["bulk", "grpc"])
def test_corrupt_chunks_are_pulled_again_and_result_is_exact(
    corrupt_every: dict, num_sites: int, codec: str, transport: str
) -> None:
    corrupt_every["every"] = 3
    with lane_pair(num_sites, codec, transport=transport) as ars:
        total_corrupt = 0
        for step in range(3):
            data = inputs(num_sites, [7000, 5], seed=step)
            # Reference in the owner's fixed order: site 0 first, then 1, 2.
            want = []
            for k in range(2):
                acc = data[0][k].clone()
                for s in range(1, num_sites):
                    acc += data[s][k]
                want.append(acc)
            res = run_all(
                [
                    lambda s=s, d=data, st=step: ars[s].allreduce(d[s], st, 0, False)
                    for s in range(num_sites)
                ]
            )
            for s in range(num_sites):
                assert not isinstance(res[s], BaseException), res[s]
                assert all(torch.equal(data[s][k], want[k]) for k in range(2)), s
            total_corrupt += sum(r.corrupt_chunks for r in res)
        assert corrupt_every["n"] > 0
        # Every corruption was seen, counted once by the round and once by the lane.
        assert total_corrupt == corrupt_every["n"]
        assert sum(a.server.corruptions for a in ars) == corrupt_every["n"]


def test_chunk_corrupt_again_on_the_way_back_is_pulled_again(
    corrupt_every: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    corrupt_every["every"] = 2
    fetches = {"n": 0, "bad": 0}
    lock = threading.Lock()
    original = LanePeer.deliver

    def deliver(self: LanePeer, frame: Frame | bytes, nonce: bytes, timeout: float) -> None:
        # Every other chunk handed back (ResendChunk -> DeliverChunk) is corrupt too.
        with lock:
            fetches["n"] += 1
            bad = fetches["n"] % 2 == 1
            fetches["bad"] += bad
        if bad:
            sent = frame.joined() if isinstance(frame, Frame) else frame
            chunk = lane_pb2.PushChunksRequest.FromString(sent)
            payload = bytearray(chunk.payload)
            payload[len(payload) // 2] ^= 0x10
            chunk.payload = bytes(payload)
            frame = chunk.SerializeToString()
        original(self, frame, nonce, timeout)

    monkeypatch.setattr(LanePeer, "deliver", deliver)
    with lane_pair(2, "int8+zstd:1") as ars:
        data = inputs(2, [9000], seed=5)
        res = run_all([lambda s=s: ars[s].allreduce(data[s], 0, 0, False) for s in range(2)])
        assert not any(isinstance(r, BaseException) for r in res), res
        assert torch.equal(data[0][0], data[1][0])
        assert corrupt_every["n"] > 0 and fetches["bad"] > 0
        # Each pull ends with one intact answer; every corrupt copy was counted.
        assert fetches["n"] - fetches["bad"] == corrupt_every["n"]
        assert sum(r.corrupt_chunks for r in res) == corrupt_every["n"] + fetches["bad"]


# --- non-finite values stop at the border (issue 14, row 10) ------------------------


def _forged(codec: str, n: int) -> bytes:
    """A payload of ``n`` values that decodes to NaN (raw) or to Inf from finite bytes
    (int8: scales of 1e38, finite, times the integer 127)."""
    if codec == "raw":
        return np.full(n, np.nan, np.float32).tobytes()
    blocks = -(-n // BLOCK)
    return np.full(blocks, 1e38, np.float32).tobytes() + np.full(n, 127, np.int8).tobytes()


def forge_first_copies(monkeypatch: pytest.MonkeyPatch, forge) -> dict[str, int]:
    """The first copy of every chunk put on the wire is ``forge(chunk)``'s (a forged
    chunk that got into the mailbox before the real one, which the mailbox then refuses
    as a duplicate); the sender's outbox keeps the real one. Counts the forged ones."""
    seen: set[tuple] = set()
    forged = {"n": 0}
    lock = threading.Lock()

    def send(self, frame: Frame, original=PeerRound.send) -> None:
        chunk = lane_pb2.PushChunksRequest.FromString(frame.joined())
        key = (chunk.step, chunk.group, chunk.kind, chunk.chunk_index, chunk.from_site)
        with lock:
            first = key not in seen
            seen.add(key)
            forged["n"] += first
        if first:
            forge(chunk)
            frame = Frame.from_message(chunk.SerializeToString())
        original(self, frame)

    monkeypatch.setattr(PeerRound, "send", send)
    return forged


@pytest.fixture()
def forge_nan_first(monkeypatch: pytest.MonkeyPatch):
    """The first copy of every chunk carries NaN of the right size and a matching crc32."""

    def nan(chunk) -> None:
        chunk.payload = _forged(chunk.codec, chunk.num_elements)
        chunk.crc32 = crc32(chunk.payload)

    return forge_first_copies(monkeypatch, nan)


@pytest.mark.parametrize(
    ("transport", "codec"), [("bulk", "raw"), ("grpc", "raw"), ("bulk", "int8")]
)
def test_chunks_of_nan_are_refused_before_summing_and_the_real_ones_pulled(
    forge_nan_first: dict, transport: str, codec: str
) -> None:
    with lane_pair(3, codec, transport=transport) as ars:
        data = inputs(3, [7000, 5], seed=3)
        want = [data[0][k] + data[1][k] + data[2][k] for k in range(2)]
        res = run_all([lambda s=s: ars[s].allreduce(data[s], 0, 0, False) for s in range(3)])
        assert not any(isinstance(r, BaseException) for r in res), res
        for s in range(3):
            if codec == "raw":
                assert all(torch.equal(data[s][k], want[k]) for k in range(2)), s
            else:  # int8: every site the same bits, within the quantization of the sum
                assert all(same_bits(data[s][k], data[0][k]) for k in range(2)), s
                # Two roundings (contribution, sum) of a step ~0.16 here: measured 0.13.
                assert all(torch.allclose(data[s][k], want[k], atol=0.3) for k in range(2))
        # Every forged copy (contributions and results) was refused and counted once.
        assert forge_nan_first["n"] > 0
        assert sum(r.nonfinite_chunks for r in res) == forge_nan_first["n"]


def test_a_site_whose_gradient_holds_nan_sends_nothing_and_says_so() -> None:
    with lane_pair(2, "int8+zstd:1", timeout_s=2.0) as ars:
        data = inputs(2, [9000], seed=1)
        data[0][0][4321] = float("inf")
        res = run_all([lambda s=s: ars[s].allreduce(data[s], 0, 0, False) for s in range(2)])
        assert isinstance(res[0], NonFiniteGradient), res[0]
        assert "site 0 step 0 group 0: this site's gradient holds NaN or Inf" in str(res[0])
        # The other site never saw a value of it: site 0 told it that it gave the round
        # up (issue 38: it used to wait out the round's timeout), nothing non-finite in
        # its tensor (GradientSync applies a round's result only on commit).
        assert isinstance(res[1], PeerAborted), res[1]
        assert "site 0 gave the round up: site 0 step 0 group 0: this site's gradient" in str(
            res[1]
        )
        assert torch.isfinite(data[1][0]).all()


# --- through the WAN emulator, whose links flip bits ---------------------------------


def test_relay_corruption_is_caught_and_the_result_stays_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from isthmus.sim import Corrupt, LinkSpec

    # gRPC skips a proxy for hosts in no_proxy; name none so lanes cross the link.
    monkeypatch.setenv("no_grpc_proxy", "none.invalid")
    chunk = 256 * 1024
    # ~1 flipped byte per 2 MB each way. Chunks travel on the bulk port: a flip in a
    # frame's header fails the record's checksum and the frame is sent again; one in
    # its payload fails the payload's checksum and the round pulls it again (each
    # counted as a corrupt chunk); only a flip in a 16-byte record head would fail the
    # connection (its own checksum says the boundaries are lost).
    spec = LinkSpec.symmetric(latency_s=0.0005, impairments=(Corrupt(rate=5e-7),), seed=3)
    with two_sites_over(spec, chunk_bytes=chunk, connections=2, timeout_s=30) as (ars, _, link):
        corrupt = 0
        for step in range(3):
            data = inputs(2, [1 << 20], seed=step)  # 4 MiB per site
            want = data[0][0] + data[1][0]
            res = run_all(
                [
                    lambda s=s, d=data, st=step: ars[s].allreduce(d[s], st, 0, False)
                    for s in range(2)
                ]
            )
            assert not any(isinstance(r, BaseException) for r in res), res
            assert torch.equal(data[0][0], want) and torch.equal(data[1][0], want)
            corrupt += sum(r.corrupt_chunks for r in res)
        flipped = sum(d.get("corrupted_bytes", 0) for d in link.stats().values())
        assert flipped > 0
        # Every chunk a flip landed in was counted and pulled again.
        assert 0 < corrupt <= flipped
        print(f"flipped bytes {flipped}, corrupt chunks pulled again {corrupt}")


# --- a peer's gradient of another size (issue 60) -----------------------------------


def test_a_forged_chunk_of_another_size_is_pulled_again_not_taken_for_another_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first copy of every chunk claims a gradient of two values more: the
    receiver asks the sender itself, whose copy has the right size, and the round ends
    exact. A forged chunk must not stop the job as a model mismatch would."""

    def bigger(chunk) -> None:
        chunk.total_elements += 2  # a gradient of two values more

    forged = forge_first_copies(monkeypatch, bigger)
    with lane_pair(2, "raw") as ars:
        data = inputs(2, [3000], seed=4)
        want = data[0][0] + data[1][0]
        res = run_all([lambda s=s: ars[s].allreduce(data[s], 0, 0, False) for s in range(2)])
        assert not any(isinstance(r, BaseException) for r in res), res
        assert torch.equal(data[0][0], want) and torch.equal(data[1][0], want)
        assert forged["n"] > 0


def test_sites_whose_gradients_differ_in_size_fail_with_model_mismatch() -> None:
    """5 values at site 0, 7 at site 1: never retried (GradientSync raises it), named
    with both sizes; the site that heard of it first from the other's abort gets that."""
    with lane_pair(2, "raw", timeout_s=30.0) as ars:
        data = [[torch.ones(5)], [torch.ones(7)]]
        res = run_all([lambda s=s: ars[s].allreduce(data[s], 0, 0, False) for s in range(2)])
        mismatched = [r for r in res if isinstance(r, ModelMismatch)]
        assert mismatched, res
        assert all(isinstance(r, (ModelMismatch, PeerAborted)) for r in res), res
        said = str(mismatched[0])
        assert "model differs from this site's" in said
        assert "holds 7 values, this rank's 5" in said or "holds 5 values, this rank's 7" in said
