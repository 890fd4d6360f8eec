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


def test_a_streamed_chat_checks_the_model_once_and_waits_for_min_tokens(tmp_path) -> None:
    """The HTTP API over the engine, in one process: a streamed chat request's model is
    checked once on its whole walk; a stop string is honoured only once min_tokens
    tokens are out (the engine starts a delta there, the API cuts the text): here a
    delta of 6 tokens (3 tree layers on 2 stages) holds both sides of min_tokens."""
    import openai
    from specpipe.services.router.http_api import HttpServer
    from specpipe.services.router.requests import load_codec

    from tests.integration.conftest import add_char_tokenizer

    tokenizer = str(add_char_tokenizer(tmp_path))

    async def main():
        dep = deployment()
        engine = router_engine(["127.0.0.1:9"], target=tokenizer)
        await engine.backends.close()
        engine.backends, engine.inbox = dep.backends, dep.inbox
        engine.codec = load_codec(tokenizer)
        for b in dep.backends.all:
            b.desc.max_step_rows = 0  # no limit published
        checks = []
        check_model = engine.check_model
        engine.check_model = lambda name: checks.append(name) or check_model(name)
        http = HttpServer(engine)
        port = await http.start("127.0.0.1", 0)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        kw = dict(model="", messages=[{"role": "user", "content": "hi"}], max_tokens=NEW,
                  temperature=0, stream=True)  # fmt: skip

        async def text(min_tokens: int = 0, **extra) -> str:
            body = {"layers_per_step": 3, "min_tokens": min_tokens}
            chunks = [c async for c in await client.chat.completions.create(
                **kw, **extra, extra_body=body)]  # fmt: skip
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        try:
            whole = await text()
            seen = list(checks)
            stop = whole[7:9]  # ends with the 9th token; again 11 tokens later
            cut = [await text(m, stop=[stop]) for m in (0, 12)]
        finally:
            await client.close()
            await http.stop()
            await asyncio.sleep(0.05)  # the releases run in the background
            engine._tokenizing.shutdown()
        return whole, seen, stop, cut

    whole, seen, stop, (early, late) = asyncio.run(asyncio.wait_for(main(), 60))
    assert len(whole) == NEW and seen == [""]  # a character a token; the model once
    assert early == whole[: whole.find(stop)]
    at = next((i for i in range(NEW) if whole.startswith(stop, i) and i + len(stop) >= 12), NEW)
    assert late == whole[:at] and len(late) > len(early)
