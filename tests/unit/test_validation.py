"""Input checks of the stages and the draft without a service (common/runtime/validation.py),
the ordering window, and rate-limited logging: every bad input of issue 13 is refused
with InvalidInput (INVALID_ARGUMENT) before it is computed."""

from __future__ import annotations

import logging

import pytest
import torch
from specpipe.common.runtime import validation
from specpipe.common.runtime.errors import DuplicatePrune, InvalidInput
from specpipe.common.runtime.ordering import Pending, RequestOrder
from specpipe.common.runtime.validation import (
    Limits,
    check_capacity,
    check_counts,
    check_input,
    check_span,
    host_finite,
    nonfinite,
)
from specpipe.common.spec.messages import EMPTY_IDS, Activation, Prune
from specpipe.services.control import FrameError, token_activation
from specpipe.services.ratelog import RateLimitedLog
from specpipe.services.status import status_code
from specpipe.v1 import dataplane_pb2 as pb

LIMITS = Limits(vocab_size=97, hidden_size=8, max_positions=256, dtype=torch.float32)
t = lambda *x: torch.tensor(x, dtype=torch.int64)  # noqa: E731


def tree(positions, hidden=None, tokens=None, nodes=None, parents=None) -> Activation:
    n = len(positions)
    return Activation(
        "r",
        t(*positions),
        node_ids=t(*range(n)) if nodes is None else nodes,
        parent_ids=t(*[-1] * n) if parents is None else parents,
        hidden=hidden,
        tokens=tokens,
    )


def refused(fn, *args, match: str | None = None) -> str:
    with pytest.raises(InvalidInput, match=match) as info:
        fn(*args)
    return str(info.value)


def test_good_input_passes() -> None:
    check_input(tree([3, 4], tokens=t(5, 6)), LIMITS, first=True)
    check_input(tree([3, 4], hidden=torch.zeros(2, 8)), LIMITS, first=False)
    committed = Activation("r", t(0, 1, 2), committed=True, tokens=t(1, 2, 3))
    check_input(committed, LIMITS, first=True)


@pytest.mark.parametrize("pos", [10**12, -5, 256])
def test_positions_outside_the_context_are_refused(pos: int) -> None:
    refused(check_input, tree([3, pos], tokens=t(5, 6)), LIMITS, True, match="context")


@pytest.mark.parametrize(
    ("hidden", "why"),
    [
        (torch.zeros(2, 8, dtype=torch.float16), "float32"),
        (torch.zeros(2, 8, dtype=torch.int64), "float32"),
        (torch.zeros(1, 2, 8), r"\[2, 8\]"),  # 3-D
        (torch.zeros(2, 7), r"\[2, 8\]"),  # wrong width
        (torch.tensor([[float("nan")] * 8, [0.0] * 8]), "NaN"),
        (torch.tensor([[float("inf")] * 8, [0.0] * 8]), "NaN or infinite"),
    ],
)
def test_hidden_states_of_the_wrong_dtype_shape_or_value_are_refused(hidden, why) -> None:
    refused(check_input, tree([3, 4], hidden=hidden), LIMITS, False, match=why)


def test_values_of_hidden_states_can_be_left_to_the_compute_thread() -> None:
    """On arrival a stage checks what metadata tells (dtype, shape, rows) and leaves the
    values to its compute thread (`nonfinite`): reading a device tensor on the event loop
    waits for the device, behind the running forward."""
    nan = tree([3, 4], hidden=torch.full((2, 8), float("nan")))
    check_input(nan, LIMITS, first=False, finite=False)
    wrong = tree([3, 4], hidden=torch.full((2, 7), float("nan")))
    refused(check_input, wrong, LIMITS, False, False, match=r"\[2, 8\]")


def test_nonfinite_flags_each_tensor_with_one_read_per_device(monkeypatch) -> None:
    inf, nan = float("inf"), float("nan")
    tensors = [
        torch.zeros(2, 8),
        torch.tensor([[0.0, nan]]),
        torch.empty(0, 8),
        torch.tensor([[-inf, 1.0]], dtype=torch.float64),
        torch.ones(3, 8, dtype=torch.bfloat16),
    ]
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda x: reads.append(x.device) or tolist(x))
    assert nonfinite(tensors) == [False, True, False, True, False]
    assert reads == []  # host tensors: read through numpy (`host_finite`), no torch read
    monkeypatch.setattr(validation, "host_finite", lambda x: None)  # as device tensors are
    assert nonfinite(tensors) == [False, True, False, True, False]
    assert reads == [torch.device("cpu")]
    assert nonfinite([]) == []


