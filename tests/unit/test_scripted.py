"""The scripted target (`runtime/scripted.py`) stands in for the real one under greedy
decoding: the same tokens, steps and rows per stage, so tree-policy studies with it
measure what the real pipeline would do."""

from __future__ import annotations

import pytest
import torch
from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local
from specpipe.common.runtime.lockstep import LockstepGeneration
from specpipe.common.runtime.scripted import ScriptedPipeline
from specpipe.common.spec.options import DecodeOptions, Mode

PROMPT = [3, 17, 42, 5, 61, 8, 23]


@pytest.mark.parametrize(
    ("mode", "opts"),
    [
        (Mode.SPECPIPE, {"layers_per_step": 1}),
        (Mode.SPECPIPE, {"layers_per_step": 2}),
        (Mode.SPECPIPE, {"layers_per_step": 3, "growth": "eager"}),
        (Mode.SPECINFER, {"depth": 3}),
        (Mode.PP, {}),
    ],
)
@pytest.mark.parametrize("draft", ["oracle", "unrelated"])
def test_the_scripted_target_takes_the_real_pipelines_steps_and_rows(
    llama_dir, unrelated_draft_dir, mode, opts, draft
) -> None:
    stages = 3
    draft_dir = ORACLE_DRAFT if draft == "oracle" else unrelated_draft_dir
    dep = build_local(llama_dir, stages, draft_dir, torch.float64)
    o = DecodeOptions(max_new_tokens=20, width=3, prefill_chunk=4, **opts)
    real = LockstepGeneration(dep.pipeline, dep.draft, PROMPT, mode, o)
    tokens = real.run()
    vocab = dep.pipeline.vocab_size
    scripted = LockstepGeneration(ScriptedPipeline(PROMPT + tokens, stages, vocab), dep.draft,
                          PROMPT, mode, o)  # fmt: skip
    assert scripted.run() == tokens
    a, b = real.stats, scripted.stats
    assert (a.decode_steps, a.hits, a.regrowths) == (b.decode_steps, b.hits, b.regrowths)
    assert a.trace == b.trace  # rows every stage computed at every step, and the draft's
    assert a.emit_steps == b.emit_steps


def test_the_scripted_target_can_only_continue_its_script() -> None:
    """Rows off the script get token 0's row: a run that drew from one would emit 0."""
    pipe = ScriptedPipeline([1, 2, 3, 4], 1, 10)
    gen = LockstepGeneration(pipe, None, [1, 2], Mode.PP, DecodeOptions(max_new_tokens=2))
    assert gen.run() == [3, 4]
