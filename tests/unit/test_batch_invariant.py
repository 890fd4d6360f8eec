"""Batch-invariant bf16 rows (`common/model/batch_invariant.py`): a row's bits do not depend
on the rows beside it, so every speculative mode's greedy tokens equal plain decoding's in
bf16, not only in fp32/fp64.

Bitwise, not close: the point is that a near-tie cannot flip between a tree batch and a
lone row. The tiny model is bf16 with a small init (flat next-token distributions, so
near-ties are common); without invariance one of its prompts differs from plain decoding
at its 35th token on this machine."""

from __future__ import annotations

import pytest
import torch
from specpipe.common.model.batch_invariant import (
    MAX_ROWS,
    RowInvariantLinear,
    StepRows,
    invariance_applies,
    linear_rows_invariant,
)
from specpipe.common.model.loading import load_stage
from specpipe.common.model.packed_linear import PackedLinear, packing_applies
from specpipe.common.model.synthetic import save_random_model
from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local, load_model
from specpipe.common.runtime.lockstep import LockstepGeneration
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.spec.messages import Activation
from specpipe.common.spec.options import DecodeOptions, Mode
from specpipe.services.config import StageConfig
from torch import nn

from specpipe.cli import build_parser

needs_bf16_kernels = pytest.mark.skipif(
    not packing_applies(torch.bfloat16, "cpu"), reason="this CPU has no oneDNN bf16 kernels"
)
BF16 = torch.bfloat16
CACHE = 4 << 20  # KV pool bytes per stage (the default would allocate gigabytes)
t = lambda *x: torch.tensor(x, dtype=torch.int64)  # noqa: E731


@pytest.fixture(scope="module")
def flat_qwen(tmp_path_factory: pytest.TempPathFactory):
    """A bf16-sized-up tiny Qwen2 (head_dim 64, GQA) with flat distributions."""
    return save_random_model(
        tmp_path_factory.mktemp("flat"),
        "qwen2",
        layers=2,
        hidden=512,
        heads=8,
        kv_heads=1,
        vocab=256,
        init=0.02,
        seed=3,
        max_positions=512,
    )


@pytest.fixture(scope="module")
def flat_draft(tmp_path_factory: pytest.TempPathFactory):
    return save_random_model(
        tmp_path_factory.mktemp("flat_draft"),
        "llama",
        layers=1,
        hidden=64,
        heads=2,
        kv_heads=1,
        vocab=256,
        init=0.02,
        seed=4,
        max_positions=512,
    )


def test_only_half_precision_on_a_cpu_is_made_invariant_by_default(llama_dir) -> None:
    assert invariance_applies(BF16, "cpu") and invariance_applies(torch.float16, "cpu")
    assert not invariance_applies(torch.float32, "cpu")
    assert not invariance_applies(BF16, "cuda")
    kinds = lambda m: {type(x) for x in m.modules()}  # noqa: E731
    assert RowInvariantLinear not in kinds(load_stage(llama_dir, dtype=torch.float32))
    assert not load_stage(llama_dir, dtype=torch.float32).rows_alone
    model = load_stage(llama_dir, dtype=BF16)
    assert model.rows_alone
    wrapped = [m for m in model.modules() if isinstance(m, RowInvariantLinear)]
    assert len(wrapped) == 5 * 4 + 1  # per layer qkv, o, gate_up, down; the head
    assert not load_stage(llama_dir, dtype=BF16, batch_invariant=False).rows_alone


def test_kernels_that_do_not_keep_rows_leave_the_model_batched(
    llama_dir, monkeypatch, caplog
) -> None:
    """Invariance rests on a kernel property measured on one CPU: where a shape's check
    fails on this machine, the model stays batched and says so."""
    from specpipe.common.model import batch_invariant

    checked: list[tuple[int, int]] = []

    def fails(layer, rows=0) -> bool:
        checked.append((layer.in_features, layer.out_features))
        return False

    monkeypatch.setattr(batch_invariant, "_kernels_checked", {})
    monkeypatch.setattr(batch_invariant, "linear_rows_invariant", fails)
    model = load_stage(llama_dir, dtype=BF16)
    assert not model.rows_alone and checked
    assert RowInvariantLinear not in {type(x) for x in model.modules()}
    assert "stay batched" in caplog.text
    monkeypatch.setattr(batch_invariant, "_kernels_checked", {})
    monkeypatch.setattr(batch_invariant, "linear_rows_invariant", lambda layer, rows=0: True)
    assert load_stage(llama_dir, dtype=BF16).rows_alone


def test_a_stage_started_with_no_batch_invariant_loads_shared_kernels(llama_dir) -> None:
    """`specpipe stage --no-batch-invariant` reaches the model the stage loads."""
    parse = lambda *a: StageConfig.from_args(build_parser().parse_args(["stage", *a]))  # noqa: E731
    for argv, alone in (((), True), (("--no-batch-invariant",), False)):
        config = parse("--model", str(llama_dir), "--dtype", "bfloat16", *argv)
        loaded = load_model(config.model, None, config.dtype, batch_invariant=config.invariance)
        assert bool(loaded.runtime.model.rows_alone) is alone


