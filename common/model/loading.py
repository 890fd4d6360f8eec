"""Loading one stage's tensors from a Hugging Face safetensors checkpoint, and the
content hash of a checkpoint (the "weight hash": the model version services report and
the router matches paths on)."""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
import threading
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from .batch_invariant import invariance_applies, kernels_row_invariant, make_batch_invariant
from .config import ModelConfig, ModelConfigError
from .layers import StageModel
from .packed_linear import pack_linears, packing_applies
from .partition import LayerRange

log = logging.getLogger(__name__)


def _safetensors_files(model_dir: Path) -> dict[str, Path]:
    """Map tensor name -> file holding it (sharded or single-file checkpoints)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelConfigError(f"{model_dir}: no *.safetensors weights")
    mapping: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            mapping.update({k: f for k in fh.keys()})  # noqa: SIM118 (safe_open has no __iter__)
    return mapping


# Our fused projections -> the checkpoint's matrices they stack, in order (dim 0).
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def _checkpoint_names(cfg: ModelConfig, layers: LayerRange) -> dict[str, tuple[str, ...]]:
    """Our parameter name -> the checkpoint tensor names it is made of (several: stacked
    along the first dimension), for just this stage's tensors."""
    names: dict[str, tuple[str, ...]] = {}
    if layers.is_first:
        names["embed_tokens.weight"] = ("model.embed_tokens.weight",)
    for local, global_idx in enumerate(range(layers.start, layers.end)):
        for ours, parts in _layer_params(cfg).items():
            src = tuple(f"model.layers.{global_idx}.{p}" for p in parts)
            names[f"layers.{local}.{ours}"] = src
    if layers.is_last:
        names["norm.weight"] = ("model.norm.weight",)
        names["lm_head.weight"] = ("lm_head.weight",)
    return names


