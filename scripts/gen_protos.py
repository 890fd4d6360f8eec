"""Regenerate the committed Python code of the specpipe.v1 protos.

Run from anywhere: `python scripts/gen_protos.py [OUT_ROOT]`. The generated files are
committed (the test suite checks they match the protos), so installing needs no protoc.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"
PROTO_DIR = PROTO_ROOT / "specpipe" / "v1"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_root: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc (from grpcio-tools) on every proto; return the files it wrote."""
    from grpc_tools import protoc

    out_root.mkdir(parents=True, exist_ok=True)
    (out_root / "specpipe" / "v1").mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--pyi_out={out_root}",
        *[str(p) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_root / "specpipe" / "v1").glob("*_pb2*.py*"))


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT
    for f in generate(out):
        print(f.relative_to(out))
