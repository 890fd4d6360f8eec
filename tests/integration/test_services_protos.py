"""The committed generated code is what the protos generate (regenerate with
`python scripts/gen_protos.py` after editing a .proto)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gen_protos", REPO / "scripts" / "gen_protos.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = gen.generate(tmp_path)
    assert fresh, "protoc wrote nothing"
    committed = REPO / "protos" / "specpipe" / "v1"
    names = {f.name for f in fresh}
    assert names == {f.name for f in committed.glob("*_pb2*.py*")}
    for f in fresh:
        assert f.read_bytes() == (committed / f.name).read_bytes(), (
            f"{f.name} is stale: run scripts/gen_protos.py"
        )
