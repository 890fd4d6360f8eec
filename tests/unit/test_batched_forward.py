"""One batched forward over several requests' rows equals separate forwards, and a
request whose rows are bad fails alone."""

from __future__ import annotations

import pytest
import torch
from specpipe.common.model.loading import load_stage
from specpipe.common.model.partition import LayerRange
from specpipe.common.runtime.errors import BadInput, NotOpen
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.spec.messages import Activation

t = lambda *x: torch.tensor(x, dtype=torch.int64)  # noqa: E731


def prefill(rid: str, tokens: list[int]) -> Activation:
    return Activation(rid, torch.arange(len(tokens)), committed=True, tokens=torch.tensor(tokens))


def tree(rid: str, pos: list[int], ids: list[int], parents: list[int], tokens: list[int]):
    return Activation(rid, t(*pos), node_ids=t(*ids), parent_ids=t(*parents), tokens=t(*tokens))


def script() -> list[list[Activation]]:
    """Three requests in different phases, step by step (prefill, root, tree layers)."""
    return [
        [prefill("a", [5, 9, 3]), prefill("b", [7]), prefill("c", [1, 2, 3, 4, 5])],
        [tree("a", [3], [0], [-1], [11]), tree("b", [1], [0], [-1], [12]), prefill("c", [6, 7])],
        [
            tree("a", [4, 4], [1, 2], [0, 0], [20, 21]),
            tree("b", [2, 2, 2], [1, 2, 3], [0, 0, 0], [30, 31, 32]),
            tree("c", [7], [0], [-1], [40]),
        ],
    ]


def run(model_dir, dtype, batched: bool) -> list[list[torch.Tensor | None]]:
    """Per step, each request's logits of its tree rows (the LM head of the last stage's
    final hidden states, as its verifier computes them; None for a prefill chunk)."""
    stages = [
        StageRuntime(load_stage(model_dir, LayerRange(a, b, 5), dtype)) for a, b in ((0, 2), (2, 5))
    ]
    for s in stages:
        for rid in "abc":
            s.open(rid, 32)
    outs = []
    for step in script():
        acts = step
        for s in stages:
            acts = s.forward_many(acts) if batched else [s.forward(a) for a in acts]
        head = stages[-1].model.logits
        outs.append([None if a.committed else head(a.hidden) for a in acts])
    return outs


# fp32: the batched GEMMs reduce in another order (and through other BLAS kernels) than
# one request's; measured here 4.6e-6 of the logits' magnitude (6.4e-5 at |logit| 14),
# so the bound is 10x that. fp64 noise is ~1e-13.
@pytest.mark.parametrize(("dtype", "rel"), [(torch.float64, 1e-10), (torch.float32, 5e-5)])
def test_batched_forward_equals_separate_forwards(llama_dir, dtype, rel) -> None:
    separate = run(llama_dir, dtype, batched=False)
    batched = run(llama_dir, dtype, batched=True)
    for sep_step, bat_step in zip(separate, batched, strict=True):
        for sep, bat in zip(sep_step, bat_step, strict=True):
            if sep is None:
                assert bat is None
                continue
            tol = rel * float(sep.abs().max())
            torch.testing.assert_close(bat, sep, atol=tol, rtol=0)
            # Greedy tokens agree wherever the top-2 margin exceeds the noise bound.
            top2 = sep.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
            assert torch.equal(bat.argmax(-1)[clear], sep.argmax(-1)[clear])


def test_a_bad_request_fails_alone(llama_dir) -> None:
    stage = StageRuntime(load_stage(llama_dir, LayerRange(0, 2, 5), torch.float64))
    stage.open("a", 8)
    stage.open("b", 8)
    good = prefill("a", [5, 9])
    orphan = tree("b", [1], [7], [3], [12])  # parent 3 is neither cached nor committed
    unknown = prefill("zz", [1])
    out = stage.forward_many([good, orphan, unknown])
    assert out[0].hidden.shape == (2, 48)
    assert isinstance(out[1], BadInput) and isinstance(out[2], NotOpen)
    assert stage.forward(tree("b", [0], [0], [-1], [4])).hidden.shape == (1, 48)  # b still fine


def test_a_request_released_during_the_forward_fails_alone(llama_dir) -> None:
    """The Release RPC runs beside the compute thread: a request released while its rows
    are in a batch gets NotOpen, the rest of the batch its outputs."""
    for last in (False, True):
        r = LayerRange(2, 5, 5) if last else LayerRange(0, 2, 5)
        stage = StageRuntime(load_stage(llama_dir, r, torch.float64))
        for rid in "ab":
            stage.open(rid, 16)
        forward_batch = stage.model.forward_batch

        def release_b_midway(*args, _orig=forward_batch, _stage=stage):
            out = _orig(*args)
            _stage.release("b")
            return out

        stage.model.forward_batch = release_b_midway
        rows = [tree(rid, [0, 1], [0, 1], [-1, 0], [3, 4]) for rid in "ab"]
        if last:
            for a in rows:
                a.hidden, a.tokens = torch.randn(2, 48, dtype=torch.float64), None
        out = stage.forward_many(rows)
        assert isinstance(out[1], NotOpen)
        assert out[0] is not None and not isinstance(out[0], Exception)
