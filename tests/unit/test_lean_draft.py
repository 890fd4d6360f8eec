"""The draft's lean forward (`common/model/lean_draft.py`): nearly the reference's values
in fewer operations, only where it applies, never for the oracle draft."""

from __future__ import annotations

import pytest
import torch
from specpipe.common.model.layers import RMSNorm
from specpipe.common.model.lean_draft import FoldedRMSNorm, lean_applies, lean_draft
from specpipe.common.model.loading import load_stage
from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local, load_draft
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.spec.messages import Activation


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        positions = torch.arange(tokens.numel())
        return model.logits(model.forward(model.embed(tokens), positions))


@pytest.mark.parametrize("model", ["llama_dir", "qwen_dir"])  # qwen2: q/k/v bias, GQA, tied
def test_a_lean_draft_computes_nearly_the_reference(model: str, request) -> None:
    model_dir = request.getfixturevalue(model)
    ref = load_stage(model_dir, None, torch.float32)
    lean = lean_draft(load_stage(model_dir, None, torch.float32))
    assert lean_applies(ref)
    norms = [m for m in lean.modules() if isinstance(m, RMSNorm)]
    assert norms and all(type(m) is FoldedRMSNorm for m in norms)
    # every projection's transpose is contiguous: `project`'s mm reads it as it is
    linears = [m for m in lean.modules() if type(m) is torch.nn.Linear]
    assert all(m.weight.t().is_contiguous() for m in linears)
    tokens = torch.randint(0, ref.cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(3))
    a, b = _logits(ref, tokens), _logits(lean, tokens)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    # and through the paged cache, as the draft serves: a prompt, then a tree layer
    runtime = load_draft(model_dir, torch.float32)
    stage = StageRuntime(ref)
    for rt in (stage, runtime.runtime):
        rt.open("r", 64)
    prompt = Activation("r", torch.arange(20), committed=True, tokens=tokens[:20])
    layer = Activation(
        "r", torch.tensor([20, 20, 21]), node_ids=torch.tensor([1, 2, 3]),
        parent_ids=torch.tensor([-1, -1, 1]), tokens=tokens[20:23],
    )  # fmt: skip
    outs = [[rt.forward(act).hidden for act in (prompt, layer)] for rt in (stage, runtime.runtime)]
    for got, want in zip(outs[1], outs[0], strict=True):
        # the residual stream grows to hundreds: its rounding, relative to its scale
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_a_draft_that_is_not_fp32_on_a_cpu_keeps_its_forward(llama_dir) -> None:
    model = load_stage(llama_dir, None, torch.float64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert not lean_applies(model)
    assert lean_draft(model) is model
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_oracle_draft_is_the_target_to_the_bit(llama_dir) -> None:
    dep = build_local(llama_dir, 2, ORACLE_DRAFT, torch.float32)
    assert dep.draft is not None
    assert not any(type(m) is FoldedRMSNorm for m in dep.draft.runtime.model.modules())
    lean = load_draft(llama_dir, torch.float32)
    assert any(type(m) is FoldedRMSNorm for m in lean.runtime.model.modules())
