"""How large a client's request may be, from the model's context
(docs/architecture.md, "9. Security").

A prompt that fits the context cannot be larger than `max_positions` tokens, so the
router refuses anything larger before it builds anything from it: the public gRPC
port's message cap and the HTTP API's body cap are derived from the context (not a
fixed 1 GiB), a token-id prompt is measured by its length before it is copied, and a
text prompt by its characters before it is tokenized (off the event loop).
"""

from __future__ import annotations

from pathlib import Path

# Text per token of any prompt that fits the context, generously: BPE tokens are a few
# bytes; runs of spaces or symbols that one token covers rarely reach 32 characters.
CHARS_PER_TOKEN = 32
# Room for everything else a request carries (options, stop ids, chat framing).
OVERHEAD_BYTES = 1 << 20
# Without a model yet (no --target): gRPC's own default.
DEFAULT_MAX_REQUEST_BYTES = 4 << 20


def max_prompt_chars(max_positions: int) -> int:
    return max_positions * CHARS_PER_TOKEN


def max_request_bytes(max_positions: int | None) -> int:
    """The largest request message or HTTP body the router reads (UTF-8 may take up to
    4 bytes a character)."""
    if not max_positions:
        return DEFAULT_MAX_REQUEST_BYTES
    return OVERHEAD_BYTES + 4 * max_prompt_chars(max_positions)


def context_of(model_dir: str | Path | None) -> int | None:
    """The context of the target a router is started with (--target), when it has a
    config.json; None otherwise (the stages tell it later)."""
    if not model_dir or not (Path(model_dir) / "config.json").is_file():
        return None
    from specpipe.common.model.config import ModelConfig

    try:
        return ModelConfig.from_dir(model_dir).max_position_embeddings
    except (ValueError, KeyError, OSError):
        return None
