"""Turns what a user passes as MODEL (a directory, a GGUF file, a store name) into a directory."""

from __future__ import annotations

from pathlib import Path


class ModelNotFoundError(ValueError):
    """MODEL names nothing this machine has or can fetch."""


def resolve_model(spec: str) -> Path:
    """A local Hugging Face directory is used as is."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{spec}: directory has no config.json")
        return path
    raise ModelNotFoundError(f"model {spec!r} not found (not a directory)")
