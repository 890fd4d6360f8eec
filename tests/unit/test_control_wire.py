"""The control messages' bytes encoded in one pass (`control_wire.py`) are the
containers' own serialization, packed as the containers are."""

from __future__ import annotations

import random

import pytest
from specpipe.services.router import control_stream
from specpipe.services.router.control_wire import (
    DraftCallItem,
    draft_control_parts,
    stage_control_parts,
)
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import draft_pb2, stage_pb2


def rows(g: random.Random, n: int) -> pb.Rows:
    return pb.Rows(
        positions=[g.randrange(1 << 20) for _ in range(n)],
        node_ids=[g.randrange(1 << 40) for _ in range(n)],
        parent_ids=[g.randrange(-1, 1 << 40) for _ in range(n)],
        committed=g.random() < 0.2,
    )


def feed(g: random.Random) -> stage_pb2.FeedRequest:
    n = g.choice([0, 1, 4, 200])
    return stage_pb2.FeedRequest(
        request_id=f"{g.randrange(1 << 60):022d}", seq=g.randrange(1 << 33),
        after_prune=g.randrange(50), rows=rows(g, n), token_ids=[g.randrange(1 << 17) for _ in range(n)],
        verified_at_ns=g.choice([0, 1 << 62]),
    )  # fmt: skip


def prune(g: random.Random) -> pb.PruneRequest:
    signal = pb.PruneSignal(
        seq=g.randrange(1 << 20), commit_ids=[g.randrange(1 << 40)],
        keep_ids=[g.randrange(1 << 40) for _ in range(g.randrange(12))], horizon=g.randrange(99),
    )  # fmt: skip
    return pb.PruneRequest(
        request_id=f"{g.randrange(99):022d}", prune=signal, relay=g.random() < 0.5
    )


def call(g: random.Random, call_id: int) -> DraftCallItem:
    kind = g.choice(["prefill", "propose", "prune", "release"])
    rid = f"{g.randrange(99):022d}"
    request = {
        "prefill": lambda: draft_pb2.PrefillDraftRequest(
            request_id=rid, token_ids=[g.randrange(512) for _ in range(g.randrange(300))]
        ),
        "propose": lambda: draft_pb2.ProposeRequest(
            request_id=rid,
            rows=rows(g, 4),
            token_ids=[1, 2, 3, 4],
            top_k=4,
            prunes=[prune(g).prune for _ in range(g.randrange(3))],
        ),
        "prune": lambda: prune(g),
        "release": lambda: pb.RequestRef(request_id=g.choice(["", rid])),
    }[kind]()
    return DraftCallItem(call_id, kind, request)


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize("budget", [1 << 20, 300, 1])
def test_stage_control_bytes_are_the_messages(seed: int, budget: int, monkeypatch) -> None:
    g = random.Random(seed)
    feeds = [feed(g) for _ in range(g.randrange(10))]
    prunes = [prune(g) for _ in range(g.randrange(10))]
    monkeypatch.setattr(control_stream, "MESSAGE_BUDGET", budget)
    want = [m.SerializeToString() for m in control_stream._messages_of([*prunes, *feeds])]
    assert stage_control_parts(feeds, prunes, budget) == want
    read = [stage_pb2.StageControl.FromString(part) for part in want]  # as sent
    assert [p for m in read for p in m.prunes] == prunes
    assert [f for m in read for f in m.feeds] == feeds
    # No feed in a part before a prune's: a stage never allocates before a prune frees
    prune_parts = [i for i, m in enumerate(read) if m.prunes]
    feed_parts = [i for i, m in enumerate(read) if m.feeds]
    if prune_parts and feed_parts:
        assert max(prune_parts) <= min(feed_parts)


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize("budget", [1 << 20, 300, 1])
def test_draft_control_bytes_are_the_messages(seed: int, budget: int, monkeypatch) -> None:
    g = random.Random(seed)
    calls = [call(g, g.choice([0, 1, g.randrange(1 << 40)])) for _ in range(1 + g.randrange(10))]
    monkeypatch.setattr(control_stream, "MESSAGE_BUDGET", budget)
    messages = [c.message() for c in calls]
    want = [
        draft_pb2.DraftControl(calls=p).SerializeToString()
        for p in control_stream._packed(messages)
    ]
    assert draft_control_parts(calls, budget) == want
    back = [c for part in want for c in draft_pb2.DraftControl.FromString(part).calls]
    assert back == messages
