"""Regenerate the committed gRPC modules from the .proto files in this folder.

Run `python -m isthmus.proto.generate` (needs the dev extra: grpcio-tools==1.84.0,
whose output imports on grpcio 1.84 and protobuf >= 7.35.1). The .proto files are
compiled as if they lived at `isthmus/proto/`, so the generated `_pb2_grpc` modules
import their messages as `isthmus.proto.X_pb2` instead of a top-level `X_pb2`.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Compile every .proto here into out_dir; returns the generated files.

    Args:
        out_dir: folder that receives the flat `X_pb2.py`, `X_pb2.pyi`, `X_pb2_grpc.py`.
    Returns:
        The generated paths, sorted.
    """
    from grpc_tools import protoc  # dev dependency, imported only when generating

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        package_dir = root / "isthmus" / "proto"
        package_dir.mkdir(parents=True)
        for proto in proto_files():
            shutil.copy(proto, package_dir / proto.name)
        include = str(Path(protoc.__file__).parent / "_proto")
        args = [
            "protoc",
            f"-I{root}",
            f"-I{include}",
            f"--python_out={root}",
            f"--pyi_out={root}",
            f"--grpc_python_out={root}",
        ] + [f"isthmus/proto/{p.name}" for p in proto_files()]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed; see its message above")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for path in sorted(package_dir.iterdir()):
            if path.name.endswith(SUFFIXES):
                shutil.copy(path, out_dir / path.name)
                written.append(out_dir / path.name)
        return written


def main() -> int:
    for path in generate(PROTO_DIR):
        print(f"wrote {path.relative_to(PROTO_DIR.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
