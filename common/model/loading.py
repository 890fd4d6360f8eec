"""Loading one stage's tensors from a Hugging Face safetensors checkpoint, and the
checkpoint fingerprint (the "weight hash" services report and paths are matched on)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from .config import ModelConfig, ModelConfigError
from .layers import StageModel
from .partition import LayerRange


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


def _checkpoint_names(cfg: ModelConfig, layers: LayerRange) -> dict[str, str]:
    """Our parameter name -> checkpoint tensor name, for just this stage's tensors."""
    names: dict[str, str] = {}
    if layers.is_first:
        names["embed_tokens.weight"] = "model.embed_tokens.weight"
    for local, global_idx in enumerate(range(layers.start, layers.end)):
        for suffix in _layer_param_suffixes(cfg):
            names[f"layers.{local}.{suffix}"] = f"model.layers.{global_idx}.{suffix}"
    if layers.is_last:
        names["norm.weight"] = "model.norm.weight"
        names["lm_head.weight"] = "lm_head.weight"
    return names


def _layer_param_suffixes(cfg: ModelConfig) -> list[str]:
    suffixes = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        suffixes.append(f"self_attn.{proj}.weight")
        has_bias = cfg.o_bias if proj == "o_proj" else cfg.qkv_bias
        if has_bias:
            suffixes.append(f"self_attn.{proj}.bias")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        suffixes.append(f"mlp.{proj}.weight")
        if cfg.mlp_bias:
            suffixes.append(f"mlp.{proj}.bias")
    return suffixes


def load_stage(
    model_dir: str | Path,
    layers: LayerRange | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> StageModel:
    """Load only the tensors of one stage from a Hugging Face safetensors directory."""
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
        wanted["lm_head.weight"] = "model.embed_tokens.weight"
    missing = [src for src in wanted.values() if src not in files]
    if missing:
        raise ModelConfigError(f"{model_dir}: checkpoint lacks {missing[:3]}")
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for ours, src in wanted.items():
        by_file.setdefault(files[src], []).append((ours, src))
    state: dict[str, Tensor] = {}
    for f, pairs in by_file.items():
        with safe_open(str(f), framework="pt", device=str(device)) as fh:
            for ours, src in pairs:
                state[ours] = fh.get_tensor(src).to(dtype)
    with torch.device("meta"):
        model = StageModel(cfg, layers)
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def weight_fingerprint(model_dir: str | Path) -> str:
    """SHA-256 over config.json and every safetensors file's header and size.

    The header lists every tensor's name, dtype, shape and byte offsets, so two
    checkpoints that differ in any tensor layout, or in size, differ here; hashing the
    headers instead of gigabytes of weights keeps start-up fast. (Two checkpoints with
    identical layout and different values are told apart by the file-level metadata
    that converters write, not guaranteed.)
    """
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    cfg = model_dir / "config.json"
    if cfg.is_file():
        h.update(json.dumps(json.loads(cfg.read_text()), sort_keys=True).encode())
    for f in sorted(model_dir.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            h.update(f.name.encode())
            h.update(fh.read(min(n, 64 << 20)))
        h.update(str(f.stat().st_size).encode())
    return h.hexdigest()[:16]
