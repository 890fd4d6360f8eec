"""The weight hash: a content hash of the tensors (the model version paths are matched
on), independent of sharding and file metadata, computed once and kept with the model."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from specpipe.common.model import loading
from specpipe.common.model.config import ModelConfigError
from specpipe.common.model.loading import WEIGHT_HASH_FILE, weight_fingerprint


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != WEIGHT_HASH_FILE:
            shutil.copy(f, dst / f.name)
    return dst


def test_same_shapes_different_values_differ(llama_dir: Path, tmp_path: Path) -> None:
    d = _copy(llama_dir, tmp_path / "m")
    before = weight_fingerprint(d)
    assert len(before) == 16 and before == weight_fingerprint(llama_dir)
    tensors = load_file(d / "model.safetensors")
    name = sorted(tensors)[3]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1.0
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    assert weight_fingerprint(d) != before


def test_sharding_and_metadata_do_not_matter(llama_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "sharded"
    d.mkdir()
    shutil.copy(llama_dir / "config.json", d / "config.json")
    tensors = load_file(llama_dir / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, d / "a.safetensors", metadata={"x": "1"})
    save_file({n: tensors[n] for n in names[half:]}, d / "b.safetensors")
    assert weight_fingerprint(d) == weight_fingerprint(llama_dir)


def test_config_changes_the_hash(llama_dir: Path, tmp_path: Path) -> None:
    d = _copy(llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_theta"] = 1234.0
    (d / "config.json").write_text(json.dumps(cfg))
    assert weight_fingerprint(d) != weight_fingerprint(llama_dir)


def test_computed_once_and_kept_with_the_model(
    llama_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    d = _copy(llama_dir, tmp_path / "m")
    first = weight_fingerprint(d)
    assert json.loads((d / WEIGHT_HASH_FILE).read_text())["weight_hash"] == first
    calls = []
    real = loading._content_hash
    monkeypatch.setattr(loading, "_content_hash", lambda *a: calls.append(a) or real(*a))
    assert weight_fingerprint(d) == first and not calls  # kept: not hashed again
    w = d / "model.safetensors"
    st = w.stat()
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed: hash again
    assert weight_fingerprint(d) == first and len(calls) == 1


def test_read_only_model_directory_keeps_the_hash_in_the_user_cache(
    llama_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    d = _copy(llama_dir, tmp_path / "ro")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    real_replace = os.replace

    def refuse_model_dir(src, dst):
        if Path(dst).parent == d:
            raise PermissionError("read-only")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", refuse_model_dir)
    h = weight_fingerprint(d)
    assert not (d / WEIGHT_HASH_FILE).exists()
    assert list((tmp_path / "cache").rglob("*.json"))
    assert weight_fingerprint(d) == h


def test_no_weights_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=r"no \*\.safetensors"):
        weight_fingerprint(tmp_path)
