"""The one mapping from the runtimes' typed request errors to gRPC status codes: what the
stage and the draft answer when a request cannot proceed."""

from __future__ import annotations

import grpc
import pytest
import torch
from specpipe.common.model.loading import load_stage
from specpipe.common.runtime.draft import DraftRuntime
from specpipe.common.runtime.errors import AlreadyOpen, BadInput, CacheFull, NotOpen
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.spec.messages import Activation
from specpipe.services.status import status_code

from ..conftest import make_tiny_model

Code = grpc.StatusCode


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m"), layers=2, hidden=24, heads=3, kv_heads=1)


def _raised(fn, *args) -> Exception:
    with pytest.raises(Exception) as info:
        fn(*args)
    return info.value


def test_stage_errors_map_to_their_codes(model_dir) -> None:
    model = load_stage(model_dir)
    stage = StageRuntime(model)
    stage.max_cache_bytes = (
        stage.pool.blocks_for(8) * stage.pool.block_bytes
    )  # room for one request of 8 rows
    stage.open("r", 8)
    stage.forward(Activation("r", torch.arange(8), committed=True, tokens=torch.arange(8)))
    no_tokens = Activation("r", torch.arange(2), committed=True)
    cases = [
        (_raised(stage.open, "r", 8), AlreadyOpen, Code.ALREADY_EXISTS),
        (_raised(stage.open, "s", 8), CacheFull, Code.RESOURCE_EXHAUSTED),
        (_raised(stage.forward, Activation("x", torch.arange(1))), NotOpen, Code.NOT_FOUND),
        (_raised(stage.forward, no_tokens), BadInput, Code.FAILED_PRECONDITION),
    ]
    for error, kind, code in cases:
        assert type(error) is kind and status_code(error) == code, error


def test_a_full_cache_is_resource_exhausted_and_bad_rows_a_failed_precondition(model_dir) -> None:
    draft = DraftRuntime(load_stage(model_dir))
    draft.open("r", 2)
    full = _raised(draft.prefill, "r", torch.tensor([1, 2, 3]), 0, 8)
    assert type(full) is CacheFull and status_code(full) == Code.RESOURCE_EXHAUSTED
    orphan = Activation(
        "r", torch.tensor([1]), node_ids=torch.tensor([5]), parent_ids=torch.tensor([4]),
        tokens=torch.tensor([1]),
    )  # fmt: skip
    draft.release("r")
    draft.open("r", 4)
    bad = _raised(draft.propose, orphan, 2)
    assert type(bad) is BadInput and status_code(bad) == Code.FAILED_PRECONDITION


def test_other_errors_are_failed_preconditions() -> None:
    assert status_code(ValueError("bad value")) == Code.FAILED_PRECONDITION
