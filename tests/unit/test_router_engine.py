"""The router's request engine (services/router/engine.py) against in-process fake
stages and drafts (router_fakes.py): one request from any front end, checked once,
admitted, run on a path and answered as started, deltas and finished."""

from __future__ import annotations

import asyncio

from specpipe.services.client import build_request

from ..router_config import router_engine
from .router_fakes import TEXT, deployment

PROMPT = TEXT[:12]
NEW = 24


def test_a_request_is_checked_once_and_streamed_as_typed_events() -> None:
    async def main():
        dep = deployment()
        engine = router_engine(["127.0.0.1:9"])
        await engine.backends.close()
        engine.backends, engine.inbox = dep.backends, dep.inbox
        for b in dep.backends.all:
            b.desc.max_step_rows = 0  # no limit published
        checks = []
        check_model = engine.check_model
        engine.check_model = lambda name: checks.append(name) or check_model(name)
        request = build_request(prompt_ids=PROMPT, max_new_tokens=NEW, width=4)
        events = [r async for r in engine.generate(request)]
        await asyncio.sleep(0.05)  # the release runs in the background
        engine._tokenizing.shutdown()
        return engine, dep, checks, events

    engine, dep, checks, events = asyncio.run(asyncio.wait_for(main(), 60))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "started" and kinds[-1] == "finished"
    assert set(kinds[1:-1]) == {"delta"}
    tokens = [t for e in events[1:-1] for t in e.delta.token_ids]
    assert tokens == TEXT[len(PROMPT) : len(PROMPT) + NEW]
    finished = events[-1].finished
    assert finished.usage.prompt_tokens == len(PROMPT)
    assert finished.usage.completion_tokens == NEW
    assert checks == [""]  # the model, once per request
    assert not engine.drivers and not engine.scheduler.running
    for b in [*dep.stages, *dep.drafts]:
        assert set(b.stub.opened) <= set(b.stub.released), b.label
