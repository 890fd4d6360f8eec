"""A compact Llama-family decoder (Llama, Mistral, SmolLM, Qwen2) that runs as pipeline stages.

A `StageModel` owns decoder layers ``[start, end)``; the first stage also owns the token
embedding, the last also the final norm and LM head. Attention takes an explicit boolean
mask over [cached rows + new rows], so the same code runs prefill chunks (causal), tree
layers (ancestor mask) and plain decoding.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn

from .config import ModelConfig, ModelConfigError

if TYPE_CHECKING:
    from .kv_cache import TreeKVCache


@dataclass(frozen=True)
class LayerRange:
    """Decoder layers ``[start, end)`` of a model with ``num_layers`` layers."""

    start: int
    end: int
    num_layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= self.num_layers:
            raise ValueError(
                f"invalid layer range [{self.start}, {self.end}) for {self.num_layers} layers"
            )

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.num_layers

    @property
    def size(self) -> int:
        return self.end - self.start


def split_layers(
    num_layers: int, num_stages: int, weights: list[float] | None = None
) -> list[LayerRange]:
    """Split layers into contiguous stages, in proportion to `weights` (e.g. measured speed)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    weights = weights or [1.0] * num_stages
    if len(weights) != num_stages or min(weights) <= 0:
        raise ValueError("need one positive weight per stage")
    total = sum(weights)
    bounds, acc = [0], 0.0
    for i, w in enumerate(weights[:-1]):
        acc += w
        # Round to the nearest boundary but leave at least one layer for every stage.
        b = round(acc / total * num_layers)
        b = max(b, bounds[-1] + 1)
        b = min(b, num_layers - (num_stages - 1 - i))
        bounds.append(b)
    bounds.append(num_layers)
    return [LayerRange(a, b, num_layers) for a, b in itertools.pairwise(bounds)]


def split_layers_by_cost(layer_costs: list[float], num_stages: int) -> list[LayerRange]:
    """Contiguous stages minimizing the slowest stage's cost (a pipeline step waits for it).

    `layer_costs[i]` is layer i's cost with the embedding folded into the first layer and
    the final norm + LM head into the last. Exact linear partition by dynamic programming.
    """
    n = len(layer_costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} stages")
    prefix = list(itertools.accumulate(layer_costs, initial=0.0))
    inf = float("inf")
    # best[s][i]: smallest max-stage cost covering layers [0, i) with s stages; cut[s][i]: last cut.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                c = max(best[s - 1][j], prefix[i] - prefix[j])
                if c < best[s][i]:
                    best[s][i], cut[s][i] = c, j
    bounds, i = [n], n
    for s in range(num_stages, 0, -1):
        i = cut[s][i]
        bounds.append(i)
    bounds.reverse()
    return [LayerRange(a, b, n) for a, b in itertools.pairwise(bounds)]


def parameter_layer_costs(cfg: ModelConfig) -> list[float]:
    """Per-layer cost proxy: weights read per step (small batches are memory-bound), with the
    LM head folded into the last layer. A large-vocabulary head is worth several layers
    (Qwen2.5-1.5B: 233M head parameters against 47M per layer)."""
    d, h, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = d * h * 2 + d * kv * 2 + 3 * d * cfg.intermediate_size
    costs = [1.0] * cfg.num_layers
    costs[-1] += cfg.vocab_size * d / layer
    return costs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalize in fp32 like the reference implementation, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(
    positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / (
        theta
        ** (
            torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
            / head_dim
        )
    )
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [heads, n, head_dim]; cos/sin: [n, head_dim] (HF rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=cfg.o_bias)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        cache: TreeKVCache,
        layer: int,
        start: int,
    ) -> Tensor:
        n, d = x.shape[0], self.cfg.head_dim
        q = self.q_proj(x).view(n, self.cfg.num_heads, d).transpose(0, 1)
        k = self.k_proj(x).view(n, self.cfg.num_kv_heads, d).transpose(0, 1)
        v = self.v_proj(x).view(n, self.cfg.num_kv_heads, d).transpose(0, 1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = cache.write(layer, start, k, v)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, enable_gqa=True
        )
        return self.o_proj(out.squeeze(0).transpose(0, 1).reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        cache: TreeKVCache,
        layer: int,
        start: int,
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class StageModel(nn.Module):
    """Layers ``[start, end)`` of a model; embedding on the first stage, norm + head on the last."""

    def __init__(self, cfg: ModelConfig, layers: LayerRange) -> None:
        super().__init__()
        self.cfg, self.layer_range = cfg, layers
        self.embed_tokens = (
            nn.Embedding(cfg.vocab_size, cfg.hidden_size) if layers.is_first else None
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(layers.size))
        if layers.is_last:
            self.norm: RMSNorm | None = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head: nn.Linear | None = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        else:
            self.norm = self.lm_head = None

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def embed(self, token_ids: Tensor) -> Tensor:
        if self.embed_tokens is None:
            raise RuntimeError("only the first stage embeds tokens")
        return self.embed_tokens(token_ids)

    def forward(
        self, hidden: Tensor, positions: Tensor, mask: Tensor, cache: TreeKVCache, start: int
    ) -> Tensor:
        """Run new rows `hidden` [n, H] at `positions`; their K/V go to cache rows [start, start+n).

        `mask` is boolean [n, start + n]: True where a new row may attend to a cache row.
        """
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, hidden.dtype)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, mask, cache, i, start)
        return hidden

    def logits(self, hidden: Tensor) -> Tensor:
        if self.norm is None or self.lm_head is None:
            raise RuntimeError("only the last stage computes logits")
        logits = self.lm_head(self.norm(hidden))
        # At least fp32 (sampling needs it); fp64 models keep fp64 (exactness checks).
        return logits if logits.dtype == torch.float64 else logits.float()

    def num_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


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
