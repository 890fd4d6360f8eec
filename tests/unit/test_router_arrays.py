"""The router's side of a step makes no tensor (issue 34 point 3, session 45): the
controller hands its rows and prunes out as numpy, the network executor sends them as
they are and reads the draft's answers as numpy; an in-process executor's torch views
of the same commands are equal to the arrays, and the controller decides the same on
either kind of candidates."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch
from specpipe.common.runtime.lockstep import LockstepGeneration
from specpipe.common.spec.commands import BroadcastPrune, DraftPrune, Feed, Propose
from specpipe.common.spec.controller import make_controller
from specpipe.common.spec.growth import beside, layer_rows, pool_of, prefill_chunks
from specpipe.common.spec.messages import Candidates, PruneArrays, RowArrays, Verified
from specpipe.common.spec.options import DecodeOptions, Mode
from specpipe.common.spec.sampling import SamplingParams
from specpipe.common.spec.tree import TokenTree
from specpipe.services.control import prune_to_proto, rows_to_proto, tensor_of
from specpipe.services.router.executor import answer_candidates
from specpipe.v1 import draft_pb2

from .router_fakes import deployment
from .test_controller import PROMPT, RuleDraft, RulePipeline, plain_decoding, rule
from .test_router_driver import EXPECTED, MODES, options, run_request

# what a step on the router would call if it crossed into torch
MAKERS = ("from_numpy", "tensor", "as_tensor", "empty", "zeros", "full", "arange", "cat", "isin")
READERS = ("tolist", "numpy", "numel", "item", "index_select")


@contextmanager
def no_torch(monkeypatch: pytest.MonkeyPatch):
    """Every call of `MAKERS` and of tensors' `READERS` is recorded (and refused)."""
    calls: list[str] = []

    def refuse(name: str):
        def refused(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"torch.{name} on the router's side of a step")

        return refused

    with monkeypatch.context() as m:
        for name in MAKERS:
            m.setattr(torch, name, refuse(name))
        for name in READERS:
            m.setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))
        yield calls


@pytest.mark.parametrize(("mode", "source"), MODES)
def test_the_router_drives_a_request_without_a_tensor(monkeypatch, mode, source) -> None:
    """Every mode through the request driver, its network executor and control streams
    (router_fakes.py), with torch refused: the output as ever, and no torch call."""
    dep = deployment()
    with no_torch(monkeypatch) as calls:
        _, out = run_request(dep, mode, options(source))
    assert calls == []
    assert out == EXPECTED


def test_commands_carry_numpy_and_their_tensor_views_are_equal() -> None:
    c = make_controller(Mode.SPECPIPE, "r", PROMPT, DecodeOptions(8, width=2, prefill_chunk=2), 3)
    cmds = c.start()
    propose = next(x for x in cmds if isinstance(x, Propose))
    answer = Candidates(np.array([0, 0]), np.array([rule(PROMPT), 1]), np.array([0.75, 0.25]))
    cmds += c.on_candidates(propose.ticket, answer)
    cmds += c.on_verified(Verified("r", (0,), (rule(PROMPT),), len(PROMPT) - 1))
    kinds = {type(x) for x in cmds}
    assert {Feed, Propose, BroadcastPrune, DraftPrune} <= kinds
    for cmd in cmds:
        if isinstance(cmd, Feed | Propose):
            rows = cmd.rows
            assert isinstance(rows, RowArrays) and "act" not in vars(cmd)
            arrays = (rows.positions, rows.node_ids, rows.parent_ids, rows.tokens)
            assert all(isinstance(a, np.ndarray) and a.dtype == np.int64 for a in arrays)
            act = cmd.act if isinstance(cmd, Feed) else cmd.layer
            assert act is (cmd.act if isinstance(cmd, Feed) else cmd.layer)  # made once
            assert act.committed == rows.committed and act.request_id == rows.request_id
            for t, a in zip(
                (act.positions, act.node_ids, act.parent_ids, act.tokens), arrays, strict=True
            ):
                assert t.dtype == torch.int64 and t.tolist() == a.tolist()
            assert rows_to_proto(rows) == rows_to_proto(act)
        elif isinstance(cmd, BroadcastPrune | DraftPrune):
            ids = cmd.ids
            assert isinstance(ids, PruneArrays) and "prune" not in vars(cmd)
            assert isinstance(ids.commit_ids, np.ndarray) and isinstance(ids.keep_ids, np.ndarray)
            p = cmd.prune
            assert p.horizon == ids.horizon
            assert p.commit_ids.tolist() == ids.commit_ids.tolist()
            assert p.keep_ids.tolist() == ids.keep_ids.tolist()
            assert prune_to_proto(ids, cmd.seq) == prune_to_proto(p, cmd.seq)


