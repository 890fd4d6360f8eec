"""Reading GGUF headers and converting a GGUF checkpoint into a Hugging Face directory.

Stage processes load only their own layers from safetensors
(docs/architecture.md, "8. Deployment"), so a GGUF is dequantized once, by
`transformers`, and saved as a plain bf16 safetensors directory with its tokenizer and
chat template. The header reader here is deliberately tiny: it reads the first metadata
keys without parsing the (large) vocabulary arrays, so a bad or unsupported file is
rejected in milliseconds instead of after minutes of conversion.
"""

from __future__ import annotations

import gc
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

from .config import SUPPORTED_MODEL_TYPES, ModelConfig

GGUF_MAGIC = b"GGUF"

# GGUF metadata value types -> struct format (scalars); 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALARS |= {11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a GGUF checkpoint this project can convert."""


def is_gguf(path: str | Path) -> bool:
    """True if the file starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise GGUFError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _read_str(f: BinaryIO) -> str:
    n = _read(f, "<Q")
    if n > 1 << 24:
        raise GGUFError("corrupt GGUF header (string too long)")
    data = f.read(n)
    if len(data) != n:
        raise GGUFError("truncated GGUF header")
    return data.decode("utf-8", errors="replace")


def _read_value(f: BinaryIO, vtype: int, keep: bool) -> Any:
    """Read (or, for arrays when `keep` is False, skip) one metadata value."""
    if vtype in _SCALARS:
        return _read(f, _SCALARS[vtype])
    if vtype == _STRING:
        return _read_str(f)
    if vtype == _ARRAY:
        etype, count = _read(f, "<I"), _read(f, "<Q")
        if etype in _SCALARS and not keep:
            f.seek(struct.calcsize(_SCALARS[etype]) * count, os.SEEK_CUR)
            return None
        items = [_read_value(f, etype, keep) for _ in range(count)]
        return items if keep else None
    raise GGUFError(f"corrupt GGUF header (unknown value type {vtype})")


def read_gguf_header(
    path: str | Path, max_keys: int = 64, stop_at: str | None = None
) -> dict[str, Any]:
    """Version, tensor count and the scalar/string metadata among the first `max_keys` keys.

    Arrays (token lists, merges) are skipped, not parsed; reading ends early at key `stop_at`.
    """
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (bad magic bytes)")
        version = _read(f, "<I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: unsupported GGUF version {version}")
        n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
        meta: dict[str, Any] = {}
        for _ in range(min(n_kv, max_keys)):
            key = _read_str(f)
            vtype = _read(f, "<I")
            value = _read_value(f, vtype, keep=False)
            if value is not None:
                meta[key] = value
            if key == stop_at:
                break
    return {"version": version, "n_tensors": n_tensors, "n_kv": n_kv, "metadata": meta}


def gguf_architecture(path: str | Path) -> str:
    """`general.architecture` of a GGUF file, read from its header only."""
    meta = read_gguf_header(path, stop_at="general.architecture")["metadata"]
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{path}: GGUF header has no general.architecture")
    return arch


def check_supported(path: str | Path) -> str:
    """Fail fast, with one line, for GGUF files of architectures our model code cannot run."""
    arch = gguf_architecture(path)
    if arch not in SUPPORTED_MODEL_TYPES:
        raise GGUFError(
            f"{Path(path).name}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return arch


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: Any = None) -> None:
    """Dequantize `gguf_path` into a Hugging Face directory `out_dir` (weights, tokenizer, template).

    Uses `transformers`' GGUF loader; `dtype` defaults to bfloat16 (half the disk of fp32,
    and the GGUF's 4-6 bit weights lose nothing that matters in bf16).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    check_supported(gguf_path)
    dtype = dtype or torch.bfloat16
    kwargs: dict[str, Any] = {"gguf_file": gguf_path.name, "dtype": dtype}
    try:  # transformers >= 5.x keeps GGUF weights packed unless asked to dequantize
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), **kwargs)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # a dense model with a leftover GGUF quantizer cannot be saved
        quantizer.remove_quantization_config(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    del model
    gc.collect()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
    for f in out_dir.iterdir():  # save_pretrained writes some files 0600; stages may run as others
        if f.is_file():
            f.chmod(0o644)
    ModelConfig.from_dir(out_dir)  # our model code must be able to serve the result
