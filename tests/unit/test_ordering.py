"""The stage's ordering of one request's activations and prunes, without gRPC: activations
in `seq` order, each only once the prunes it was created after are applied; prunes in
their own order as soon as they arrive; duplicates refused; empty activations pass on."""

from __future__ import annotations

import pytest
import torch
from specpipe.common.runtime.errors import DuplicatePrune, Overloaded
from specpipe.common.runtime.ordering import Pending, RequestOrder
from specpipe.common.spec.messages import EMPTY_IDS, Activation, Prune


def act(tag: int) -> Activation:
    return Activation("r", torch.tensor([tag]))


def prune(horizon: int) -> Prune:
    return Prune(EMPTY_IDS, EMPTY_IDS, horizon)


def run(order: RequestOrder) -> list[str]:
    """What a stage's loop does until it must wait: apply every prune that can be
    applied, then compute the activation whose turn it is; repeat."""
    done = []
    while True:
        while (ready := order.next_prune()) is not None:
            seq, _ = ready
            order.prune_applied(seq)
            done.append(f"prune {seq}")
        turn = order.next_activation()
        if turn is None:
            return done
        seq, item = turn
        done.append(f"{'pass' if item.empty else 'compute'} {seq}")


def test_activations_in_order_are_computed_at_once() -> None:
    order = RequestOrder()
    for seq in range(3):
        order.add_activation(seq, Pending(act(seq), after_prune=0))
        assert run(order) == [f"compute {seq}"]
    assert order.next_seq == 3 and not order.pending


def test_an_early_activation_waits_for_the_one_before_it() -> None:
    order = RequestOrder()
    order.add_activation(2, Pending(act(2), 0))
    order.add_activation(1, Pending(act(1), 0))
    assert run(order) == []  # seq 0 has not arrived
    order.add_activation(0, Pending(act(0), 0))
    assert run(order) == ["compute 0", "compute 1", "compute 2"]


def test_an_activation_waits_for_the_prunes_it_was_created_after() -> None:
    order = RequestOrder()
    order.add_activation(0, Pending(act(0), after_prune=0))
    order.add_activation(1, Pending(act(1), after_prune=2))
    assert run(order) == ["compute 0"]
    order.add_prune(2, prune(2))  # prune 1 is missing: prune 2 cannot be applied yet
    assert run(order) == []
    order.add_prune(1, prune(1))
    assert run(order) == ["prune 1", "prune 2", "compute 1"]


def test_prunes_are_applied_as_soon_as_they_arrive_and_before_the_next_activation() -> None:
    order = RequestOrder()
    order.add_prune(1, prune(1))
    assert run(order) == ["prune 1"]  # no activation needed
    order.add_activation(0, Pending(act(0), after_prune=0))
    order.add_prune(2, prune(2))
    assert run(order) == ["prune 2", "compute 0"]


def test_a_duplicate_or_old_prune_is_refused() -> None:
    order = RequestOrder()
    order.add_prune(1, prune(1))
    order.add_prune(3, prune(3))
    with pytest.raises(DuplicatePrune, match="prune 3 was already received"):
        order.add_prune(3, prune(3))  # waiting for prune 2
    run(order)
    with pytest.raises(DuplicatePrune, match="prune 1 was already received"):
        order.add_prune(1, prune(1))  # applied
    assert order.applied == 1 and list(order.prunes) == [3]


def test_a_prune_being_applied_counts_as_received() -> None:
    order = RequestOrder()
    order.add_prune(1, prune(1))
    assert order.next_prune() is not None  # handed to the compute thread, not yet applied
    with pytest.raises(DuplicatePrune):
        order.add_prune(1, prune(1))
    order.prune_applied(1)
    with pytest.raises(ValueError, match="not the one to apply"):
        order.prune_applied(1)


def test_empty_and_pruned_away_activations_pass_the_turn_on() -> None:
    order = RequestOrder()
    order.add_activation(1, Pending(act(1), after_prune=1))
    order.add_activation(0, Pending(act(0), after_prune=0, empty=True))
    order.add_prune(1, prune(1))
    assert run(order) == ["prune 1", "pass 0", "compute 1"]
    order.add_activation(2, Pending(act(2), after_prune=1, empty=True))
    order.add_activation(3, Pending(act(3), after_prune=1))
    assert run(order) == ["pass 2", "compute 3"]


def test_turn_ready_and_blocked_say_what_run_would_do() -> None:
    """What the stage's step alignment reads without taking anything: a turn is ready
    once its activation and the prunes it was created after are here; work that waits
    for an earlier activation or a missing prune is blocked (something is in flight)."""
    order = RequestOrder()
    assert not order.turn_ready() and not order.blocked()  # nothing here
    order.add_activation(1, Pending(act(1), 0))
    assert not order.turn_ready() and order.blocked()  # seq 0 is in flight
    order.add_activation(0, Pending(act(0), after_prune=1))
    assert not order.turn_ready() and order.blocked()  # prune 1 is in flight
    order.add_prune(1, prune(1))
    assert order.turn_ready() and not order.blocked()
    assert run(order) == ["prune 1", "compute 0", "compute 1"]
    assert not order.turn_ready() and not order.blocked()


def big(tag: int, rows: int) -> Activation:
    return Activation("r", torch.arange(rows), committed=True, tokens=torch.full((rows,), tag))


def test_waiting_work_is_bounded_by_bytes_and_count() -> None:
    """Issue 22, N9: one request's feeds that can never be computed (seq 0 never comes)
    were held without bound (1200 feeds: 337 MB on a stage). What waits is bounded by
    bytes and by count (Overloaded: RESOURCE_EXHAUSTED); taking a turn frees its share."""
    item = Pending(big(1, 100), 0)
    assert item.nbytes == 100 * 8 * 2  # positions and token ids, int64
    order = RequestOrder(max_pending_bytes=3 * item.nbytes)
    for seq in (1, 2, 3):
        order.add_activation(seq, Pending(big(seq, 100), 0))
    with pytest.raises(Overloaded, match="bytes"):
        order.add_activation(4, Pending(big(4, 100), 0))
    assert 4 not in order.pending and order.pending_bytes == 3 * item.nbytes
    order.add_activation(0, Pending(big(0, 1), 0))  # fits: the turn's own, 16 bytes
    assert run(order) == [f"compute {s}" for s in range(4)] and order.pending_bytes == 0
    order.add_activation(4, Pending(big(4, 100), 0))  # room again

    few = RequestOrder(max_pending=2)
    few.add_activation(1, Pending(act(1), 0))
    few.add_activation(2, Pending(act(2), 0))
    with pytest.raises(Overloaded, match="at most 2"):
        few.add_activation(3, Pending(act(3), 0))


def test_waiting_prunes_count_with_the_activations() -> None:
    order = RequestOrder(max_pending=2)
    order.add_prune(2, prune(2))
    order.add_prune(3, prune(3))
    with pytest.raises(Overloaded):
        order.add_prune(4, prune(4))
    ids = torch.arange(64)
    tight = RequestOrder(max_pending_bytes=64 * 8)
    tight.add_prune(2, Prune(ids, EMPTY_IDS, 100))
    with pytest.raises(Overloaded, match="bytes"):
        tight.add_prune(3, Prune(EMPTY_IDS, torch.arange(1), 100))
    tight.add_prune(1, Prune(ids, EMPTY_IDS, 100))  # the one to apply next always fits
    assert run(tight) == ["prune 1", "prune 2"] and tight.pending_bytes == 0
