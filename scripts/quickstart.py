"""Quick start: one generation in every mode on a small model, side by side.

Until the model store lands this makes a small random model on the fly.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import make_tiny_model


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        target = make_tiny_model(Path(tmp) / "target", layers=8, hidden=64, heads=4, kv_heads=2)
        for mode in ("autoregressive", "pp", "specpipe", "specinfer"):
            out = subprocess.run(
                ["specpipe", "generate", "--target", str(target), "--draft", "oracle", "--stages", "4",
                 "--mode", mode, "--prompt-ids", "1,2,3,4", "--max-new-tokens", "32", "--json"],
                check=True, capture_output=True, text=True,
            ).stdout
            print(json.loads(out)["stats"])


if __name__ == "__main__":
    main()
