"""The rows one step may take on a stage or the draft (issue 22, N4: clients chose
prefill chunks of up to 16384 rows and SpecInfer trees of up to 16386 with no server
cap; an 8192-row chunk added 576 MB on each stage and tripled a neighbour's latency):
the cap from a measured cost curve, and the router's check of a request against it."""

from __future__ import annotations

import pytest
from specpipe.common.perf.cost_model import BUDGET_ROWS, CostCurve
from specpipe.common.runtime.validation import (
    DEFAULT_STEP_ROWS,
    MAX_STEP_ROWS,
    MIN_STEP_ROWS,
    step_row_cap,
)
from specpipe.common.spec.options import (
    DEFAULT_PREFILL_CHUNK,
    DecodeOptions,
    Mode,
    check_step_rows,
    step_rows,
)

ROWS = list(BUDGET_ROWS)  # 1 .. 256, what --measure-costs measures


def curve(seconds_of) -> CostCurve:
    return CostCurve(ROWS, [seconds_of(n) for n in ROWS])


def test_the_cap_is_where_the_cost_per_row_stops_falling() -> None:
    # A CPU: a fixed 2 ms per forward plus 1 ms per row: the cost per row is within 10%
    # of its lowest from 32 rows on, below the floor.
    assert step_row_cap(curve(lambda n: 2e-3 + 1e-3 * n)) == MIN_STEP_ROWS
    # An accelerator: a forward costs the same up to 256 rows (still falling per row at
    # the largest count measured): the ceiling.
    assert step_row_cap(curve(lambda n: 5e-3)) == MAX_STEP_ROWS
    # Flat only beyond the floor: a 300 ms overhead amortized until 256 rows, measured to
    # 1024 rows.
    wide = CostCurve([*ROWS, 512, 1024], [0.3 + 1e-3 * n for n in [*ROWS, 512, 1024]])
    assert MIN_STEP_ROWS < step_row_cap(wide) <= 1024
    # Not measured (or one point): the default.
    assert step_row_cap(None) == DEFAULT_STEP_ROWS
    assert step_row_cap(CostCurve([1], [1e-3])) == DEFAULT_STEP_ROWS


def test_every_default_request_fits_the_smallest_cap() -> None:
    opts = DecodeOptions(max_new_tokens=8)
    for mode in Mode:
        check_step_rows(mode, opts, MIN_STEP_ROWS)
    assert DEFAULT_PREFILL_CHUNK <= MIN_STEP_ROWS


def test_a_request_above_the_cap_is_refused_with_the_limit() -> None:
    with pytest.raises(ValueError, match="prefill_chunk 8192 is above the 1024 rows"):
        check_step_rows(Mode.PP, DecodeOptions(8, prefill_chunk=8192), 1024)
    wide = DecodeOptions(8, width=64, depth=64)
    assert step_rows(Mode.SPECINFER, wide) == 64 * 64 + 1
    with pytest.raises(ValueError, match=r"tree of 4097 rows .* above the 1024 rows"):
        check_step_rows(Mode.SPECINFER, wide, 1024)
    deep = DecodeOptions(8, width=256, layers_per_step=8)
    with pytest.raises(ValueError, match="8 layers per step of width 256"):
        check_step_rows(Mode.SPECPIPE, deep, 1024)
    check_step_rows(Mode.PP, wide, 1024)  # pp feeds one row: its tree options do not matter
