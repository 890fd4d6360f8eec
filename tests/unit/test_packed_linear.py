"""bf16 weights packed for oneDNN on a CPU (`common/model/packed_linear.py`): every linear
of a bf16 CPU model is packed, nothing else is, and a packed model computes what the
plain one does (to bf16 rounding: oneDNN may sum in another order than `F.linear`)."""

from __future__ import annotations

import pytest
import torch
from specpipe.common.model.layers import StageModel
from specpipe.common.model.loading import load_stage
from specpipe.common.model.packed_linear import PackedLinear, pack_linears, packing_applies
from specpipe.common.model.partition import LayerRange
from specpipe.common.runtime.loader import build_local
from specpipe.common.runtime.lockstep import LockstepGeneration
from specpipe.common.spec.options import DecodeOptions, Mode
from torch import nn

from .test_model import run_chain

needs_bf16_kernels = pytest.mark.skipif(
    not packing_applies(torch.bfloat16, "cpu"), reason="this CPU has no oneDNN bf16 kernels"
)


def linears(model: StageModel) -> tuple[int, int]:
    """(plain nn.Linear, PackedLinear) modules of `model`."""
    kinds = [type(m) for m in model.modules()]
    return kinds.count(nn.Linear), kinds.count(PackedLinear)


def test_only_bf16_on_a_cpu_is_packed() -> None:
    assert not packing_applies(torch.float32, "cpu")
    assert not packing_applies(torch.float64, "cpu")
    assert not packing_applies(torch.bfloat16, "meta")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float_models_keep_their_plain_linears(llama_dir, dtype) -> None:
    model = load_stage(llama_dir, dtype=dtype)
    assert linears(model) == (5 * 4 + 1, 0)  # per layer: qkv, o, gate_up, down


@needs_bf16_kernels
@pytest.mark.parametrize("layers", [LayerRange(0, 2, 5), LayerRange(2, 5, 5)])
def test_a_bf16_stage_packs_every_linear_and_computes_what_plain_weights_do(
    llama_dir, layers
) -> None:
    packed = load_stage(llama_dir, layers, dtype=torch.bfloat16)
    plain = load_stage(llama_dir, layers, dtype=torch.bfloat16, pack=False)
    head = 1 if layers.is_last else 0
    assert linears(packed) == (0, layers.size * 4 + head)
    assert linears(plain) == (layers.size * 4 + head, 0)
    assert packed.num_bytes() == plain.num_bytes()
    assert packed.dtype == torch.bfloat16
    torch.manual_seed(0)
    hidden = torch.randn(70, packed.cfg.hidden_size, dtype=torch.bfloat16)  # > the pack hint
    for rows in (1, 7, 70):
        x, positions = hidden[:rows], torch.arange(rows)
        want, got = plain(x, positions), packed(x, positions)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert ((got.float() - want.float()).norm() / want.float().norm()) < 2e-2


@needs_bf16_kernels
def test_packed_logits_stay_close_to_float32(llama_dir) -> None:
    tokens = torch.tensor([1, 2, 3, 4, 5, 6])
    f32 = run_chain([load_stage(llama_dir)], tokens)
    bf16 = run_chain([load_stage(llama_dir, dtype=torch.bfloat16)], tokens)
    assert ((bf16 - f32).norm() / f32.norm()) < 0.05


@needs_bf16_kernels
def test_pack_linears_leaves_no_plain_linear_and_keeps_biases(qwen_dir) -> None:
    model = load_stage(qwen_dir, dtype=torch.bfloat16, pack=False)
    biases = {n: m.bias for n, m in model.named_modules() if type(m) is nn.Linear}
    assert any(b is not None for b in biases.values())  # Qwen2's q/k/v carry biases
    assert pack_linears(model) == len(biases)
    after = dict(model.named_modules())
    assert all(after[n].bias is b for n, b in biases.items())
    assert linears(model) == (0, len(biases))


@needs_bf16_kernels
def test_the_batched_engine_decodes_with_packed_weights(qwen_dir) -> None:
    """Paged attention, prefill chunks and one-row steps, through two bf16 stages."""
    dep = build_local(qwen_dir, 2, dtype=torch.bfloat16)
    assert all(linears(s.model)[0] == 0 for s in dep.pipeline.stages)
    opts = DecodeOptions(max_new_tokens=12)
    out = LockstepGeneration(
        dep.pipeline, dep.draft, list(range(3, 90)), Mode.AUTOREGRESSIVE, opts
    ).run()
    assert len(out) == 12
