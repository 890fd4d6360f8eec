"""What structured output costs per request (docs/architecture.md, "3. The pipeline step",
"Structured output"), with a real model's tokenizer: loading the grammar library's view
of it (once per process), compiling a response_format and building its matcher (per
request, at the router and at the last stage, and a state from it; also for a schema
of 1,000 properties, about 100 kB), and per output token the last stage's mask and its
application to a logits row, the token's step through the matcher (both sides), and
the router's check of a tree layer's proposals (64 children of depth-4 paths). Medians
over a JSON document's tokens, one torch thread.

    python benchmarks/bench_grammar.py [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch
from specpipe.common.model.config import ModelConfig
from specpipe.common.spec.grammar import Grammar, ResponseFormat, load_grammar_tokenizer
from specpipe.common.store.resolver import resolve_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["math", "poetry", "engines"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
}
CHILDREN, DEPTH = 64, 4
# A large schema: 1,000 properties, alternately a pattern-checked string or integer and
# a small object (about 100 kB of JSON); DOCUMENT does not follow it (compile cost only).
LARGE = {
    "type": "object",
    "properties": {
        f"field_{i}": {"type": ["string", "integer", "null"], "pattern": "^[a-z]{1,8}$"}
        if i % 2
        else {"type": "object", "properties": {"a": {"type": "number"}, "b": {"enum": ["x", "y"]}}}
        for i in range(1000)
    },
    "required": [f"field_{i}" for i in range(0, 1000, 3)],
}


def timed(fn: Callable[..., object], *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def check_children(state, path: list[int], children: list[int]) -> list[bool]:
    return [state.allows(path, c) for c in children]


def median_us(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e6:.0f} us (max {max(samples) * 1e6:.0f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a model name or directory")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = resolve_model(args.model)
    cfg = ModelConfig.from_dir(model)
    start = time.perf_counter()
    tok = load_grammar_tokenizer(str(model), cfg.vocab_size, cfg.eos_token_ids)
    print(f"{model.name}: vocabulary {cfg.vocab_size}, tokenizer for the grammar library "
          f"{time.perf_counter() - start:.2f} s (once per process)")  # fmt: skip
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model / "tokenizer.json")).encode(json.dumps(DOCUMENT)).ids
    rng = random.Random(0)
    logits = torch.randn(cfg.vocab_size)
    formats = {
        "json_object": ResponseFormat("json_object"),
        "json_schema": ResponseFormat("json_schema", json.dumps(SCHEMA)),
    }
    large = ResponseFormat("json_schema", json.dumps(LARGE))
    compile_s = statistics.median(timed(large.grammar_text) for _ in range(5))
    build_s = statistics.median(timed(Grammar, large.grammar_text() or "", tok) for _ in range(5))
    print(f"json_schema of {len(large.schema) / 1e3:.0f} kB: compile {compile_s * 1e3:.0f} ms, "
          f"parser {build_s * 1e3:.0f} ms")  # fmt: skip
    for name, fmt in formats.items():
        compile_s = statistics.median(timed(fmt.grammar_text) for _ in range(20))
        text = fmt.grammar_text() or ""
        build_s = statistics.median(timed(Grammar, text, tok) for _ in range(20))
        grammar = Grammar(text, tok)
        state_s = statistics.median(timed(grammar.state) for _ in range(20))
        state, masks, applies, steps, checks = grammar.state(), [], [], [], []
        for i, token in enumerate(ids):
            masks.append(timed(state.allowed, cfg.vocab_size))
            applies.append(timed(state.constrain, logits))
            path = ids[i : i + DEPTH]
            if len(path) == DEPTH:
                children = [rng.randrange(cfg.vocab_size) for _ in range(CHILDREN)]
                checks.append(timed(check_children, state, path, children))
            steps.append(timed(state.advance, [token]))
        print(f"{name}: compile {compile_s * 1e3:.2f} ms, parser {build_s * 1e3:.2f} ms, a "
              f"state (a copy of it) {state_s * 1e6:.0f} us; "
              f"per token ({len(ids)}): mask {median_us(masks)}, mask and apply "
              f"{median_us(applies)}, matcher step {median_us(steps)}; {CHILDREN} children "
              f"of depth-{DEPTH} paths {median_us(checks)}")  # fmt: skip


if __name__ == "__main__":
    main()