def test_rows_made_from_the_tree_are_the_tensors_they_were() -> None:
    tree = TokenTree(5, first_id=3)
    layer = tree.append_layer([0, 0], [7, 8], [0.6, 0.4], width=2)
    tree.append_layer(layer, [9, 10], [0.5, 0.5], width=2)
    rows = layer_rows("r", tree, np.arange(len(tree)), 11)
    act = rows.activation()
    assert act.positions.tolist() == [11, 12, 12, 13, 13]
    assert act.parent_ids.tolist() == [-1, 3, 3, 4, 5] and act.node_ids.tolist() == [3, 4, 5, 6, 7]
    assert act.tokens.tolist() == [5, 7, 8, 9, 10] and not act.committed
    chunks = prefill_chunks("r", [4, 5, 6, 7, 8], 3)
    assert [c.activation().positions.tolist() for c in chunks] == [[0, 1, 2], [3]]
    assert [c.activation().tokens.tolist() for c in chunks] == [[4, 5, 6], [7]]
    assert all(c.committed and c.activation().node_ids.numel() == 0 for c in chunks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_candidates_read_the_same_from_numpy_and_from_tensors(dtype) -> None:
    pid, tok = [3, 3, 4], [9, 2, 9]
    probs = torch.tensor([0.5, 0.25, 0.125], dtype=dtype)
    from_torch = pool_of(Candidates(torch.tensor(pid), torch.tensor(tok), probs))
    np_probs = probs.float().numpy() if dtype in (torch.bfloat16, torch.float16) else probs.numpy()
    from_numpy = pool_of(Candidates(np.array(pid), np.array(tok), np_probs))
    for a, b in zip(from_torch, from_numpy, strict=True):
        assert a.dtype == b.dtype and a.tolist() == b.tolist()
    assert from_torch[2].dtype == (np.float64 if dtype == torch.float64 else np.float32)


def test_a_draft_answer_reads_as_the_tensors_it_was_read_as() -> None:
    resp = draft_pb2.ProposeResponse(
        parent_ids=[4, 4, 9], token_ids=[11, 12, 13], probs=[0.7, 0.2, 0.1]
    )
    got = answer_candidates(resp)
    assert all(isinstance(a, np.ndarray) for a in (got.parent_ids, got.tokens, got.probs))
    before = (
        tensor_of(resp.parent_ids),
        tensor_of(resp.token_ids),
        tensor_of(resp.probs, np.float32),
    )
    for a, t in zip((got.parent_ids, got.tokens, got.probs), before, strict=True):
        assert str(t.dtype) == f"torch.{a.dtype}" and a.tolist() == t.tolist()


def test_beside_in_numpy_is_the_torch_formula_bit_for_bit() -> None:
    g = np.random.default_rng(0)
    for _ in range(20):
        n, m = int(g.integers(1, 9)), int(g.integers(1, 9))
        extra = Candidates(g.integers(0, 4, n), g.integers(0, 50, n),
                           g.random(n, dtype=np.float32), np.full(n, 2, np.int8))  # fmt: skip
        main = Candidates(g.integers(0, 4, m), g.integers(0, 50, m), g.random(m, dtype=np.float32))
        got = beside(pool_of(extra), pool_of(main))
        # the formula before session 45, in torch
        e_pid, m_pid = torch.from_numpy(extra.parent_ids), torch.from_numpy(main.parent_ids)
        match = e_pid[:, None] == m_pid[None, :]
        top = torch.where(match, torch.from_numpy(main.probs)[None, :], 0.0).amax(dim=1)
        want = torch.from_numpy(extra.probs) * (1.0 - top)
        assert got[2].dtype == np.float32 and got[2].tobytes() == want.numpy().tobytes()


class NumpyDraft(RuleDraft):
    """The rule draft, answering in numpy as the network executor hands answers over."""

    def propose(self, layer, top_k, temperature=0.0) -> Candidates:
        c = super().propose(layer, top_k, temperature)
        source = None if c.source is None else c.source.numpy()
        return Candidates(c.parent_ids.numpy(), c.tokens.numpy(), c.probs.numpy(), source)


@pytest.mark.parametrize(
    ("oracle", "source"), [(True, "draft"), (False, "draft"), (False, "hybrid")]
)
@pytest.mark.parametrize("mode", [Mode.SPECPIPE, Mode.SPECINFER])
@pytest.mark.parametrize("seed", [None, 3])
def test_numpy_answers_decide_as_tensor_answers(oracle, source, mode, seed) -> None:
    sampling = SamplingParams() if seed is None else SamplingParams(temperature=0.8, seed=seed)
    opts = DecodeOptions(20, width=3, token_source=source, sampling=sampling)
    runs = []
    for draft in (RuleDraft(oracle), NumpyDraft(oracle)):
        gen = LockstepGeneration(RulePipeline(3, rule), draft, PROMPT, mode, opts)
        runs.append((gen.run(), gen.stats.decode_steps, gen.stats.hits, gen.stats.trace))
    assert runs[0] == runs[1]
    if seed is None:
        assert runs[0][0] == plain_decoding(PROMPT, 20)
