"""bf16 linear layers on a CPU with their weights packed once for oneDNN.

Why: torch's bf16 `F.linear` on a CPU hands oneDNN the weight in its plain [out, in]
layout, and oneDNN reorders it into the blocked layout its AMX / AVX512-BF16 kernels read
at every call, so each decode step reads every weight twice and writes it once. Packing
once at load time (what vLLM's CPU build does with its oneDNN handles, and Inductor's
freezing pass with `mkldnn._linear_pointwise`) leaves one read per step, which is the
whole cost of decoding a small batch. Measured on this machine's Sapphire Rapids cores,
Qwen2.5-1.5B's 28 layers and head, one row: 350 -> 253 ms at one thread, 175 -> 137 ms
at two (benchmarks/README.md, "The stage engine", "Packed bf16 weights").

fp32 keeps `F.linear` (MKL's sgemv was faster than oneDNN's packed fp32 path here: 220
against 253 ms), and so do fp64 (the exactness checks) and every other device.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

# The row count oneDNN chooses the weight's blocked layout for. 64 serves one row as
# fast as a layout chosen for one row (138 vs 136 ms per model step, two threads), and
# a 64-512 row prefill chunk 2-4x faster than one chosen for a single row.
PACK_HINT_ROWS = 64


def packing_applies(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether `pack_linears` packs a model of `dtype` on `device`."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight held in oneDNN's blocked layout (a buffer, not a
    parameter: it cannot be trained or loaded into, only computed with)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_HINT_ROWS)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` by a `PackedLinear`, in place; returns how many.
    The plain weights are dropped, so the model's memory does not grow."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
