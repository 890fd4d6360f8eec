"""The stage's ordering of one request's activations and prunes, without gRPC: activations
in `seq` order, each only once the prunes it was created after are applied; prunes in
their own order as soon as they arrive; duplicates refused; empty activations pass on."""

from __future__ import annotations

import pytest
import torch
from specpipe.common.runtime.errors import DuplicatePrune
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
