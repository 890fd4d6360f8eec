"""The plain reference of the logits rules: transformers' model in fp64 over the whole
sequence at each step, and vLLM's definitions written out densely over the vocabulary
(grammar mask, logit bias and min_tokens, repetition, frequency and presence
penalties), then the sampling rule. Independent of `common/spec/penalties.py`, which
every mode's last stage applies sparsely along the tree: the tests compare the two."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from specpipe.common.spec.sampling import SamplingParams, draw_index
from transformers import AutoModelForCausalLM


def rules_applied(
    logits: torch.Tensor,
    sampling: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    min_tokens: int = 0,
    stops: Sequence[int] = (),
    allowed: np.ndarray | None = None,
) -> torch.Tensor:
    """vLLM's processing of one step's logits [vocab] (fp64), before temperature."""
    x = logits.double().clone()
    vocab = x.numel()
    if allowed is not None:
        if len(output) < min_tokens:
            without = allowed.copy()
            without[[s for s in stops if s < vocab]] = False
            allowed = without if without.any() else allowed
        x[~torch.from_numpy(allowed)] = -math.inf
    for token, bias in sampling.logit_bias.items():
        x[token] += bias
    if allowed is None and len(output) < min_tokens:
        x[list(stops)] = -math.inf
    counts = torch.bincount(torch.tensor(list(output), dtype=torch.long), minlength=vocab)
    in_output = counts > 0
    in_prompt = torch.zeros(vocab, dtype=torch.bool)
    in_prompt[list(prompt)] = True
    rep = sampling.repetition_penalty
    penalized = torch.where(x > 0, x / rep, x * rep)
    x = torch.where(in_prompt | in_output, penalized, x)
    x = x - sampling.frequency_penalty * counts.double()
    x = x - sampling.presence_penalty * in_output.double()
    return x


def plain_decode(
    model_dir,
    prompt: Sequence[int],
    sampling: SamplingParams,
    max_new_tokens: int,
    stops: Sequence[int] = (),
    min_tokens: int = 0,
    grammar_allowed: Callable[[list[int]], np.ndarray] | None = None,
) -> list[int]:
    """The reference loop: each step the whole sequence through transformers' model,
    the rules on its last logits, the token drawn with (seed, position); it ends at a
    stop token or `max_new_tokens`. `grammar_allowed(output)`: the grammar's allowed
    tokens after `output` (None: no grammar)."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    seq, out = list(prompt), []
    with torch.no_grad():
        while len(out) < max_new_tokens:
            logits = hf(torch.tensor([seq])).logits[0, -1]
            allowed = None if grammar_allowed is None else grammar_allowed(out)
            x = rules_applied(logits, sampling, prompt, out, min_tokens, stops, allowed)
            token = int(draw_index(x, sampling, len(out)))
            out.append(token)
            seq.append(token)
            if token in stops:
                break
    return out
