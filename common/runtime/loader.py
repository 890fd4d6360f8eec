"""Builds an in-process deployment (stages + draft) from model directories.

The network deployment builds the same objects, one per process.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..model.config import ModelConfig
from ..model.loading import load_stage
from ..model.partition import LayerRange, plan_stages
from .draft import DraftRuntime
from .pipeline import LocalPipeline
from .stage import StageRuntime

ORACLE_DRAFT = "oracle"  # use the target itself as the draft (tests, upper bound)

DTYPES = {
    "float64": torch.float64,  # for exactness tests: rounding noise far below any CDF gap
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (choose from {sorted(DTYPES)})") from None


@dataclass
class InProcessDeployment:
    pipeline: LocalPipeline
    draft: DraftRuntime | None
    target_config: ModelConfig


def build_local(
    target_dir: str | Path,
    num_stages: int,
    draft_dir: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    layer_ranges: list[LayerRange] | None = None,
    split: str = "even",
) -> InProcessDeployment:
    """Load the target split into `num_stages` stages, and the draft (or the oracle draft).

    `split`: "even" (same number of layers per stage) or "balanced" (equal estimated cost
    per stage, counting the LM head; see `parameter_layer_costs`)."""
    cfg = ModelConfig.from_dir(target_dir)
    ranges = layer_ranges or plan_stages(cfg, num_stages, split)
    stages = [StageRuntime(load_stage(target_dir, r, dtype)) for r in ranges]
    draft = None
    if draft_dir is not None:
        draft_path = target_dir if str(draft_dir) == ORACLE_DRAFT else draft_dir
        draft_cfg = ModelConfig.from_dir(draft_path)
        if draft_cfg.vocab_size > cfg.vocab_size:
            raise ValueError(
                f"draft vocabulary ({draft_cfg.vocab_size}) is larger than the target's ({cfg.vocab_size})"
            )
        draft = DraftRuntime(load_stage(draft_path, None, dtype))
    return InProcessDeployment(LocalPipeline(stages), draft, cfg)
