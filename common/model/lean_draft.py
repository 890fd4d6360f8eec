"""A draft's forward in fewer operations than the reference's bits allow (issue 34, point 6).

The draft only proposes: the target's stages verify every token it proposes, so its
forward need not give the reference's bits, only nearly its values (a proposal that
rounds otherwise is accepted or rejected by the target as any other). On a CPU in fp32,
where each operation of a tiny draft costs dispatch time rather than arithmetic, two
changes cut its forward by about a seventh (benchmarks/README.md, "Session 47: the
stage's and the draft's step"):

- **Each norm's weight folded into the projection it feeds** (the input norm into the
  q/k/v projection, the post-attention norm into the gate/up projection, the final norm
  into the head: ``W' = W * (w * sqrt(H))`` by input column), and the norm left as
  ``x / hypot(||x||, sqrt(H * eps))``, which is ``x * rsqrt(mean(x^2) + eps) / sqrt(H)``:
  3 operations where the reference's bits take 7 (`RMSNorm._cpu_fp32`).
- **Each projection's weight laid out [in, out]** (a parameter of the same values whose
  transpose is contiguous): `project`'s `mm` then reads it as it is, where MKL copies a
  transposed [out, in] weight at every call.

RoPE's rotation folded into the q/k/v projection as well (each query and key head's rows
rolled by half a head as extra outputs, the rotation then `mul_` and `addcmul_`, no
`roll`) was measured and not kept: 1.5-3% less at one request, 2.5% more at 8 (the wider
projection), in one process taking turns.

Only for a model of plain `nn.Linear` layers, fp32, on a CPU (`lean_applies`); any other
draft is left as it is. The target's stages never come here (`loader.load_draft` alone
calls it, on a model of its own).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .layers import RMSNorm, StageModel
from .packed_linear import PackedLinear


class FoldedRMSNorm(RMSNorm):
    """An RMSNorm whose weight went into the projection after it (`fold`): ``x`` over
    ``hypot(||x||, sqrt(H * eps))``, the reference's normalization over ``sqrt(H)``
    (a draft's own rounding; `sqrt(H)` rides in the folded weight). Its weight is
    left ones, for whoever reads it."""

    _root_eps: Tensor

    def forward(self, x: Tensor) -> Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        return torch.div(x, torch.hypot(norm, self._root_eps))


def lean_applies(model: StageModel) -> bool:
    """Whether `lean_draft` changes `model`: fp32 on a CPU, every linear layer plain."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    plain = all(type(m) is nn.Linear for m in linears) and not any(
        isinstance(m, PackedLinear) for m in model.modules()
    )
    return model.device.type == "cpu" and model.dtype == torch.float32 and plain


def lean_draft(model: StageModel) -> StageModel:
    """`model` (a draft's, of its own: its weights are replaced) with its norms folded
    and its projections laid out [in, out] where `lean_applies`; as it is otherwise."""
    if not lean_applies(model):
        return model
    with torch.inference_mode(False), torch.no_grad():
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            _fold(layer.input_layernorm, attn.qkv_proj)
            _fold(layer.post_attention_layernorm, mlp.gate_up_proj)
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                _in_out(linear)
        if model.norm is not None and model.lm_head is not None:
            _fold(model.norm, model.lm_head)
            _in_out(model.lm_head)
    return model


def _fold(norm: RMSNorm, linear: nn.Linear) -> None:
    """`norm`'s weight (and sqrt(H)) into `linear`'s input columns, as a new weight (a
    tied head's embedding keeps its own), and `norm` made a `FoldedRMSNorm`."""
    weight = norm.weight.detach()
    dim = weight.numel()
    scale = weight * math.sqrt(dim)
    folded = linear.weight.detach() * scale
    linear.weight = nn.Parameter(folded, requires_grad=False)
    norm.weight = nn.Parameter(torch.ones_like(weight), requires_grad=False)
    norm.__class__ = FoldedRMSNorm
    norm._root_eps = torch.tensor(math.sqrt(dim * norm.eps), dtype=torch.float32)


def _in_out(linear: nn.Linear) -> None:
    """`linear`'s weight of the same values, stored [in, out] (its transpose contiguous)."""
    weight = linear.weight.detach()
    linear.weight = nn.Parameter(weight.t().contiguous().t(), requires_grad=False)
