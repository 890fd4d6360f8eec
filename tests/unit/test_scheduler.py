"""Admission, priorities and elastic width, without a deployment."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
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


# -- fairness between tenants (API keys, or client addresses) ------------------------------
def keyed(rid: str, tenant: str, priority: int = 0) -> Ticket:
    return Ticket(rid, priority, Mode.SPECPIPE, 1, tenant=tenant)


def test_a_flooding_key_leaves_a_slot_for_a_neighbour() -> None:
    """F2: one key's n=16 requests filled 304 of 320 slots; a neighbour waited 36 s
    (with 8 + 8 slots it was refused). Now the flood keeps a reserve free and queues at
    most its own share of waiting work."""
    s = Scheduler(max_running=8, max_waiting=8, max_running_per_tenant=7, max_waiting_per_tenant=2)
    ran = [s.submit(keyed(f"f{i}", "flood")) for i in range(9)]
    assert ran == [True] * 7 + [False] * 2
    with pytest.raises(QueueFull, match="this client"):
        s.submit(keyed("f9", "flood"))
    assert s.submit(keyed("n0", "neighbour"))  # runs at once, in the reserve


def test_a_freed_slot_goes_to_the_key_running_fewest() -> None:
    s = Scheduler(max_running=4, max_waiting=16)
    for i in range(4):
        s.submit(keyed(f"a{i}", "a", priority=5))
    for i in range(3):
        s.submit(keyed(f"a{i + 4}", "a", priority=5))
    s.submit(keyed("b0", "b"))  # lower priority, but key b runs nothing
    assert [t.request_id for t in s.finish("a0")] == ["b0"]
    assert [t.request_id for t in s.finish("a1")] == ["a4"]  # a: 2 running, b: 1, b idle


def test_a_full_queue_makes_room_for_a_key_with_less_waiting() -> None:
    bumped: list[str] = []
    s = Scheduler(max_running=1, max_waiting=3, on_bumped=lambda t: bumped.append(t.request_id))
    s.submit(keyed("r", "a"))
    for i in range(3):
        s.submit(keyed(f"a{i}", "a"))
    assert not s.submit(keyed("b0", "b"))  # waits: a's newest waiting request is refused
    assert bumped == ["a2"] and [t.request_id for t in s.waiting] == ["a0", "a1", "b0"]
    with pytest.raises(QueueFull):
        s.submit(keyed("b1", "b"))  # b would then hold more than its share


def test_room_counts_every_choice_of_a_request() -> None:
    s = Scheduler(max_running=8, max_waiting=8, max_running_per_tenant=7, max_waiting_per_tenant=2)
    assert s.room("k") == 9
    s.check_room("k", 9)
    with pytest.raises(QueueFull, match="16 choices"):
        s.check_room("k", 16)


# Operations on a scheduler: submit a request of a tenant, or finish the i-th open one.
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(0, 3), st.integers(-2, 2)),
        st.tuples(st.just("finish"), st.integers(0, 63), st.just(0)),
    ),
    max_size=120,
)


@settings(max_examples=200, deadline=None)
@given(
    ops=_ops,
    max_running=st.integers(1, 6),
    max_waiting=st.integers(0, 8),
    per_running=st.integers(1, 6),
    per_waiting=st.integers(0, 8),
)
def test_admission_never_exceeds_its_slots_and_shares_them_fairly(
    ops, max_running, max_waiting, per_running, per_waiting
) -> None:
    """Any interleaving of arrivals and departures of four keys: the slots and every
    key's caps hold, no request waits while it could run, and a freed slot goes to a
    waiting key that runs fewest."""
    s = Scheduler(max_running, max_waiting, max_running_per_tenant=per_running,
                  max_waiting_per_tenant=per_waiting, on_bumped=lambda t: None)  # fmt: skip
    for n, (op, a, prio) in enumerate(ops):
        if op == "submit":
            with contextlib.suppress(QueueFull):
                s.submit(keyed(f"r{n}", f"k{a}", prio))
        elif s.running:
            rid = sorted(s.running)[a % len(s.running)]
            counts = _running_by_tenant(s)
            counts[s.running[rid].tenant] -= 1
            ready = {t.tenant for t in s.waiting if counts.get(t.tenant, 0) < per_running}
            admitted = s.finish(rid)
            assert len(admitted) == (1 if ready else 0)
            if admitted:
                assert counts.get(admitted[0].tenant, 0) == min(counts.get(k, 0) for k in ready)
        _check_invariants(s, max_running, max_waiting, per_running, per_waiting)


def _running_by_tenant(s: Scheduler) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in s.running.values():
        out[t.tenant] = out.get(t.tenant, 0) + 1
    return out


def _check_invariants(s: Scheduler, max_running, max_waiting, per_running, per_waiting) -> None:
    running = _running_by_tenant(s)
    waiting: dict[str, int] = {}
    for t in s.waiting:
        waiting[t.tenant] = waiting.get(t.tenant, 0) + 1
    assert len(s.running) <= max_running and len(s.waiting) <= max_waiting
    assert all(v <= per_running for v in running.values())
    assert all(v <= per_waiting for v in waiting.values())
    # Work-conserving: no waiting request could run in a free slot.
    if len(s.running) < max_running:
        assert all(running.get(t.tenant, 0) >= per_running for t in s.waiting)


@settings(max_examples=100, deadline=None)
@given(
    tenants=st.integers(2, 4),
    max_running=st.integers(2, 12),
    order=st.lists(st.integers(0, 1000), min_size=1, max_size=80),
)
def test_backlogged_keys_converge_to_equal_shares(tenants, max_running, order) -> None:
    """Every key keeps work waiting; requests finish in any order. The gap between the
    most and the fewest running of any two keys never grows, and once every running
    request admitted before the keys were backlogged has finished, it is at most 1."""
    s = Scheduler(max_running, max_waiting=10_000, max_waiting_per_tenant=10_000)
    n = 0
    for _ in range(max_running):  # one key took every slot first
        s.submit(keyed(f"r{n}", "k0"))
        n += 1
    first = set(s.running)
    for k in range(tenants):
        for _ in range(max_running + len(order) + 1):
            s.submit(keyed(f"r{n}", f"k{k}"))
            n += 1

    def gap() -> int:
        counts = [sum(t.tenant == f"k{k}" for t in s.running.values()) for k in range(tenants)]
        return max(counts) - min(counts)

    g = gap()
    for pick in order:
        rid = sorted(s.running)[pick % len(s.running)]
        first.discard(rid)
        s.finish(rid)
        assert gap() <= max(g, 1)
        g = gap()
    while first:
        rid = first.pop()
        s.finish(rid)
    assert gap() <= 1
