"""Tokenization, chat templates and streaming detokenization for a model directory."""

from __future__ import annotations

from pathlib import Path


class TokenizerError(ValueError):
    """The model directory has no usable tokenizer, or the prompt cannot be encoded."""


class TextCodec:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TextCodec:
        from transformers import AutoTokenizer

        try:
            return cls(AutoTokenizer.from_pretrained(str(model_dir)))
        except (OSError, ValueError, TypeError) as e:
            raise TokenizerError(
                f"{model_dir}: cannot load a tokenizer ({e.__class__.__name__})"
            ) from None

    def encode(self, text: str, chat: bool = False) -> list[int]:
        if not text:
            raise TokenizerError("the prompt is empty")
        if chat:
            return self.encode_chat([{"role": "user", "content": text}])
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def encode_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """A conversation ({role, content} messages; an assistant's tool_calls, a tool
        result's tool_call_id) through the model's chat template, ready for the
        assistant's turn (unless not `add_generation_prompt`); `tools` (OpenAI's function tools) as the template shows them."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise TokenizerError(
                "the model has no chat template: send the prompt as plain text "
                "(no --chat; over HTTP, to /v1/completions)"
            )
        from jinja2 import TemplateError

        try:
            ids = self.tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
            )
        except TemplateError as e:  # e.g. the template's own check of role order
            raise TokenizerError(f"the chat template refused these messages: {e}") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    @property
    def chat_template_text(self) -> str:
        """The model's chat template(s) as one text ("" without one): what it teaches."""
        template = getattr(self.tokenizer, "chat_template", None) or ""
        return "\n".join(template.values()) if isinstance(template, dict) else template

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self.tokenizer)


class StreamDecoder:
    """Turns tokens into text deltas without splitting multi-byte characters.

    Decodes a short window of recent tokens and holds text back while it ends in an
    incomplete UTF-8 sequence (U+FFFD), so byte-level BPE pieces join correctly.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        decode = lambda a, b: self.tokenizer.decode(self.ids[a:b], skip_special_tokens=True)  # noqa: E731
        prefix = decode(self.prefix_offset, self.read_offset)
        full = decode(self.prefix_offset, len(self.ids))
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream."""
        prefix = self.tokenizer.decode(
            self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True
        )
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]
