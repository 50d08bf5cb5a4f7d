"""The committed generated gRPC modules match what the .proto files generate."""

from __future__ import annotations

from pathlib import Path

from isthmus.proto import generate


def test_generated_modules_are_fresh(tmp_path: Path):
    fresh = generate.generate(tmp_path)
    assert fresh, "no .proto files found"
    stale = [
        path.name
        for path in fresh
        if not (generate.PROTO_DIR / path.name).exists()
        or (generate.PROTO_DIR / path.name).read_bytes() != path.read_bytes()
    ]
    assert not stale, f"regenerate with `python -m isthmus.proto.generate`: stale {stale}"


def test_generated_modules_import_under_the_isthmus_namespace():
    from isthmus.proto import coordinator_pb2, coordinator_pb2_grpc, lane_pb2, lane_pb2_grpc

    assert coordinator_pb2.DESCRIPTOR.package == "isthmus.v1"
    assert lane_pb2.DESCRIPTOR.package == "isthmus.v1"
    assert hasattr(coordinator_pb2_grpc, "CoordinatorStub")
    assert hasattr(lane_pb2_grpc, "LaneStub")
