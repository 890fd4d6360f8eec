"""A compact Llama-family decoder (Llama, Mistral, SmolLM, Qwen2) that runs as pipeline stages.

A `StageModel` owns decoder layers ``[start, end)``; the first stage also owns the token
embedding, the last also the final norm and LM head.

Several requests run in one forward (SpecPipe-DB): their rows are concatenated, so the
projections and the MLP are one GEMM over all rows, and attention is one call per layer
for all of them (`PagedBatch`, `paged_attention.py`): each request's keys are gathered
from the stage's paged KV cache into a padded batch, and a mask built on the device says
which keys each row sees (its committed prefix, causal for a prefill chunk; its tree
ancestors and itself for tree rows); a step too large for its memory budget runs in
parts, query blocks and key blocks. On CUDA a step of one part attends through
FlexAttention over the keys unpadded instead (`flex_attention.py`). Why padded SDPA on a
CPU rather than FlexAttention or a loop over requests: docs/architecture.md, "5. The
request controller and its executors", "The stage engine".

Each operation of a layer is a launch on an accelerator and dispatch time on a CPU, so a
layer issues as few dispatches as give the reference's bits (25 aten ops in fp32 where a
norm is one `torch.rms_norm` call; 37 on a CPU, where its 22 hidden dispatches are 7:
session 46; what they are and what they cost: benchmarks/README.md, "A lean forward,
continued"): what every layer of a step shares (RoPE's cos and sin, the attention's views) is made once per step, the
submodules are looked up in `_modules` (`nn.Module.__getattr__` costs about 0.5 us a
look-up, eight a layer) and called through `.forward` (`nn.Module.__call__`'s hook
handling costs about 1.5 us a call, nine calls a layer; this model registers no hooks),
and the projections through `project` (the mm/addmm `F.linear` itself calls, on a kept
transposed weight). Session 44 measured what is left (benchmarks/README.md, "Session 44:
the forward"): the operations themselves, not the Python around them (the whole layer
inlined into one function cost the same), so the rest is cheaper calls of the same
kernels: `torch._fused_rms_norm`, split_with_sizes for chunk, in-place products and
residual adds on fresh tensors, slotted per-step dataclasses.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .batch_invariant import StepRows
from .config import ModelConfig
from .paged_attention import PagedBatch, StepAttention, attend_layer, step_attention
from .partition import LayerRange


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # the mean's divisor and eps as fp32 0-dim CPU tensors (plain attributes: neither
        # saved nor converted; on the CPU even where the model is built on the meta
        # device), for `_cpu_fp32`; made outside inference mode, so that a forward that
        # records autograd may use them too
        with torch.inference_mode(False), torch.no_grad():
            self._count = torch.tensor(float(dim), device="cpu")
            self._eps = torch.tensor(eps, dtype=torch.float32, device="cpu")

    def forward(self, x: Tensor) -> Tensor:
        # The reference normalizes in fp32, casts back to the model's dtype, then scales by
        # the weight, through `torch.rms_norm` (F.rms_norm without its Python frame; one
        # fused kernel where the device has one, CUDA; the reference's operations, to the
        # bit, on a CPU), in as few calls as give the same bits
        # (tests/unit/test_lean_forward.py): an fp32 model's norm is one call with the
        # weight; a half one's is torch.rms_norm's own fp32 upcast and cast back, then the
        # weight; an fp64 one's is cast down to fp32 and back, as the reference's is. The
        # weight is read from the parameter dict (no `nn.Module.__getattr__`).
        weight = self._parameters["weight"]
        if x.dtype == torch.float32:
            if x.is_cpu:
                return self._cpu_fp32(x, weight)
            return _rms_norm(x, weight.shape, weight, self.eps)[0]
        if x.dtype in (torch.bfloat16, torch.float16):
            return weight * _rms_norm(x, weight.shape, None, self.eps)[0]
        normed = _rms_norm(x.float(), weight.shape, None, self.eps)[0]
        return weight * normed.to(x.dtype)

    def _cpu_fp32(self, x: Tensor, weight: Tensor) -> Tensor:
        """An fp32 norm on a CPU: the operations `torch.rms_norm`'s CPU composite runs
        (pow(2), which is x * x; mean, which is sum then div_ by the count; add_ eps;
        rsqrt; times x; times the weight), on the same kernels, so the same bits
        (tests/unit/test_lean_forward.py), in 7 dispatches instead of its 22: its count
        and eps are Python scalars, and each becomes a tensor converted to fp32 (`to`,
        `_to_copy`, `empty_strided`, `copy_`) at every call, where these are kept fp32
        0-dim tensors. 7.2 against 8.8-9.1 us a norm of [4, 64] rows, 17 norms a draft
        step (benchmarks/README.md, "Session 46: the draft's step"). Not on CUDA, where
        the composite is one fused kernel."""
        squares = torch.sum(torch.mul(x, x), -1, keepdim=True)
        scale = squares.div_(self._count).add_(self._eps).rsqrt_()
        return torch.mul(x, scale).mul_(weight)


def _rms_norm_of(
    x: Tensor, shape: tuple[int, ...], weight: Tensor | None, eps: float
) -> tuple[Tensor]:
    return (torch.rms_norm(x, shape, weight, eps),)


# `torch.rms_norm` with an eps given is `torch._fused_rms_norm`'s output (its first; the
# second is 1/rms), which costs it an aten call and about 1 us (of 8) on a CPU; the
# public call where a torch has no such function.
_rms_norm = getattr(torch, "_fused_rms_norm", _rms_norm_of)


@cache
def _rope_constants(head_dim: int, theta: float, device: torch.device) -> Tensor:
    """RoPE's inverse frequencies, both halves [1, 1, head_dim], the first half negated,
    once per shape and device. Made outside inference mode, so that a forward that
    records autograd (a test's) may use them too."""
    with torch.inference_mode(False), torch.no_grad():
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
        inv_freq = 1.0 / (theta ** (exponents / head_dim))
        signed = torch.cat((-inv_freq, inv_freq))
    return signed.view(1, 1, -1)


def rope_cos_sin(
    positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos and sign-folded sin [n, 1, head_dim] of `positions`, once per step for every
    layer and head (HF's rotate-half convention, with rotate_half's negation moved into
    sin's first half: `apply_rope`).

    The negation rides on the angles: p * -f == -(p * f) exactly, cos is even and sin odd
    to the bit (tests/unit/test_lean_forward.py), so cos(p * ±f) is HF's cos and
    sin(p * ±f) its sin with the first half negated, in 4 operations instead of 6."""
    # int64 positions times fp32: the product converts them as `.float()` would
    angles = positions.reshape(-1, 1, 1) * _rope_constants(head_dim, theta, positions.device)
    cos, sin = angles.cos(), angles.sin()
    return (cos, sin) if dtype == torch.float32 else (cos.to(dtype), sin.to(dtype))


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [n, heads, head_dim]; cos and sign-folded sin: [n, 1, head_dim] (`rope_cos_sin`).

    HF's ``x * cos + rotate_half(x) * sin``, rotate_half(x) = cat(-x2, x1), to the bit:
    (-x2) * s == x2 * (-s) exactly, so the rotation is a roll of the halves. The same
    products and sum, in place on the two fresh tensors: an allocation less each."""
    return (x * cos).add_(x.roll(x.shape[-1] // 2, -1).mul_(sin))


def apply_rope_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`apply_rope` in place on `x` (the same products and sum, to the bit): a step's
    rotated K stays beside its V in the q/k/v projection's output, so that both are
    written to the cache in one operation (`Attention.forward`)."""
    rolled = x.roll(x.shape[-1] // 2, -1).mul_(sin)
    return x.mul_(cos).add_(rolled)


def project(layer: nn.Module, x: Tensor) -> Tensor:
    """`layer(x)` for the model's projections (an `nn.Linear`, or a `PackedLinear`), without
    `nn.Module`'s call and attribute look-ups, on the layer's own parameters (read from
    its parameter dict, so always the current ones).

    Rows [n, in] without autograd: the `mm` (no bias) or `addmm` that `F.linear` itself
    calls for them, on a transposed view of the weight kept with the layer
    (`_transposed`), since `aten::linear`'s own `t()` and checks cost a fifth of a small
    linear on a CPU (same kernel, same bits; tests/unit/test_lean_forward.py)."""
    if type(layer) is nn.Linear:
        params = layer._parameters
        weight, bias = params["weight"], params["bias"]
        if x.dim() != 2 or torch.is_grad_enabled():
            return F.linear(x, weight, bias)
        if bias is None:
            return torch.mm(x, _transposed(layer, weight))
        return torch.addmm(bias, x, _transposed(layer, weight))
    return layer.forward(x)


def _transposed(layer: nn.Module, weight: Tensor) -> Tensor:
    """`weight.t()`, made once and kept in the layer's `__dict__` (not a buffer: neither
    saved nor converted) while it views the weight's current storage: a new weight
    (`.to()`, a parameter replaced) has another address, since the old view keeps the
    old storage alive, and is viewed afresh; an in-place copy is seen through the view.
    Made outside inference mode (and without autograd), so that it may serve forwards
    in and out of it."""
    view = layer.__dict__.get("_weight_t")
    if view is None or view.data_ptr() != weight.data_ptr():
        with torch.inference_mode(False), torch.no_grad():
            view = weight.detach().t()
        layer.__dict__["_weight_t"] = view
    return view


class Attention(nn.Module):
    """Self-attention with one fused q/k/v projection (the checkpoint's three matrices
    stacked, `loading.fuse_checkpoint`): one GEMM and one RoPE over the query and key
    heads together, since each operation is a launch on an accelerator and dispatch
    time on a CPU."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=cfg.o_bias)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, step: StepAttention | None, layer: int
    ) -> Tensor:
        n, d = x.shape[0], self.cfg.head_dim
        heads, kv_heads = self.cfg.num_heads, self.cfg.num_kv_heads
        modules = self._modules
        qkv = project(modules["qkv_proj"], x).view(n, heads + 2 * kv_heads, d)
        # split_with_sizes, not Tensor.split (its Python frame was 3% of the draft's samples)
        qk, v = qkv.split_with_sizes((heads + kv_heads, kv_heads), 1)
        if step is None:  # one causal sequence, no cache
            q, k = apply_rope(qk, cos, sin).split_with_sizes((heads, kv_heads), 1)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                is_causal=True,
                enable_gqa=True,
            )[0].transpose(0, 1)
            return project(modules["o_proj"], out.reshape(n, heads * d))
        # RoPE in place, so the rotated K stays beside V: both written in one operation
        apply_rope_(qk, cos, sin)
        q, kv = qkv.split_with_sizes((heads, 2 * kv_heads), 1)
        step.kv[layer].index_copy_(0, step.batch.write_slots, kv)
        return project(modules["o_proj"], attend_layer(q, step, layer))


class MLP(nn.Module):
    """SwiGLU with one fused gate/up projection (gate rows first, then up)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.halves = (cfg.intermediate_size, cfg.intermediate_size)

    def forward(self, x: Tensor) -> Tensor:
        modules = self._modules
        # split_with_sizes, not chunk (which calls split, which calls it: 0.5 us a layer)
        gate, up = project(modules["gate_up_proj"], x).split_with_sizes(self.halves, -1)
        return project(modules["down_proj"], F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, step: StepAttention | None, layer: int
    ) -> Tensor:
        modules = self._modules
        normed = modules["input_layernorm"].forward(x)
        # the residual adds in place into the sublayers' fresh outputs (a + b == b + a to
        # the bit; an allocation less each; this model computes, it does not train)
        x = modules["self_attn"].forward(normed, cos, sin, step, layer).add_(x)
        return modules["mlp"].forward(modules["post_attention_layernorm"].forward(x)).add_(x)


_AT_LEAST_FP32 = (torch.float32, torch.float64)  # logits kept as they are (no `.float()` op)


class StageModel(nn.Module):
    """Layers ``[start, end)`` of a model; embedding on the first stage, norm + head on the last."""

    rows_alone: StepRows | None = None  # batch-invariant rows (`batch_invariant.py`)

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
        # the gather `nn.Embedding.forward` ends in, without its Python frames (1.3 of 3 us);
        # this embedding has no max_norm, and padding_idx only shapes gradients
        return torch.embedding(self.embed_tokens._parameters["weight"], token_ids)

    def forward(self, hidden: Tensor, positions: Tensor) -> Tensor:
        """One causal sequence `hidden` [n, H] at `positions`, without a cache (a reference
        for tests and checks; serving goes through `forward_batch`)."""
        return self._layers(hidden, positions, None)

    def forward_batch(self, hidden: Tensor, positions: Tensor, batch: PagedBatch) -> Tensor:
        """The rows of several requests, concatenated in `hidden` [N, H] at `positions`
        [N]; `batch` says whose they are, where their K/V go and what they attend to."""
        return self._layers(hidden, positions, batch)

    def _layers(self, hidden: Tensor, positions: Tensor, batch: PagedBatch | None) -> Tensor:
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, hidden.dtype)
        step = None if batch is None else step_attention(batch, self.cfg.num_heads, self.rows_alone)
        for i, layer in enumerate(self.layers):
            hidden = layer.forward(hidden, cos, sin, step, i)
        return hidden

    def logits(self, hidden: Tensor) -> Tensor:
        if self.norm is None or self.lm_head is None:
            raise RuntimeError("only the last stage computes logits")
        logits = project(self.lm_head, self.norm.forward(hidden))
        # At least fp32 (sampling needs it); fp64 models keep fp64 (exactness checks).
        return logits if logits.dtype in _AT_LEAST_FP32 else logits.float()

    def num_bytes(self) -> int:
        """Weight bytes, packed ones (`packed_linear`, buffers) included."""
        tensors = [*self.parameters(), *self.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)
