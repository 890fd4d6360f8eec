"""Forced tokens on a JSON-schema workload: the hit rate and tokens per step of specpipe
with and without the controller placing the one token a grammar allows in the tree
(`growth.with_forced_tokens`), in one process (the lockstep engine), and a check that
both emit the same tokens.

No model is downloaded: the target and the unrelated draft are random models made here
(tests/conftest.py's kind), so the draft's own hit rate is what a poor draft gets; the
oracle (the target as its draft) is the upper bound and the n-gram source the
model-free one. Two tokenizers: characters (97 ids: every forced character is one
forced token) and a byte-level BPE of 512 tokens trained here on JSON text (several
tokenizations of the same forced text are allowed, so fewer positions are forced).

    .venv/bin/python benchmarks/bench_forced_tokens.py [--tokenizers char,bpe]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from specpipe.common.model.synthetic import save_random_model
from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local
from specpipe.common.runtime.lockstep import LockstepGeneration
from specpipe.common.spec.grammar import Grammar, ResponseFormat, load_grammar_tokenizer
from specpipe.common.spec.options import DecodeOptions, Mode
from specpipe.common.spec.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/ for the char tokenizer
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
           "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
           "additionalProperties": False}  # fmt: skip
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
        "required": ["zone"], "additionalProperties": False}  # fmt: skip
# tool_choice "required" over two tools (services/router/tool_calls.py's shape), a
# record, and an enum-heavy event
SCHEMAS = {
    "tool_calls": {"type": "array", "minItems": 1, "maxItems": 2, "x-guidance": COMPACT,
                   "items": {"anyOf": [
                       {"type": "object", "properties": {"name": {"const": n}, "arguments": s},
                        "required": ["name", "arguments"], "additionalProperties": False}
                       for n, s in (("get_weather", WEATHER), ("get_time", TIME))]}},
    "person": {"type": "object", "x-guidance": COMPACT, "additionalProperties": False,
               "properties": {"name": {"type": "string", "maxLength": 8},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120},
                              "email_verified": {"type": "boolean"}},
               "required": ["name", "age", "email_verified"]},
    "event": {"type": "object", "x-guidance": COMPACT, "additionalProperties": False,
              "properties": {"severity": {"enum": ["debug", "info", "warning", "error"]},
                             "component": {"enum": ["router", "stage", "draft"]},
                             "retryable": {"type": "boolean"}},
              "required": ["severity", "component", "retryable"]},
}  # fmt: skip
PROMPTS = ["JSON: ", "The record: "]
SAMPLINGS = [SamplingParams(), SamplingParams(temperature=0.8, seed=5)]
SOURCES = ("unrelated", "ngram", "oracle")
MAX_TOKENS = 96


def char_tokenizer(d: Path) -> None:
    from tests.integration.conftest import add_char_tokenizer

    add_char_tokenizer(d)


def bpe_tokenizer(vocab: int):
    """A byte-level BPE of at most `vocab` tokens (the last one </s>) trained on JSON
    text (transformers' tokenizer: save it with the model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["city", "unit", "celsius", "fahrenheit", "zone", "name", "arguments", "get_time",
             "get_weather", "age", "email_verified", "severity", "component", "retryable",
             "router", "stage", "draft", "true", "false", "Paris", "Oslo", "JSON", "record"]  # fmt: skip
    corpus = [
        json.dumps(
            {
                rng.choice(words): rng.choice([*words, rng.randint(0, 120)])
                for _ in range(rng.randint(1, 4))
            }
        )
        for _ in range(4000)
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens(["</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="</s>")


def models(root: Path, kind: str) -> tuple[Path, Path, int]:
    bpe = bpe_tokenizer(512) if kind == "bpe" else None
    vocab = 97 if bpe is None else len(bpe)
    target = save_random_model(root / f"{kind}-target", "llama", layers=4, vocab=vocab, seed=0)
    draft = save_random_model(root / f"{kind}-draft", "llama", layers=2, hidden=32, heads=4,
                              kv_heads=2, vocab=vocab, seed=7)  # fmt: skip
    if bpe is None:
        char_tokenizer(target)
    else:
        bpe.save_pretrained(target)
    return target, draft, vocab


def run(kind: str, root: Path) -> list[dict]:
    target, draft_dir, vocab = models(root, kind)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(target)
    eos = hf.convert_tokens_to_ids("</s>")
    gtok = load_grammar_tokenizer(str(target), vocab, (eos,))
    rows = []
    for source in SOURCES:
        draft = {"unrelated": draft_dir, "oracle": ORACLE_DRAFT, "ngram": None}[source]
        dep = build_local(target, 2, draft, torch.float32)
        for k in (1, 2):
            totals = {
                True: [0, 0, 0, 0, 0.0],
                False: [0, 0, 0, 0, 0.0],
            }  # tokens, hits, forced, steps, cpu
            same = 0
            for schema in SCHEMAS.values():
                grammar = Grammar(
                    ResponseFormat("json_schema", json.dumps(schema)).grammar_text(), gtok
                )
                for prompt in PROMPTS:
                    ids = hf.encode(prompt)
                    for sampling in SAMPLINGS:
                        out = {}
                        for forced in (True, False):
                            opts = DecodeOptions(
                                max_new_tokens=MAX_TOKENS, sampling=sampling, width=4,
                                layers_per_step=k, stop_token_ids=(eos,), grammar=grammar,
                                token_source="ngram" if source == "ngram" else "draft",
                            )  # fmt: skip
                            opts = replace(opts, forced_tokens=forced)
                            t0 = time.process_time()
                            gen = LockstepGeneration(
                                dep.pipeline, dep.draft, ids, Mode.SPECPIPE, opts
                            )
                            out[forced] = gen.run()
                            st = gen.stats
                            t = totals[forced]
                            t[0] += st.new_tokens
                            t[1] += st.hits
                            t[2] += st.forced_hits
                            t[3] += st.decode_steps
                            t[4] += time.process_time() - t0
                        same += out[True] == out[False]
            requests = len(SCHEMAS) * len(PROMPTS) * len(SAMPLINGS)
            row = {"tokenizer": kind, "source": source, "layers_per_step": k,
                   "requests": requests, "same_tokens": same}  # fmt: skip
            for forced, (n, hits, fh, steps, cpu) in totals.items():
                tag = "forced" if forced else "plain"
                row[f"{tag}_tokens"] = n
                row[f"{tag}_hit_rate"] = round(hits / n, 4)
                row[f"{tag}_forced_share"] = round(fh / n, 4)
                row[f"{tag}_tokens_per_step"] = round(n / steps, 4)
                row[f"{tag}_cpu_s"] = round(cpu, 2)
            rows.append(row)
            print(
                f"{kind:4} {source:9} K={k}: hit rate {row['plain_hit_rate']:.3f} -> "
                f"{row['forced_hit_rate']:.3f} (forced {row['forced_forced_share']:.3f}), "
                f"tokens/step {row['plain_tokens_per_step']:.3f} -> "
                f"{row['forced_tokens_per_step']:.3f}, same tokens {same}/{requests}, "
                f"CPU {row['plain_cpu_s']:.1f} -> {row['forced_cpu_s']:.1f} s",
                flush=True,
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/forced-tokens-{tokenizer}.json")
    p.add_argument("--tokenizers", default="char,bpe")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.tokenizers.split(","):
            rows = run(kind, Path(tmp))
            out = Path(args.out.format(tokenizer=kind))
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(rows, indent=1) + "\n")
            print(f"saved {out}")


if __name__ == "__main__":
    main()
