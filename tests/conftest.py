"""Shared fixtures: tiny random models made in the test session (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Tiny models gain nothing from intra-op threads, and on a 2-core machine shared with
# service processes the threads only contend.
torch.set_num_threads(1)


def make_tiny_model(
    path: Path,
    arch: str = "llama",
    *,
    layers: int = 4,
    hidden: int = 48,
    heads: int = 6,
    kv_heads: int = 2,
    vocab: int = 97,
    tied: bool = False,
    seed: int = 0,
    init: float = 0.6,
) -> Path:
    """Save a small random Llama or Qwen2 checkpoint; odd sizes and GQA by default.

    A large init std makes the next-token distributions peaked, like a trained model's,
    so greedy decoding has no near-ties that float noise could flip.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2 - 6,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        initializer_range=init,
        eos_token_id=vocab - 1,
        bos_token_id=0,
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():  # random biases so the qkv-bias path is exercised
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, init)
    else:
        raise ValueError(arch)
    model.eval().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", layers=5, seed=0)


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("qwen2"),
        "qwen2",
        layers=3,
        hidden=40,
        heads=5,
        kv_heads=1,
        tied=True,
        seed=1,
    )


@pytest.fixture(scope="session")
def unrelated_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random model sharing only the vocabulary: its guesses are mostly wrong."""
    return make_tiny_model(
        tmp_path_factory.mktemp("draft"), "llama", layers=2, hidden=32, heads=4, kv_heads=2, seed=7
    )
