"""Loads models into runtimes: the in-process deployment (stages + draft) the command line
and the tests step, and the one stage or draft a network service holds.

Both build the same objects from the same loaders; the network deployment builds one per
process.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..model.config import ModelConfig
from ..model.lean_draft import lean_draft
from ..model.loading import load_stage, weight_fingerprint
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


def load_runtime(
    model_dir: str | Path,
    layers: LayerRange | None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_cache_bytes: int | None = None,
    batch_invariant: bool | None = None,
) -> StageRuntime:
    """A stage runtime holding `layers` of a model directory (None: every layer);
    `batch_invariant` as in `load_stage`."""
    model = load_stage(model_dir, layers, dtype, device, batch_invariant=batch_invariant)
    return StageRuntime(model, max_cache_bytes)


def load_draft(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_cache_bytes: int | None = None,
    lean: bool = True,
) -> DraftRuntime:
    """A draft runtime holding the whole model of a directory. Its rows need not be
    batch-invariant (`batch_invariant`), nor its forward give the reference's bits
    (`lean`: `lean_draft`'s fewer operations where it applies): the target's
    verification decides every token."""
    model = load_stage(model_dir, None, dtype, device, batch_invariant=False)
    return DraftRuntime(lean_draft(model) if lean else model, max_cache_bytes)


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
    device: str | torch.device = "cpu",
    max_cache_bytes: int | None = None,
) -> InProcessDeployment:
    """Load the target split into `num_stages` stages, and the draft (or the oracle draft).

    `split`: "even" (same number of layers per stage) or "balanced" (equal estimated cost
    per stage, counting the LM head; see `parameter_layer_costs`). Every stage and the
    draft on `device` (one process, one device), each with a KV pool of
    `max_cache_bytes` (None: the default, allocated at first use)."""
    cfg = ModelConfig.from_dir(target_dir)
    ranges = layer_ranges or plan_stages(cfg, num_stages, split)
    stages = [load_runtime(target_dir, r, dtype, device, max_cache_bytes) for r in ranges]
    draft = None
    if draft_dir is not None:
        draft_path = target_dir if str(draft_dir) == ORACLE_DRAFT else draft_dir
        draft_cfg = ModelConfig.from_dir(draft_path)
        if draft_cfg.vocab_size > cfg.vocab_size:
            raise ValueError(
                f"draft vocabulary ({draft_cfg.vocab_size}) is larger than the target's ({cfg.vocab_size})"
            )
        # the oracle, the upper bound tests hold proposals to, is the target to the bit
        oracle = str(draft_dir) == ORACLE_DRAFT
        draft = load_draft(draft_path, dtype, device, max_cache_bytes, lean=not oracle)
    return InProcessDeployment(LocalPipeline(stages), draft, cfg)


@dataclass
class LoadedModel:
    """A network stage's model: its runtime and what the stage reports about it."""

    runtime: StageRuntime
    model_id: str
    weight_hash: str
    max_positions: int
    eos_token_ids: tuple[int, ...]
    row_budget: int = 0  # rows a step takes nearly free, once measured (0: not measured)
    cost_curve: object | None = None  # perf.cost_model.CostCurve, once measured
    model_dir: str = ""  # where it was loaded from (its tokenizer: structured output)


def load_model(
    model_dir: str | Path,
    layers: tuple[int, int] | None,
    dtype: str = "float32",
    model_id: str = "",
    device: str = "cpu",
    max_cache_bytes: int | None = None,
    batch_invariant: bool | None = None,
) -> LoadedModel:
    """Load layers [a, b) of a model directory as a stage (None: all layers; b = 0: to the
    last layer, as in `ConfigureStageRequest`); `batch_invariant` as in `load_stage`."""
    cfg = ModelConfig.from_dir(model_dir)
    rng = None
    if layers is not None:
        a, b = layers
        rng = LayerRange(a, b or cfg.num_layers, cfg.num_layers)
    runtime = load_runtime(
        model_dir, rng, parse_dtype(dtype), device, max_cache_bytes, batch_invariant
    )
    return LoadedModel(
        runtime=runtime,
        model_id=model_id or Path(model_dir).name,
        weight_hash=weight_fingerprint(model_dir),
        max_positions=cfg.max_position_embeddings,
        eos_token_ids=cfg.eos_token_ids,
        model_dir=str(model_dir),
    )
