"""A verification round (`verify_many`) of several requests whose walks go K = 2-3 levels
down makes one LM head call for all of them (the head's matmuls counted with a
TorchDispatchMode) and reads the drawn tokens back once per level, not per request or
per draw; on the meta device (no values) nothing else is read back."""

from __future__ import annotations

import pytest
import torch
from specpipe.common.model.loading import load_stage
from specpipe.common.model.partition import LayerRange
from specpipe.common.runtime import verifier as verifier_module
from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local
from specpipe.common.runtime.lockstep import LockstepEngine, LockstepGeneration
from specpipe.common.runtime.verifier import RequestVerifier, verify_many
from specpipe.common.spec.messages import Activation
from specpipe.common.spec.options import DecodeOptions, Mode
from specpipe.common.spec.sampling import SamplingParams, draw_index
from specpipe.common.spec.verify import VerifySpec, draw_logits, rows_logprobs, took

from .test_stage_step import DeviceOps

PROMPT = 6
PREFIX = list(range(1, PROMPT))  # committed before the first root (the Open's)
WIDTH = 3
MATMULS = {"mm", "addmm", "bmm", "matmul"}


class HeadCalls(DeviceOps):
    """DeviceOps, and the matmuls with the head's weight ([vocab, hidden]) in them."""

    def __init__(self, device: str, vocab: int) -> None:
        super().__init__(device)
        self.vocab, self.head_matmuls = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in MATMULS and any(
            isinstance(a, torch.Tensor) and self.vocab in a.shape for a in args
        ):
            self.head_matmuls += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def tree(model, spec: VerifySpec, k: int, seed: int) -> tuple[Activation, list[int], list]:
    """One request's rows: a root, then per level WIDTH children of the node the walk
    reaches, one with the token drawn there (so the walk goes k levels down); and the
    tokens the walk draws, drawn one at a time on the host (`draw_logits`, the rules after
    the prefix, the root's token and each draw), with their logprobs if asked for."""
    g = torch.Generator().manual_seed(seed)
    dim = model.cfg.hidden_size
    ids, parents, tokens, positions, drawn, logprobs = [], [], [], [], [], []
    hidden = torch.randn(1 + WIDTH * (k - 1), dim, generator=g, dtype=model.norm.weight.dtype)
    parent, token = -1, 5
    rules = spec.rules(PREFIX)
    if rules.counts is not None:
        rules.counts.add(token, output=False)  # the first root's token
    for level in range(k):
        first = len(ids)
        for j in range(1 if level == 0 else WIDTH):
            ids.append(len(ids))
            parents.append(parent)
            tokens.append((token + j) % model.cfg.vocab_size)
            positions.append(PROMPT - 1 + level)
        with torch.no_grad():
            logits = model.logits(hidden[first : first + 1])[0]
        position = spec.draw_position(positions[first])
        token = int(
            draw_index(draw_logits(logits, spec, position, None, rules), spec.sampling, position)
        )
        took(token, None, rules)
        if spec.logprobs is not None:
            logprobs += rows_logprobs(logits[None], [token], spec.logprobs)
        drawn.append(token)
        parent = first
    act = Activation(
        f"r{seed}",
        torch.tensor(positions),
        node_ids=torch.tensor(ids),
        parent_ids=torch.tensor(parents),
        hidden=hidden,
        row_tokens=torch.tensor(tokens),
    )
    return act, drawn, logprobs


SPECS = [
    VerifySpec(SamplingParams(), output_start=PROMPT),
    VerifySpec(SamplingParams(temperature=0.8, seed=3), output_start=PROMPT, logprobs=2),
    VerifySpec(
        SamplingParams(frequency_penalty=0.5, logit_bias={3: 2.0}), output_start=PROMPT, logprobs=0
    ),
]


@pytest.mark.parametrize("k", [2, 3])
def test_a_round_makes_one_head_call_and_one_read_per_level(llama_dir, k, monkeypatch) -> None:
    # fp64: the reference computes each row's logits alone, the round all in one matmul
    model = load_stage(llama_dir, LayerRange(2, 5, 5), torch.float64)
    specs = SPECS * 2  # six requests: greedy, seeded, with penalties and a bias
    trees = [tree(model, spec, k, seed) for seed, spec in enumerate(specs)]
    reads: list[int] = []
    real_read = verifier_module.read_tokens

    def counting_read(tokens: torch.Tensor) -> list[int]:
        reads.append(tokens.numel())
        return real_read(tokens)

    monkeypatch.setattr(verifier_module, "read_tokens", counting_read)
    verifiers = [
        RequestVerifier(a.request_id, s, model.logits, PREFIX)
        for (a, _, _), s in zip(trees, specs, strict=True)
    ]
    with torch.no_grad(), HeadCalls("cpu", model.cfg.vocab_size) as counter:
        found = verify_many(
            list(zip(verifiers, [a for a, _, _ in trees], strict=True)), model.logits
        )
    assert counter.head_matmuls == 1
    assert not counter.syncing, counter.syncing
    assert reads == [len(specs)] * k  # one read per level, every request in it
    # the walks drew what each request's draws give, all k levels down
    assert [f[0].tokens for f in found] == [tuple(drawn) for _, drawn, _ in trees]
    # with the logprobs of the raw logits, all draws' in one pass per top
    for f, (_, _, logprobs), spec in zip(found, trees, specs, strict=True):
        if spec.logprobs is None:
            assert f[0].logprobs is None
            continue
        assert len(f[0].logprobs) == len(logprobs) == k
        for got, want in zip(f[0].logprobs, logprobs, strict=True):
            assert got.logprob == pytest.approx(want.logprob, abs=1e-9)
            assert got.top_ids == want.top_ids
            assert got.top_logprobs == pytest.approx(want.top_logprobs, abs=1e-9)
    # and what each request verified alone gives
    for (act, drawn, _), spec in zip(trees, specs, strict=True):
        (alone,) = RequestVerifier(act.request_id, spec, model.logits, PREFIX).on_output(act)
        assert alone.tokens == tuple(drawn)


