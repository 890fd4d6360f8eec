"""The serving path reads nothing back from the device except where an output is handed
to a transport that needs host memory: a stage step, a draft proposal and a block-pool
commit run on the meta device, whose tensors have no values, so any host read (`.item()`,
`.tolist()`, `.cpu()`, `bool(t)`, `nonzero`) would fail. The draft's one hand-off of a
step's candidates (`draft.hand_off`) is the only copy, once per step for all requests.
"""

from __future__ import annotations

import torch
from specpipe.common.model.loading import load_stage
from specpipe.common.model.partition import LayerRange
from specpipe.common.runtime import draft as draft_module
from specpipe.common.runtime.draft import DraftRuntime, Proposal
from specpipe.common.spec.messages import Activation, Prune

from .test_stage_step import DeviceOps, count_step, stage_on

t = lambda *x: torch.tensor(x, dtype=torch.int64)  # noqa: E731


def test_a_stage_step_on_the_meta_device_reads_nothing_back(llama_dir) -> None:
    for layers in (LayerRange(0, 2, 5), LayerRange(2, 5, 5)):
        counter, outs, _ = count_step(llama_dir, layers, "meta", 3)
        assert not counter.syncing and counter.ops
        assert all(out.hidden.device.type == "meta" for out in outs)


def test_a_draft_proposal_hands_off_once_per_step_and_reads_nothing_else(
    llama_dir, monkeypatch
) -> None:
    draft = DraftRuntime(load_stage(llama_dir, dtype=torch.float32).to("meta"))
    handed: list[torch.Size] = []

    def hand_off(packed: torch.Tensor) -> torch.Tensor:
        assert packed.device.type == "meta"
        handed.append(packed.shape)
        return torch.zeros(packed.shape, dtype=packed.dtype)  # the transport's host copy

    monkeypatch.setattr(draft_module, "hand_off", hand_off)
    for i, n in enumerate((3, 7, 20)):
        draft.open(f"r{i}", 64)
        draft.prefill(f"r{i}", torch.arange(n) % 50, 0, 8)
    asks = [
        Proposal(
            Activation(f"r{i}", t(n, n + 1), node_ids=t(0, 1), parent_ids=t(-1, 0), tokens=t(5, 6)),
            top_k,
            temperature,
        )
        for i, (n, top_k, temperature) in enumerate(((3, 2, 0.0), (7, 2, 0.0), (20, 3, 0.7)))
    ]
    with DeviceOps("meta") as counter:
        out = draft.propose_many(asks)
    assert not counter.syncing, counter.syncing
    assert len(handed) == 1  # one copy for the whole step, two kinds of asks in it
    assert [len(c) for c in out] == [4, 4, 6]
    assert all(c.tokens.device.type == "cpu" and c.tokens.dtype == torch.int64 for c in out)
    assert out[2].parent_ids.tolist() == [0, 0, 0, 1, 1, 1]


def test_a_block_pool_commit_on_the_meta_device_reads_nothing_back(llama_dir) -> None:
    stage = stage_on(llama_dir, LayerRange(0, 2, 5), "meta")
    stage.open("r", 64)
    stage.forward(Activation("r", torch.arange(5), committed=True, tokens=torch.arange(5)))
    stage.forward(Activation("r", t(5, 6, 6), node_ids=t(10, 11, 12), parent_ids=t(-1, 10, 10),
                             tokens=t(1, 2, 3)))  # fmt: skip
    with DeviceOps("meta") as counter:
        stage.prune("r", Prune(t(10, 11), t(), horizon=12))  # two rows move to the prefix
    assert not counter.syncing
    # K and V are one cache tensor: the commit gathers and writes both in one op each
    assert counter.ops["index_select"] == 1 and counter.ops["index_copy_"] == 1
    assert stage._caches["r"].n_committed == 7
