"""The accelerators' attention path (FlexAttention over unpadded keys with a block mask)
equals the padded SDPA path in fp64, for prefill, decode and tree rows of requests of
different lengths in one step; and the path is chosen by device unless forced."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from specpipe.common.model.flex_attention import ENV, flex_applies
from specpipe.common.model.loading import load_stage
from specpipe.common.model.partition import LayerRange
from specpipe.common.runtime.kv_cache import NewRows
from specpipe.common.runtime.paged_batch import flex_metadata
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.spec.messages import Activation

from .test_step_memory import stage_inputs

t = lambda *x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
HIDDEN = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from specpipe.common.model.synthetic import save_random_model

    path = tmp_path_factory.mktemp("flex")
    return save_random_model(path, "qwen2", layers=2, hidden=HIDDEN, heads=4, kv_heads=2, seed=5)


def script() -> list[list[Activation]]:
    """Three requests of different lengths: prefills; then a tree, a decode row and a
    prefill chunk in one step; then two trees of different depths."""
    pre = lambda rid, n, m: Activation(  # noqa: E731
        rid, torch.arange(n, n + m), committed=True, tokens=(torch.arange(m) * 7 + n) % 50
    )
    return [
        [pre("a", 0, 37), pre("b", 0, 5), pre("c", 0, 20)],
        [
            Activation("a", t(37, 38, 38, 39), node_ids=t(0, 1, 2, 3),
                       parent_ids=t(-1, 0, 0, 2), tokens=t(3, 4, 5, 6)),
            pre("b", 5, 1),
            pre("c", 20, 11),
        ],
        [
            Activation("b", t(6, 7, 8), node_ids=t(0, 1, 2), parent_ids=t(-1, 0, 1),
                       tokens=t(1, 2, 3)),
            Activation("c", t(31, 32), node_ids=t(0, 1), parent_ids=t(-1, 0), tokens=t(9, 8)),
        ],
    ]  # fmt: skip


def run_script(model_dir, layers: LayerRange) -> tuple[StageRuntime, list[list[torch.Tensor]]]:
    stage = StageRuntime(load_stage(model_dir, layers, torch.float64))
    for rid in "abc":
        stage.open(rid, 256)
    outs = []
    for step in script():
        done = stage.forward_many(stage_inputs(step, layers, HIDDEN))
        assert all(isinstance(o, Activation) for o in done), done
        outs.append([o.hidden for o in done])
    return stage, outs


@pytest.mark.parametrize("layers", [LayerRange(0, 1, 2), LayerRange(1, 2, 2), LayerRange(0, 2, 2)])
def test_flex_attention_equals_the_padded_path_fp64(model_dir, layers, monkeypatch) -> None:
    monkeypatch.setenv(ENV, "padded")
    _, padded = run_script(model_dir, layers)
    monkeypatch.setenv(ENV, "flex")
    _, flex = run_script(model_dir, layers)
    compared = 0
    for step_padded, step_flex in zip(padded, flex, strict=True):
        for x, y in zip(step_padded, step_flex, strict=True):
            if x is None:  # a last stage's committed rows return nothing
                assert y is None
                continue
            assert torch.allclose(x, y, rtol=1e-12, atol=1e-12), (x - y).abs().max()
            compared += 1
    assert compared >= 3  # the three trees at least


def test_a_flex_step_gathers_no_padded_keys(model_dir, monkeypatch) -> None:
    """The step's keys are each request's own, concatenated: no request is padded to the
    longest, and the padded parts build no mask."""
    rows = [
        NewRows(np.array([40, 41]), np.array([30, 30]), np.array([[30, -1], [30, 31]])),
        NewRows(np.array([50]), np.array([4]), np.empty((1, 0), np.int64)),
    ]
    keys = [np.arange(100, 132), np.arange(200, 205)]
    slots, key_request, key_position, row_request, prefix, ancestors = flex_metadata(rows, keys)
    assert slots.tolist() == [*range(100, 132), *range(200, 204)]  # 32 and 4 keys needed
    assert key_request.tolist() == [0] * 32 + [1] * 4
    assert key_position.tolist() == [*range(32), *range(4)]
    assert row_request.tolist() == [0, 0, 1] and prefix.tolist() == [30, 30, 4]
    assert ancestors.reshape(3, 2).tolist() == [[30, -1], [30, 31], [-1, -1]]


def test_the_path_is_chosen_by_device_unless_forced(monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert flex_applies("cuda") and not flex_applies("cpu") and not flex_applies("meta")
    monkeypatch.setenv(ENV, "flex")
    assert flex_applies("cpu")
    monkeypatch.setenv(ENV, "Padded")
    assert not flex_applies("cuda")
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ValueError, match="SPECPIPE_ATTENTION='fast'"):
        flex_applies("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flex_attention_on_cuda_equals_the_cpu(model_dir, monkeypatch) -> None:
    monkeypatch.setenv(ENV, "padded")
    _, cpu = run_script(model_dir, LayerRange(0, 2, 2))
    monkeypatch.delenv(ENV)
    stage = StageRuntime(load_stage(model_dir, None, torch.float64, device="cuda"))
    for rid in "abc":
        stage.open(rid, 256)
    for step, expected in zip(script(), cpu, strict=True):
        done = stage.forward_many(step)
        for o, x in zip(done, expected, strict=True):
            assert isinstance(o, Activation)
            assert torch.allclose(o.hidden.cpu(), x, rtol=1e-9, atol=1e-9)
