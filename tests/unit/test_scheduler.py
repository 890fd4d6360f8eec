"""Admission, priorities and elastic width, without a deployment."""

from __future__ import annotations

import pytest
from specpipe.common.spec.options import Mode
from specpipe.common.spec.scheduler import QueueFull, Scheduler, Ticket


def ticket(rid: str, priority: int = 0, mode: Mode = Mode.SPECPIPE, width: int = 8) -> Ticket:
    return Ticket(rid, priority, mode, width, depth=4)


def test_admission_queue_and_refusal() -> None:
    s = Scheduler(max_running=2, max_waiting=1)
    assert s.submit(ticket("a")) and s.submit(ticket("b"))
    assert not s.submit(ticket("c"))  # waits
    with pytest.raises(QueueFull, match="retry later"):
        s.submit(ticket("d"))
    assert [t.request_id for t in s.finish("a")] == ["c"]
    assert set(s.running) == {"b", "c"} and not s.waiting
    assert s.finish("nobody") == []


def test_waiting_requests_run_by_priority_then_arrival() -> None:
    s = Scheduler(max_running=1, max_waiting=5)
    s.submit(ticket("running"))
    for rid, prio in (("low", -1), ("mid1", 0), ("high", 5), ("mid2", 0)):
        s.submit(ticket(rid, prio))
    order = []
    current = "running"
    while s.running:
        admitted = s.finish(current)
        if not admitted:
            break
        current = admitted[0].request_id
        order.append(current)
    assert order == ["high", "mid1", "mid2", "low"]


def test_a_cancelled_waiting_request_leaves_the_queue() -> None:
    s = Scheduler(max_running=1, max_waiting=2)
    s.submit(ticket("a"))
    s.submit(ticket("b"))
    assert s.finish("b") == [] and not s.waiting  # gave up while waiting
    assert s.finish("a") == [] and not s.running


def test_aging_lets_a_long_waiting_request_overtake() -> None:
    now = [0.0]
    s = Scheduler(max_running=1, max_waiting=5, aging_seconds=10.0, clock=lambda: now[0])
    s.submit(ticket("running"))
    s.submit(ticket("old-low", priority=0))
    now[0] = 35.0  # waited 3.5 aging periods: counts as priority 3
    s.submit(ticket("new-high", priority=2))
    assert [t.request_id for t in s.finish("running")] == ["old-low"]


def test_elastic_width_shrinks_best_effort_first_and_recovers() -> None:
    s = Scheduler(max_running=8, max_waiting=0, num_stages=4, row_budget=20)
    s.submit(ticket("vip", priority=1, width=8))
    s.submit(ticket("be1", priority=-1, width=8))
    assert (s.running["vip"].granted, s.running["be1"].granted) == (8, 8)  # 16 <= 20
    s.submit(ticket("be2", priority=-1, width=8))
    s.submit(ticket("pp", mode=Mode.PP, width=8))
    granted = {rid: t.granted for rid, t in s.running.items()}
    assert granted["vip"] == 8 and granted["pp"] == 1  # pp uses one row, no tree
    assert granted["be1"] + granted["be2"] <= 20 - 8 - 1 and granted["be1"] >= granted["be2"]
    assert min(granted.values()) >= 1
    s.finish("vip")
    assert s.running["be1"].granted == 8 and s.running["be2"].granted == 8


def test_specinfer_counts_its_tree_spread_over_the_pass() -> None:
    s = Scheduler(max_running=4, max_waiting=0, num_stages=4, row_budget=6)
    s.submit(ticket("si", mode=Mode.SPECINFER, width=8))  # depth 4 over 4 stages: width rows
    assert s.running["si"].granted == 6


def test_no_budget_means_every_request_keeps_its_width() -> None:
    s = Scheduler(max_running=4, max_waiting=0)
    for i in range(4):
        s.submit(ticket(f"r{i}", width=5))
    assert all(t.granted == 5 for t in s.running.values())
