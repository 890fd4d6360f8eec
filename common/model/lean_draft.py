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
- **RoPE's rotation folded into the q/k/v projection**: each query and key head's rows
  again, rolled by half a head (`rotate_half`'s permutation; its sign rides in `sin`), as
  extra output columns, so a layer's rotation is ``qk * cos + rolled * sin`` in 2
  operations on the projection's output (`LeanAttention`), where the reference's bits
  take a `roll` (3 dispatches) and 3 more.
- **Each projection's weight laid out [in, out]** (a parameter of the same values whose
  transpose is contiguous): `project`'s `mm` then reads it as it is, where MKL copies a
  transposed [out, in] weight at every call.

Only for a model of plain `nn.Linear` layers, fp32, on a CPU (`lean_applies`); any other
draft is left as it is. The target's stages never come here (`loader.load_draft` alone
calls it, on a model of its own).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .layers import Attention, RMSNorm, StageModel, project
from .paged_attention import StepAttention, attend_layer


class FoldedRMSNorm(RMSNorm):
    """An RMSNorm whose weight went into the projection after it (`fold`): ``x`` over
    ``hypot(||x||, sqrt(H * eps))``, the reference's normalization over ``sqrt(H)``
    (a draft's own rounding; `sqrt(H)` rides in the folded weight). Its weight is
    left ones, for whoever reads it."""

    _root_eps: Tensor

    def forward(self, x: Tensor) -> Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        return torch.div(x, torch.hypot(norm, self._root_eps))


class LeanAttention(Attention):
    """Attention whose q/k/v projection also gives its query and key heads rolled by half
    a head (`_fold_rotation`): columns [q | k | v | q rolled | k rolled]."""

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, step: StepAttention | None, layer: int
    ) -> Tensor:
        n, d = x.shape[0], self.cfg.head_dim
        heads, kv_heads = self.cfg.num_heads, self.cfg.num_kv_heads
        modules = self._modules
        qkv = project(modules["qkv_proj"], x).view(n, 2 * heads + 3 * kv_heads, d)
        qk, v, rolled = qkv.split_with_sizes((heads + kv_heads, kv_heads, heads + kv_heads), 1)
        qk.mul_(cos).addcmul_(rolled, sin)  # in place: the rotated K stays beside V
        if step is None:  # one causal sequence, no cache
            q, k = qk.split_with_sizes((heads, kv_heads), 1)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                is_causal=True,
                enable_gqa=True,
            )[0].transpose(0, 1)
            return project(modules["o_proj"], out.reshape(n, heads * d))
        q, kv = qkv.narrow(1, 0, heads + 2 * kv_heads).split_with_sizes((heads, 2 * kv_heads), 1)
        step.kv[layer].index_copy_(0, step.batch.write_slots, kv)
        return project(modules["o_proj"], attend_layer(q, step, layer))


def lean_applies(model: StageModel) -> bool:
    """Whether `lean_draft` changes `model`: fp32 on a CPU, every linear layer plain."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    plain = all(type(m) is nn.Linear for m in linears) and not any(
        type(m).__name__ == "PackedLinear" for m in model.modules()
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
            _fold_rotation(attn)
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


def _fold_rotation(attn: Attention) -> None:
    """The q/k/v projection's query and key rows again, each head's rolled by half a head
    (what `torch.roll(x, d // 2, -1)` does to its outputs), as extra outputs; `attn` made
    a `LeanAttention`."""
    cfg, linear = attn.cfg, attn.qkv_proj
    d, qk = cfg.head_dim, (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim
    weight = linear.weight.detach()
    rolled = weight[:qk].reshape(-1, d, weight.shape[1]).roll(d // 2, 1).reshape(qk, -1)
    linear.weight = nn.Parameter(torch.cat([weight, rolled]), requires_grad=False)
    if linear.bias is not None:
        bias = linear.bias.detach()
        turned = bias[:qk].reshape(-1, d).roll(d // 2, 1).reshape(qk)
        linear.bias = nn.Parameter(torch.cat([bias, turned]), requires_grad=False)
    linear.out_features = linear.weight.shape[0]
    attn.__class__ = LeanAttention


def _in_out(linear: nn.Linear) -> None:
    """`linear`'s weight of the same values, stored [in, out] (its transpose contiguous)."""
    weight = linear.weight.detach()
    linear.weight = nn.Parameter(weight.t().contiguous().t(), requires_grad=False)
