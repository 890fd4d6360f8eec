"""Turns what a user passes as MODEL (a directory, a GGUF file, a store name) into a directory."""

from __future__ import annotations

import sys
from pathlib import Path

from .errors import ModelNotFoundError
from .registry import MODELS, lookup
from .store import ModelStore


def resolve_model(
    spec: str, *, cache_dir: str | Path | None = None, progress: bool | None = None
) -> Path:
    """A Hugging Face directory as is; a GGUF file or a store name via the model store.

    GGUF files are converted once (cached by content hash); store names are pulled on first
    use, with progress on stderr. `progress` defaults to "stderr is a terminal".
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{spec}: directory has no config.json")
        return path
    if progress is None:
        progress = sys.stderr.isatty()
    if path.is_file():
        from ..model.gguf import is_gguf

        if path.suffix.lower() != ".gguf" and not is_gguf(path):
            raise ModelNotFoundError(f"{spec}: not a model directory or a .gguf file")
        return ModelStore(cache_dir, progress=progress).from_gguf(path)
    if spec.strip().lower() in MODELS:
        return ModelStore(cache_dir, progress=progress).pull(spec)
    if "/" in spec or spec.startswith((".", "~")) or spec.lower().endswith(".gguf"):
        raise ModelNotFoundError(f"{spec}: no such file or directory")
    lookup(spec)  # raises, listing the known names
    raise AssertionError("unreachable")
