"""Small file helpers of the store: sizes, human-readable bytes, hashing with progress."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tqdm import tqdm

CHUNK = 8 << 20  # bytes read at a time when hashing or copying large files


def format_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def sha256_file(path: Path, progress: bool = False, desc: str = "hashing") -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with (
        open(path, "rb") as f,
        tqdm(
            total=size,
            unit="B",
            unit_scale=True,
            desc=desc,
            disable=not progress or size < 64 << 20,  # a bar for big files only
            leave=False,
        ) as bar,
    ):
        while chunk := f.read(CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()