def test_tokens_and_ids_are_checked() -> None:
    refused(check_input, tree([3, 4], tokens=t(5, 97)), LIMITS, True, match="vocabulary")
    refused(check_input, tree([3, 4], tokens=t(5)), LIMITS, True, match="int64")
    bad_node = tree([3], tokens=t(5), nodes=t(-2))
    refused(check_input, bad_node, LIMITS, True, match="node ids")
    bad_parent = tree([3], tokens=t(5), parents=t(-7))
    refused(check_input, bad_parent, LIMITS, True, match="parent ids")


def test_counts_that_disagree_are_refused_from_lengths_alone() -> None:
    """The stage's silent IndexError of issue 13: node/parent id counts that do not match
    the rows. Checked on the message's lengths, before any tensor is built."""
    refused(check_counts, 3, 2, 3, False, match="one node id and one parent id")
    refused(check_counts, 3, 3, 3, True, match="committed rows")
    refused(check_counts, 3, 3, 3, False, 2, match="2 token ids for 3 rows")
    refused(check_counts, 5000, 5000, 5000, False, None, 4096, match="at most 4096")
    rows = pb.Rows(positions=[1, 2], node_ids=[0], parent_ids=[-1, 0])
    with pytest.raises(FrameError) as info:
        token_activation("r", rows, [1, 2])
    assert status_code(info.value).name == "INVALID_ARGUMENT"


def test_capacity_and_spans_are_bounded_by_the_context() -> None:
    check_capacity(300, LIMITS)
    refused(check_capacity, 0, LIMITS)
    refused(check_capacity, 10**9, LIMITS, match="capacity")
    check_span(0, 256, LIMITS)
    refused(check_span, 0, 6000, LIMITS, match="context")
    refused(check_span, -1, 3, LIMITS)


def test_ordering_refuses_replays_and_far_ahead_numbers() -> None:
    order = RequestOrder(window=8)
    item = Pending(Activation("r", t(0)), 0)
    order.add_activation(0, item)
    with pytest.raises(InvalidInput, match="already received"):
        order.add_activation(0, item)
    assert order.next_activation() is not None
    with pytest.raises(InvalidInput, match="already received"):
        order.add_activation(0, item)  # a replay after it was computed
    with pytest.raises(InvalidInput, match="ahead"):
        order.add_activation(9, item)  # would never be reached: held forever
    order.add_activation(8, item)
    p = Prune(EMPTY_IDS, EMPTY_IDS, 0)
    with pytest.raises(InvalidInput, match="ahead"):
        order.add_prune(9, p)
    order.add_prune(8, p)
    with pytest.raises(DuplicatePrune):
        order.add_prune(8, p)
    assert len(order.pending) == 1 and len(order.prunes) == 1


def test_rate_limited_log_counts_what_it_leaves_out(caplog) -> None:
    now = [0.0]
    rlog = RateLimitedLog(logging.getLogger("t"), interval=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="t"):
        assert rlog.warning("k", "bad frame %d", 1)
        for i in range(100):
            now[0] += 0.01
            assert not rlog.warning("k", "bad frame %d", i)
        assert rlog.warning("other", "another kind")
        now[0] = 20.0
        assert rlog.warning("k", "bad frame %d", 2)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "bad frame 1" and lines[1] == "another kind"
    assert lines[2].startswith("bad frame 2 (100 more like this")
    assert len(lines) == 3


def test_the_router_takes_only_verifications_from_the_last_stage() -> None:
    """A last stage sends verifications: a frame of any other kind (hidden
    states) fails the request before the controller sees it."""
    from specpipe.services.router.frames import verification_of
    from specpipe.services.transport.codec import Frame, encode

    hidden = Activation("r", t(4), node_ids=t(0), parent_ids=t(-1), hidden=torch.zeros(1, 97))
    with pytest.raises(FrameError, match="takes verifications, not frames of kind"):
        verification_of(Frame(*encode(hidden, 0)), None, 97)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_host_tensors_are_checked_finite_through_numpy_as_torch_would(dtype) -> None:
    """`host_finite` (numpy, exponent bits for bfloat16 and float16) agrees with torch's
    `isfinite` on NaN, both infinities, the largest and smallest finite values and a
    strided view; `nonfinite` gives the same per tensor."""
    info = torch.finfo(dtype)
    values = [0.0, -1.5, info.max, info.min, info.tiny, float("nan"), float("inf"), -float("inf")]
    cases = [torch.tensor([[v, 1.0], [2.0, 3.0]], dtype=dtype) for v in values]
    cases.append(torch.full((6, 4), 7.0, dtype=dtype)[::2, 1:])  # strided, finite
    bad = torch.zeros(6, 4, dtype=dtype)
    bad[4, 2] = float("nan")
    cases.append(bad[::2, 1:])  # strided, the NaN inside the view
    expected = [bool(torch.isfinite(x).all()) for x in cases]
    assert expected.count(False) == 4
    assert [host_finite(x) for x in cases] == expected
    assert nonfinite(cases) == [not e for e in expected]
