"""The endpoints vLLM serves beside the OpenAI API, in vLLM's shapes, for the tools built
for it: `POST /tokenize` ({model, prompt} or {model, messages, add_generation_prompt}
-> {count, max_model_len, tokens}), `POST /detokenize` ({model, tokens} -> {prompt}),
`GET /version` and `GET /metrics` (the router's Prometheus registry, its `vllm:` series
included: services/metrics.py). `http_api` serves them on the HTTP port, behind the API
key like the rest of the port; /metrics as `--http-metrics` says (METRICS_ACCESS).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from .openai_compat import ChatMessage, Int64, Text, bad_request

# --http-metrics: /metrics on the HTTP port behind the API key, open to anyone, or not
# served there (the --metrics-port server is the operator's either way).
METRICS_KEY, METRICS_OPEN, METRICS_OFF = "key", "open", "off"
METRICS_ACCESS = (METRICS_KEY, METRICS_OPEN, METRICS_OFF)


class TokenizeRequest(BaseModel):
    """vLLM's CompletionTokenizeRequest and ChatTokenizeRequest in one: `prompt`, or
    `messages` (with `tools`) through the chat template."""

    model_config = ConfigDict(extra="allow")

    model: Text = ""
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # vLLM: True for a prompt, False for messages
    return_token_strs: bool = False
    tools: list[Any] | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give either prompt or messages", "prompt")


class DetokenizeRequest(BaseModel):
    model: Text = ""
    tokens: list[Int64]


def tokenize_answer(
    tokens: list[int], max_model_len: int, names: list[str] | None
) -> dict[str, Any]:
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens,
            "token_strs": names}  # fmt: skip


def encode_prompt(codec, text: str, add_special_tokens: bool) -> list[int]:
    """A /tokenize prompt's tokens (an empty prompt has none)."""
    return list(codec.tokenizer.encode(text, add_special_tokens=add_special_tokens))


def decode_tokens(codec, tokens: list[int], vocab_size: int) -> str:
    """A /detokenize answer's text: ids outside the vocabulary are a 400."""
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                          "tokens")  # fmt: skip
    return codec.decode(tokens)