def test_a_round_on_the_meta_device_reads_only_the_drawn_tokens(llama_dir, monkeypatch) -> None:
    """On the meta device tensors have no values: any read back but the drawn tokens'
    (answered here with the tokens the tree holds) would fail."""
    k, requests = 3, 4
    model = load_stage(llama_dir, LayerRange(2, 5, 5), torch.float32)
    spec = SPECS[0]
    trees = [tree(model, spec, k, seed) for seed in range(requests)]
    model = model.to("meta")
    levels = iter(range(k))

    def on_the_tree(tokens: torch.Tensor) -> list[int]:
        assert tokens.device.type == "meta"
        level = next(levels)
        return [drawn[level] for _, drawn, _ in trees]

    monkeypatch.setattr(verifier_module, "read_tokens", on_the_tree)
    for act, _, _ in trees:
        act.hidden = act.hidden.to("meta")
    verifiers = [RequestVerifier(a.request_id, spec, model.logits, PREFIX) for a, _, _ in trees]
    with torch.no_grad(), HeadCalls("meta", model.cfg.vocab_size) as counter:
        found = verify_many(
            list(zip(verifiers, [a for a, _, _ in trees], strict=True)), model.logits
        )
    assert counter.head_matmuls == 1 and not counter.syncing
    assert [f[0].tokens for f in found] == [tuple(drawn) for _, drawn, _ in trees]


@pytest.mark.parametrize("k", [2, 3])
def test_every_step_of_a_served_batch_calls_the_head_once(llama_dir, k) -> None:
    """Three requests decoded together through the in-process pipeline at K levels per
    step (greedy, seeded, penalties): at most one LM head call per step, and the
    tokens are plain decoding's."""
    dep = build_local(llama_dir, 3, ORACLE_DRAFT, torch.float64)
    engine = LockstepEngine(dep.pipeline, dep.draft)
    head = dep.pipeline.stages[-1].model
    real_logits = head.logits
    calls: list[int] = []
    per_step: list[int] = []
    depths: list[int] = []

    def counting(h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        return real_logits(h)

    head.logits = counting
    step_many = dep.pipeline.step_many

    def step(inputs):
        calls.clear()
        results = step_many(inputs)
        per_step.append(len(calls))
        depths.extend(len(v.tokens) for r in results.values() for v in r.verified)
        return results

    dep.pipeline.step_many = step  # type: ignore[method-assign]
    samplings = [
        SamplingParams(),
        SamplingParams(temperature=0.8, seed=5),
        SamplingParams(frequency_penalty=0.7, presence_penalty=0.3),
    ]
    prompts = [[5, 17, 33, 2, 8], [9, 41, 12, 60, 3, 7], [70, 1, 2, 3]]
    runs = [
        engine.add(p, Mode.SPECPIPE, DecodeOptions(16, sampling=s, width=3, layers_per_step=k))
        for p, s in zip(prompts, samplings, strict=True)
    ]
    while engine.runs:
        engine.step()
    assert per_step and max(per_step) == 1
    assert max(depths) >= 2  # walks below their roots, drawn from the one call
    head.logits = real_logits
    dep.pipeline.step_many = step_many  # type: ignore[method-assign]
    for run, p, s in zip(runs, prompts, samplings, strict=True):
        ref = LockstepGeneration(
            dep.pipeline, None, p, Mode.AUTOREGRESSIVE, DecodeOptions(16, sampling=s)
        )
        assert run.tokens == ref.run()


def test_a_round_with_more_rows_than_a_head_call_takes_splits_them(llama_dir, monkeypatch) -> None:
    """`HEAD_ROWS` bounds the logits of one call: a round with more rows makes more
    calls (of at most that many rows) and draws the same."""
    model = load_stage(llama_dir, LayerRange(2, 5, 5), torch.float64)
    trees = [tree(model, spec, 3, seed) for seed, spec in enumerate(SPECS)]
    monkeypatch.setattr(verifier_module, "HEAD_ROWS", 4)
    calls: list[int] = []

    def head(h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        return model.logits(h)

    verifiers = [
        RequestVerifier(a.request_id, s, head, PREFIX)
        for (a, _, _), s in zip(trees, SPECS, strict=True)
    ]
    found = verify_many(list(zip(verifiers, [a for a, _, _ in trees], strict=True)), head)
    assert calls == [4, 4, 4, 4, 4, 1]  # 3 requests x 7 rows
    assert [f[0].tokens for f in found] == [tuple(drawn) for _, drawn, _ in trees]
