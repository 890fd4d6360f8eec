"""A compact Llama-family decoder (Llama, Mistral, SmolLM, Qwen2) that runs as pipeline stages.

A `StageModel` owns decoder layers ``[start, end)``; the first stage also owns the token
embedding, the last also the final norm and LM head. Attention takes an explicit boolean
mask over [cached rows + new rows], so the same code runs prefill chunks (causal), tree
layers (ancestor mask) and plain decoding.

Several requests run in one forward (SpecPipe-DB): their rows are concatenated, so the
projections and the MLP are one GEMM over all rows, and attention runs per request
(`Segment`) against that request's own cache and mask. A loop over requests is exact,
needs no padding and no kernel we do not have on every device; attention is the small
part of a step at these row counts (see benchmarks/README.md, "Batched forward").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig
from .partition import LayerRange


@dataclass(frozen=True)
class Segment:
    """One request's rows within a forward: `rows` of the concatenated batch; their K/V go
    to cache slots `write_slots`, and they attend to the cache rows in `key_slots` (the
    request's rows, new ones included) where `mask` [n, len(key_slots)] is True."""

    rows: slice
    write_slots: Tensor
    key_slots: Tensor
    mask: Tensor


class PagedKV(Protocol):
    """Where K/V rows live: [layers, slots, kv_heads, head_dim] (`runtime.block_pool`)."""

    k: Tensor
    v: Tensor


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
        kv: PagedKV | None,
        segments: Sequence[Segment],
        layer: int,
    ) -> Tensor:
        n, d = x.shape[0], self.cfg.head_dim
        q = self.q_proj(x).view(n, self.cfg.num_heads, d).transpose(0, 1)
        k = self.k_proj(x).view(n, self.cfg.num_kv_heads, d).transpose(0, 1)
        v = self.v_proj(x).view(n, self.cfg.num_kv_heads, d).transpose(0, 1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is None:  # one causal sequence, no cache
            out = F.scaled_dot_product_attention(
                q[None], k[None], v[None], is_causal=True, enable_gqa=True
            )[0]
            return self.o_proj(out.transpose(0, 1).reshape(n, -1))
        k_cache, v_cache = kv.k[layer], kv.v[layer]
        outs = []
        for seg in segments:
            k_cache.index_copy_(0, seg.write_slots, k[:, seg.rows].transpose(0, 1))
            v_cache.index_copy_(0, seg.write_slots, v[:, seg.rows].transpose(0, 1))
            keys = k_cache.index_select(0, seg.key_slots).transpose(0, 1)
            values = v_cache.index_select(0, seg.key_slots).transpose(0, 1)
            out = F.scaled_dot_product_attention(
                q[None, :, seg.rows], keys[None], values[None], attn_mask=seg.mask, enable_gqa=True
            )
            outs.append(out[0])
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return self.o_proj(out.transpose(0, 1).reshape(n, -1))


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
        kv: PagedKV | None,
        segments: Sequence[Segment],
        layer: int,
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, segments, layer)
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

    def forward(self, hidden: Tensor, positions: Tensor) -> Tensor:
        """One causal sequence `hidden` [n, H] at `positions`, without a cache (a reference
        for tests and checks; serving goes through `forward_batch`)."""
        return self._layers(hidden, positions, None, ())

    def forward_batch(
        self, hidden: Tensor, positions: Tensor, kv: PagedKV, segments: Sequence[Segment]
    ) -> Tensor:
        """The rows of several requests, concatenated in `hidden` [N, H]; `segments` say
        which rows are whose (in order, covering all N rows) and where their K/V go."""
        return self._layers(hidden, positions, kv, segments)

    def _layers(
        self, hidden: Tensor, positions: Tensor, kv: PagedKV | None, segments: Sequence[Segment]
    ) -> Tensor:
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, hidden.dtype)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, kv, segments, i)
        return hidden

    def logits(self, hidden: Tensor) -> Tensor:
        if self.norm is None or self.lm_head is None:
            raise RuntimeError("only the last stage computes logits")
        logits = self.lm_head(self.norm(hidden))
        # At least fp32 (sampling needs it); fp64 models keep fp64 (exactness checks).
        return logits if logits.dtype == torch.float64 else logits.float()

    def num_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())
