"""Emulated devices through the services (`--emulate-costs`): a stage paces its forwards
on its compute thread and keeps answering calls meanwhile; a deployment whose stages and
draft are paced to a flat model emits exactly the engine's tokens and takes at least the
modelled time per token (lower bounds only: a loaded machine can only be slower)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import pytest
import torch
from specpipe.common.model.loading import load_stage
from specpipe.common.model.partition import LayerRange
from specpipe.common.perf.emulate import EmulatedCosts, Pacer
from specpipe.common.runtime.loader import LoadedModel
from specpipe.common.runtime.stage import StageRuntime
from specpipe.common.spec.messages import Activation
from specpipe.services.control import rows_to_proto
from specpipe.services.stage_service import StageService
from specpipe.services.transport import Inbox, make_transport
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import stage_pb2, stage_pb2_grpc

from specpipe.client import Client

from .conftest import reference_run, start
from .test_services_stage import _drawn, _greedy, _open_last

STAGE_SECONDS, DRAFT_SECONDS = 0.2, 0.05
ROOT = torch.tensor([0])


def _feed(seq: int, act: Activation, tokens: list[int]) -> stage_pb2.FeedRequest:
    return stage_pb2.FeedRequest(request_id="r", seq=seq, rows=rows_to_proto(act), token_ids=tokens)


def test_a_paced_stage_answers_calls_while_its_forward_sleeps(llama_dir) -> None:
    """The pacer sleeps on the compute thread: a Describe is answered while a forward's
    modelled time has not run out (held here until the test lets it go), and the token
    drawn is the unpaced model's."""
    asleep, go = threading.Event(), threading.Event()

    def held_sleep(seconds: float) -> None:
        asleep.set()
        assert go.wait(60)

    def stage() -> LoadedModel:
        runtime = StageRuntime(load_stage(llama_dir, LayerRange(0, 5, 5), torch.float64))
        return LoadedModel(runtime, "m", "h", 256, ())

    async def main() -> None:
        inbox = Inbox()
        out = inbox.open("r")
        router = make_transport("tcp", inbox)
        router_addr = await router.start()
        svc = StageService(stage())
        # its clock stands still: the rest of each modelled forward is slept (held here)
        frozen = lambda: 0.0  # noqa: E731
        svc.pacer = Pacer(EmulatedCosts.flat(STAGE_SECONDS).stage(), clock=frozen, sleep=held_sleep)
        port = await svc.start()
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = stage_pb2_grpc.StageStub(ch)
        try:
            open_ = _open_last("r", router_addr)
            await stub.Open(open_)
            prefill = Activation("r", torch.tensor([0, 1]), committed=True)
            await stub.Feed(_feed(0, prefill, [5, 9]))
            assert await asyncio.to_thread(asleep.wait, 60)  # the forward ran; now it sleeps
            described = await stub.Describe(pb.DescribeRequest(), timeout=60)
            assert described.active_requests == 1
            root = Activation("r", torch.tensor([2]), node_ids=ROOT, parent_ids=-ROOT - 1)
            await stub.Feed(_feed(1, root, [13]))
            assert out.empty() and not go.is_set()  # the prefill is still being paced
            go.set()
            frame = await asyncio.wait_for(out.get(), 60)
        finally:
            go.set()
            await ch.close()
            await svc.stop()
            await router.close()
        assert _drawn(frame) == ([0], _greedy(llama_dir, (5, 9, 13), 1), 2)
        assert svc.pacer.forwards == 2  # the prefill, then the root
        assert svc.pacer.modelled_seconds == pytest.approx(2 * STAGE_SECONDS)

    asyncio.run(main())


@pytest.fixture(scope="module")
def emulated(llama_dir, tmp_path_factory):
    """2 stages and the target as its own draft, every forward paced to a flat model."""
    path = tmp_path_factory.mktemp("costs") / "flat.json"
    path.write_text(json.dumps({"flat": {"stage": STAGE_SECONDS, "draft": DRAFT_SECONDS}}))
    dep = start(llama_dir, "oracle", 2, "tcp", emulate_costs=path)
    try:
        yield dep
    finally:
        dep.stop()


def _stream(address: str, prompt: list[int], mode: str, n: int) -> tuple[list[int], list[float]]:
    times = []
    with Client(address, timeout=120) as client:
        stream = client.stream(prompt_ids=prompt, mode=mode, max_new_tokens=n, ignore_eos=True)
        for chunk in stream:
            times += [time.perf_counter()] * len(chunk.token_ids)
        return stream.result().token_ids, times


@pytest.mark.parametrize("mode", ["pp", "specpipe"])
def test_emulated_deployment_is_exact_and_takes_the_modelled_time(emulated, mode) -> None:
    prompt, n = [3, 14, 15, 92, 65], 6
    tokens, times = _stream(emulated.router_address, prompt, mode, n)
    assert tokens == reference_run(emulated.target, emulated.draft, 2, prompt, mode, n).output
    # pp: every token crosses both stages, one paced forward each; specpipe: at least one
    # pipeline step (one paced forward) per token.
    per_token = (2 if mode == "pp" else 1) * STAGE_SECONDS
    assert times[-1] - times[0] >= (n - 1) * per_token


SLOW_DRAFT = {"flat": {"stage": 0.01, "draft": 0.25}}  # every draft answer is late


@pytest.fixture(scope="module", params=[0, 10000, None], ids=["no-wait", "wait", "step-wait"])
def slow_draft(request, llama_dir, tmp_path_factory):
    """2 stages paced to 10 ms a forward, the draft to 250 ms; the router waits up to
    `param` ms for a late draft answer (0: never; None: its default, one step)."""
    path = tmp_path_factory.mktemp("costs") / "slow_draft.json"
    path.write_text(json.dumps(SLOW_DRAFT))
    policy = {} if request.param is None else {"late_draft_wait_ms": request.param}
    dep = start(llama_dir, "oracle", 2, "tcp", emulate_costs=path, scheduling=policy)
    try:
        yield dep, request.param
    finally:
        dep.stop()


def test_the_late_draft_policy(slow_draft) -> None:
    """Without a wait, verifications pass late draft answers by (the tree misses layers
    lockstep would have had: more steps); with one, every step waits for the draft as in
    lockstep: the same steps as the engine; the default waits a step at most, and this
    draft is late by 25 (its waits run out). The tokens are plain decoding's either way."""
    dep, wait = slow_draft
    prompt, n = [3, 14, 15, 92, 65], 12
    ref = reference_run(dep.target, dep.draft, 2, prompt, "specpipe", n)
    with Client(dep.router_address, timeout=120) as client:
        got = client.generate(prompt_ids=prompt, max_new_tokens=n, ignore_eos=True)
    assert got.token_ids == ref.output
    if wait is None:
        assert got.stats["late_draft_answers"] > 0
    elif wait:
        assert got.stats["late_draft_answers"] == 0
        assert got.stats["decode_steps"] == ref.stats.decode_steps
    else:
        assert got.stats["late_draft_answers"] > 0
        assert got.stats["decode_steps"] > ref.stats.decode_steps
