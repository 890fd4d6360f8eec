"""The manifest of a converted cache entry: what it was converted from, and every file's
size and hash, written last so that an entry is either complete or has none."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from .files import sha256_file
from .registry import StoreModel

MANIFEST = "specpipe-manifest.json"
MANIFEST_FORMAT = 1


def check_entry(
    entry: Path, gguf_sha256: str, deep: bool = False, progress: bool = False
) -> str | None:
    """Why the cache entry `entry` is not usable (None when it is).

    Cheap by default: the manifest must be complete, come from the expected GGUF, and
    every listed file must exist with its recorded size. `deep` re-hashes the files.
    """
    if not entry.is_dir():
        return "not pulled"
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        files: dict[str, dict[str, Any]] = manifest["files"]
        source = manifest["source"]
    except FileNotFoundError:
        return "no manifest (an interrupted pull or conversion)"
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable manifest"
    if not isinstance(source, dict) or not isinstance(files, dict):
        return "unreadable manifest"
    if not all(isinstance(meta, dict) for meta in files.values()):
        return "unreadable manifest"
    if manifest.get("format") != MANIFEST_FORMAT:
        return f"manifest format {manifest.get('format')!r}, expected {MANIFEST_FORMAT}"
    if source.get("gguf_sha256") != gguf_sha256:
        return "converted from a different GGUF than the one pinned now"
    names = set(files)
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        return "manifest lists no config.json or no weights"
    if not names & {"tokenizer.json", "tokenizer_config.json"}:
        return "manifest lists no tokenizer"
    for rel, meta in sorted(files.items()):
        path = entry / rel
        if Path(rel).name != rel or not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != meta.get("size"):
            return f"{rel} has {size} bytes, the manifest says {meta.get('size')}"
    unlisted = sorted(p.name for p in entry.glob("*.safetensors") if p.name not in names)
    if unlisted:
        return f"unlisted weight files {unlisted[:2]}"
    if deep:
        for rel, meta in sorted(files.items()):
            digest = sha256_file(entry / rel, progress, f"verifying {rel}")
            if digest != meta.get("sha256"):
                return f"{rel} does not match its hash in the manifest"
    return None


def write_manifest(
    directory: Path, name: str, source: dict[str, Any], seconds: float, progress: bool = False
) -> None:
    """Hash every file of a converted `directory` and write its manifest there."""
    files = {}
    for f in sorted(directory.iterdir()):
        if f.is_file() and f.name != MANIFEST:
            digest = sha256_file(f, progress, f"hashing {f.name}")
            files[f.name] = {"size": f.stat().st_size, "sha256": digest}
    manifest = {
        "format": MANIFEST_FORMAT,
        "name": name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": source,
        "conversion": {"dtype": "bfloat16", "seconds": round(seconds, 1), **_versions()},
        "files": files,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def part_hashes(gguf: Path, model: StoreModel) -> list[dict[str, Any]]:
    """Parts as pinned, with the hashes recorded when they were assembled (if still known)."""
    try:
        return json.loads(gguf.with_suffix(".parts.json").read_text())
    except (OSError, ValueError):
        return [dataclasses.asdict(p) for p in model.parts]


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("transformers", "gguf", "torch"):
        with contextlib.suppress(PackageNotFoundError):
            out[pkg] = version(pkg)
    return out