def _layer_params(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """A layer's parameters (suffixes) -> the checkpoint suffixes each stacks."""
    plain = ["input_layernorm", "post_attention_layernorm", "self_attn.o_proj", "mlp.down_proj"]
    params = {f"{m}.weight": (f"{m}.weight",) for m in plain}
    if cfg.o_bias:
        params["self_attn.o_proj.bias"] = ("self_attn.o_proj.bias",)
    if cfg.mlp_bias:
        params["mlp.down_proj.bias"] = ("mlp.down_proj.bias",)
    for fused, parts in FUSED.items():
        params[f"{fused}.weight"] = tuple(f"{p}.weight" for p in parts)
        if cfg.mlp_bias if fused.startswith("mlp.") else cfg.qkv_bias:
            params[f"{fused}.bias"] = tuple(f"{p}.bias" for p in parts)
    return params


def load_stage(
    model_dir: str | Path,
    layers: LayerRange | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    pack: bool = True,
    batch_invariant: bool | None = None,
) -> StageModel:
    """Load only the tensors of one stage from a Hugging Face safetensors directory; bf16
    linear weights on a CPU are packed for oneDNN (`packed_linear`; `pack=False`: not),
    and a half-precision CPU model's rows made batch-invariant (`batch_invariant`; None:
    where `invariance_applies`)."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    layers = layers or LayerRange(0, cfg.num_layers, cfg.num_layers)
    if layers.num_layers != cfg.num_layers:
        raise ValueError(
            f"layer range is for {layers.num_layers} layers, model has {cfg.num_layers}"
        )
    files = _safetensors_files(model_dir)
    wanted = _checkpoint_names(cfg, layers)
    if layers.is_last and "lm_head.weight" not in files:
        # Tied embeddings: the head shares the embedding matrix.
        wanted["lm_head.weight"] = ("model.embed_tokens.weight",)
    missing = [src for srcs in wanted.values() for src in srcs if src not in files]
    if missing:
        raise ModelConfigError(f"{model_dir}: checkpoint lacks {missing[:3]}")
    by_file: dict[Path, list[str]] = {}
    for src in {src for srcs in wanted.values() for src in srcs}:
        by_file.setdefault(files[src], []).append(src)
    read: dict[str, Tensor] = {}
    for f, srcs in by_file.items():
        with safe_open(str(f), framework="pt", device=str(device)) as fh:
            for src in srcs:
                read[src] = fh.get_tensor(src).to(dtype)
    state = {
        ours: read[srcs[0]] if len(srcs) == 1 else torch.cat([read.pop(s) for s in srcs])
        for ours, srcs in wanted.items()
    }
    with torch.device("meta"):
        model = StageModel(cfg, layers)
    model.load_state_dict(state, strict=True, assign=True)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if pack and packing_applies(dtype, device):
        pack_linears(model)
    if invariance_applies(dtype, device) if batch_invariant is None else batch_invariant:
        if kernels_row_invariant(model):
            make_batch_invariant(model)
        else:
            log.warning(
                "%s: this machine's %s matmul kernels give a row other bits in calls of "
                "2 to 32 rows: its rows stay batched (speculation may round a near-tie "
                "unlike plain decoding)",
                model_dir,
                dtype,
            )
    return model


WEIGHT_HASH_FILE = "specpipe-weight-hash.json"
WEIGHT_HASH_FORMAT = 1
_HASH_BLOCK = 16 << 20


def weight_fingerprint(model_dir: str | Path) -> str:
    """The model version: a content hash of the checkpoint (the "weight hash" services
    report and the router matches paths on), 16 hex digits.

    SHA-256 over config.json (normalized) and every tensor in name order: its name,
    dtype, shape and raw bytes. So two checkpoints differ here exactly when a tensor
    (or the configuration) differs, whatever their sharding or file metadata. Hashing
    reads every byte once (about a second per GB); the result is kept with the model
    in `specpipe-weight-hash.json`, keyed by every file's size and mtime, and reused
    while they are unchanged (in the user cache directory when the model's directory is
    read-only).
    """
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelConfigError(f"{model_dir}: no *.safetensors weights")
    cfg = model_dir / "config.json"
    key = {
        f.name: [f.stat().st_size, f.stat().st_mtime_ns]
        for f in [*([cfg] if cfg.is_file() else []), *files]
    }
    for memo in _hash_memos(model_dir):
        try:
            saved = json.loads(memo.read_text())
            if saved.get("format") == WEIGHT_HASH_FORMAT and saved.get("files") == key:
                return str(saved["weight_hash"])
        except (OSError, ValueError, KeyError, AttributeError):
            continue
    digest = _content_hash(cfg if cfg.is_file() else None, files)
    record = {"format": WEIGHT_HASH_FORMAT, "weight_hash": digest, "files": key}
    for memo in _hash_memos(model_dir):
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_name(f"{memo.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(record, indent=1) + "\n")
            os.replace(tmp, memo)
            break
        except OSError:
            continue
    return digest


def _hash_memos(model_dir: Path) -> list[Path]:
    """Where a directory's weight hash is kept: beside the model, else in the user cache."""
    import platformdirs

    key = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:24]
    cache = Path(platformdirs.user_cache_dir("specpipe")) / "weight-hashes" / f"{key}.json"
    return [model_dir / WEIGHT_HASH_FILE, cache]


def _content_hash(cfg: Path | None, files: list[Path]) -> str:
    h = hashlib.sha256()
    if cfg is not None:
        h.update(json.dumps(json.loads(cfg.read_text()), sort_keys=True).encode())
    tensors: dict[str, tuple[Path, dict, int]] = {}
    for f in files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        for name, meta in header.items():
            tensors[name] = (f, meta, 8 + n)
    maps: dict[Path, mmap.mmap] = {}
    try:
        for name in sorted(tensors):
            f, meta, base = tensors[name]
            if f not in maps:
                with f.open("rb") as fh:
                    maps[f] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            begin, end = meta["data_offsets"]
            h.update(json.dumps([name, meta["dtype"], meta["shape"], end - begin]).encode())
            view = memoryview(maps[f])
            for pos in range(base + begin, base + end, _HASH_BLOCK):
                h.update(view[pos : min(pos + _HASH_BLOCK, base + end)])
            view.release()
    finally:
        for m in maps.values():
            m.close()
    return h.hexdigest()[:16]
