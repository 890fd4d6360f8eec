"""Random models of a given shape: checkpoints for tests, benchmarks and `specpipe
selfcheck` (nothing downloaded), and stage models of real shapes for timings."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import ModelConfig
from .layers import StageModel
from .partition import LayerRange

# The shape of Qwen2.5-Coder-1.5B-Instruct (config.json), the default target.
QWEN25_1_5B = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
}


def save_random_model(
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
    max_positions: int = 256,
) -> Path:
    """Save a small random Llama or Qwen2 checkpoint (transformers' own classes, so the
    reference implementation reads it too); odd sizes and GQA by default.

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
        max_position_embeddings=max_positions,
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
        raise ValueError(f"unknown architecture {arch!r} (llama or qwen2)")
    model.eval().save_pretrained(path)
    return path


def random_stage(
    raw_config: dict,
    layers: LayerRange,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> StageModel:
    """A stage of a model of `raw_config`'s shape (a config.json dict) with random weights,
    made on `device` directly (a real-shape stage for timings, no checkpoint on disk)."""
    cfg = ModelConfig.from_dict(raw_config)
    torch.manual_seed(seed)
    with torch.device(device):
        model = StageModel(cfg, layers).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.eval()