@needs_bf16_kernels
@pytest.mark.parametrize(("k", "n"), [(48, 80), (1024, 96), (8960, 64)])
@pytest.mark.parametrize("packed", [True, False])
def test_a_linear_gives_a_row_its_bits_in_any_batch(k, n, packed) -> None:
    """oneDNN keeps a row's bits in calls of 2-32 rows (checked), and the wrapper's rows
    in a call of any size equal the rows alone."""
    torch.manual_seed(k)
    linear = nn.Linear(k, n, bias=True).to(BF16)
    inner = PackedLinear(linear) if packed else linear
    assert linear_rows_invariant(inner)
    layer = RowInvariantLinear(inner)
    x = (torch.randn(3 * MAX_ROWS + 5, k) * 3).to(BF16)
    with torch.inference_mode():
        alone = torch.cat([layer(r[None]) for r in x])
        for rows in (1, 2, 7, MAX_ROWS, MAX_ROWS + 1, 2 * MAX_ROWS + 3, len(x)):
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows


@needs_bf16_kernels
def test_a_step_with_prefill_rows_keeps_them_in_one_call_and_its_tree_rows_alone() -> None:
    """Over `MAX_ROWS` rows with prefill rows among them (`StepRows`): the tree rows get
    their bits alone, the others those of one call over the whole step."""
    torch.manual_seed(1)
    linear = PackedLinear(nn.Linear(1024, 96).to(BF16))
    step = StepRows()
    layer = RowInvariantLinear(linear, step)
    x = (torch.randn(90, 1024) * 3).to(BF16)
    tree = torch.arange(3, 90, 2)  # 44 tree rows among 46 prefill rows
    step.count, step.tree = 90, tree
    with torch.inference_mode():
        got, whole = layer(x), linear(x)
        alone = torch.cat([layer.alone(r[None]) for r in x])
    assert torch.equal(got[tree], alone[tree])
    others = torch.ones(90, dtype=torch.bool)
    others[tree] = False
    assert torch.equal(got[others], whole[others])


def _prefill(stage: StageRuntime, rid: str, tokens: list[int]) -> None:
    stage.open(rid, 256)
    with torch.inference_mode():
        stage.forward(Activation(rid, torch.arange(len(tokens)), committed=True, tokens=t(*tokens)))


def _tree(rid: str, start: int, nodes: list[tuple[int, int, int, int]]) -> Activation:
    """Tree rows (node id, parent id, depth, token) at positions start + depth."""
    return Activation(
        rid,
        t(*[start + depth for _, _, depth, _ in nodes]),
        node_ids=t(*[n for n, _, _, _ in nodes]),
        parent_ids=t(*[p for _, p, _, _ in nodes]),
        tokens=t(*[tok for *_, tok in nodes]),
    )


@needs_bf16_kernels
@pytest.mark.parametrize(("siblings", "beside"), [(2, False), (40, True)])
def test_a_tree_row_has_the_bits_of_the_same_row_decoded_alone(flat_qwen, siblings, beside):
    """A chain of three tokens decoded one row a step (plain decoding) against the same
    chain inside one tree batch, with siblings at every level; `beside`: in the same
    step as another request's tree and a third's prefill chunk (40 siblings: a batch of
    over 32 rows)."""
    stage = StageRuntime(load_stage(flat_qwen, dtype=BF16), max_cache_bytes=CACHE)
    prompt = [5, 9, 3, 77, 12, 200, 31, 8, 8, 64, 1]
    p, chain = len(prompt), [40, 41, 42]
    for rid in ("alone", "tree", "other"):
        _prefill(stage, rid, prompt[: 7 if rid == "other" else p])
    stage.open("fresh", 256)
    with torch.inference_mode():
        lone = []
        for i, tok in enumerate(chain):
            out = stage.forward(_tree("alone", p, [(i, i - 1, i, tok)]))
            lone.append(stage.model.logits(out.hidden))
        # depth d: nodes 100 d + s under the chain's node of depth d - 1 (sibling 1)
        nodes = [
            (
                100 * d + s,
                100 * (d - 1) + 1 if d else -1,
                d,
                tok if s == 1 else (tok + 17 * s) % 256,
            )
            for d, tok in enumerate(chain)
            for s in range(siblings)
        ]
        acts = [_tree("tree", p, nodes)]
        if beside:
            acts.append(_tree("other", 7, [(0, -1, 0, 3), (1, 0, 1, 4)]))
            acts.append(Activation("fresh", torch.arange(6), committed=True, tokens=t(*range(6))))
        outs = stage.forward_many(acts)
        rows = [i for i, (n, *_r) in enumerate(nodes) if n % 100 == 1]
        tree_logits = stage.model.logits(outs[0].hidden[rows])
    assert torch.equal(tree_logits, torch.cat(lone))


def _generate(dep, prompt: list[int], mode: Mode, **opts) -> list[int]:
    options = DecodeOptions(max_new_tokens=40, **opts)
    return list(LockstepGeneration(dep.pipeline, dep.draft, prompt, mode, options).run())


@needs_bf16_kernels
def test_every_speculative_mode_decodes_plain_decodings_bf16_tokens(flat_qwen, flat_draft) -> None:
    plain = build_local(flat_qwen, 1, None, BF16, max_cache_bytes=CACHE)
    oracle = build_local(flat_qwen, 1, ORACLE_DRAFT, BF16, max_cache_bytes=CACHE)
    drafted = build_local(flat_qwen, 2, flat_draft, BF16, max_cache_bytes=CACHE)
    gen = torch.Generator().manual_seed(0)
    for length in (9, 14, 19):
        prompt = torch.randint(0, 255, (length,), generator=gen).tolist()
        want = _generate(plain, prompt, Mode.AUTOREGRESSIVE)
        assert _generate(oracle, prompt, Mode.SPECPIPE, width=3, layers_per_step=3) == want
        assert _generate(drafted, prompt, Mode.SPECPIPE, width=2, layers_per_step=3) == want
        assert _generate(drafted, prompt, Mode.SPECINFER, width=2, depth=3) == want
        assert _generate(drafted, prompt, Mode.PP) == want
