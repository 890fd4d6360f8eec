"""Structured output (docs/architecture.md, "3. The pipeline step", "Structured output"):
a request's `response_format` compiled into a grammar, and the grammar's state along
the request's output, with llguidance.

The grammar constrains the target's draw wherever it is drawn (the last stage's
verifier, `verify.draw_logits`): the tokens the grammar forbids after the output so far are
masked out of the logits before the draw, so greedy takes the argmax of the allowed
tokens and sampling draws from the distribution renormalized over them (temperature,
top-k and top-p then apply to the allowed tokens, as vLLM does). It also prunes the
tree's growth (`growth.allowed_by_grammar`): a proposed child the grammar forbids
after its path never becomes a node. Only the draw decides tokens; the pruning only
saves rows the target would never take.

Why llguidance and not xgrammar: llguidance is one abi3 wheel with no dependencies
(xgrammar 0.2.9 needs torch, triton and apache-tvm-ffi, and is built per Python
version); its matcher checks a token sequence from its current state without consuming
it (`validate_tokens`), which is what pruning a tree needs (many short paths from one
committed state); masks are computed on demand, from the bytes of the tokenizer's
tokens, in microseconds for JSON; and vLLM and SGLang use it, so a schema accepted
there is accepted here.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    import llguidance

# response_format types (OpenAI's)
TEXT, JSON_OBJECT, JSON_SCHEMA = "text", "json_object", "json_schema"
FORMAT_TYPES = (TEXT, JSON_OBJECT, JSON_SCHEMA)
# The largest schema accepted (JSON text): far beyond any real schema, a bound on the
# grammar the router and the last stage build per request, and within what a stage's
# Open may carry (`services/control.max_control_bytes`).
MAX_SCHEMA_CHARS = 1 << 18


class GrammarError(ValueError):
    """A response_format that cannot constrain decoding (its message names the problem),
    a tokenizer the grammar library cannot read, or output the grammar refuses."""


def _llguidance():
    """The grammar library, imported where a grammar is used, not by every process that
    imports this module (each stage does, through the verifier): a service without it
    serves every request that has no response_format, and refuses one that has."""
    try:
        import llguidance
    except ImportError:
        raise GrammarError(
            "structured output (response_format) needs the llguidance package, which is "
            "not installed here"
        ) from None
    return llguidance


@dataclass(frozen=True)
class ResponseFormat:
    """What a request asks its output to be: `type` one of `FORMAT_TYPES`, and for
    json_schema the schema as JSON text (the wire's form, `GenerateRequest.response_format`)."""

    type: str = TEXT
    schema: str = ""

    def __post_init__(self) -> None:
        if self.type not in FORMAT_TYPES:
            raise GrammarError(
                f"response_format type must be one of {', '.join(FORMAT_TYPES)}, got {self.type!r}"
            )
        if self.type == JSON_SCHEMA and not self.schema:
            raise GrammarError("response_format json_schema needs a schema")
        if self.type != JSON_SCHEMA and self.schema:
            raise GrammarError(f"response_format {self.type} takes no schema")
        if len(self.schema) > MAX_SCHEMA_CHARS:
            raise GrammarError(f"the JSON schema is longer than {MAX_SCHEMA_CHARS} characters")

    @property
    def constrains(self) -> bool:
        return self.type != TEXT

    @classmethod
    def from_openai(cls, value: Any) -> ResponseFormat:
        """OpenAI's shape: {"type": "text"}, {"type": "json_object"} or {"type":
        "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}};
        also the same as JSON text (a command line's). None: text."""
        if value is None:
            return cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise GrammarError(f"response_format is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise GrammarError("response_format must be an object with a 'type'")
        kind = value.get("type")
        if kind == JSON_SCHEMA:
            spec = value.get(JSON_SCHEMA)
            if not isinstance(spec, dict) or "schema" not in spec:
                raise GrammarError(
                    'response_format json_schema needs {"json_schema": {"schema": {...}}}'
                )
            schema = spec["schema"]
            if not isinstance(schema, dict | bool):
                raise GrammarError("response_format json_schema.schema must be a JSON object")
            return cls(JSON_SCHEMA, json.dumps(schema))
        if kind in (TEXT, JSON_OBJECT):
            return cls(kind)
        raise GrammarError(
            f"response_format type must be one of {', '.join(FORMAT_TYPES)}, got {kind!r}"
        )

    def grammar_text(self) -> str | None:
        """llguidance's grammar for this format (None: text, no constraint), checked:
        a schema it cannot use is a GrammarError that says why. json_object is any JSON
        object. JSON whitespace is llguidance's default (flexible, as vLLM's default);
        a schema's own "x-guidance" options (e.g. {"whitespace_flexible": false})
        override it."""
        if self.type == TEXT:
            return None
        schema = self.schema if self.type == JSON_SCHEMA else '{"type": "object"}'
        try:
            text = _llguidance().LLMatcher.grammar_from_json_schema(schema)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(text, None)
        if is_error:
            raise GrammarError(f"the JSON schema cannot be used: {'; '.join(messages)}")
        return text


@dataclass(frozen=True)
class Grammar:
    """A grammar (llguidance's text) and the tokenizer it constrains: in one process the
    same object travels from the request to the last stage's verifier; on the wire only
    `text` does, and the receiver binds its own tokenizer of the same model. Built once
    per request and side (its parser: milliseconds for a usual schema, about 0.1 s for
    one of 100 kB, so the router and the stages build it off their event loops); each
    state starts as a copy of it."""

    text: str
    tokenizer: llguidance.LLTokenizer = field(compare=False, repr=False)
    _initial: Any = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        m = _llguidance().LLMatcher(self.tokenizer, self.text, log_level=0)
        if m.is_error():
            raise GrammarError(f"the grammar cannot be used: {m.get_error()}")
        object.__setattr__(self, "_initial", m)

    def state(self, consumed: Sequence[int] = ()) -> GrammarState:
        return GrammarState(self, consumed)


class GrammarState:
    """The grammar after a request's output so far (one llguidance matcher): what the
    next token may be, and which tree paths it allows. Per request, it costs one matcher
    (the grammar's parser state) and, per token, one step of it; a mask costs one pass
    over the tokenizer's token trie (`compute_bitmask`)."""

    def __init__(self, grammar: Grammar, consumed: Sequence[int] = ()) -> None:
        self.grammar = grammar
        self._m = grammar._initial.deep_copy()
        self._eos = frozenset(grammar.tokenizer.eos_tokens)
        self.advance(consumed)

    def copy(self) -> GrammarState:
        twin = object.__new__(GrammarState)
        twin.grammar, twin._m, twin._eos = self.grammar, self._m.deep_copy(), self._eos
        return twin

    @property
    def eos_tokens(self) -> frozenset[int]:
        return self._eos

    @property
    def done(self) -> bool:
        """The output is complete: nothing but an end-of-sequence token may follow."""
        return self._m.is_stopped()

    def advance(self, tokens: Sequence[int]) -> None:
        """The output grew by `tokens` (drawn under this grammar's mask)."""
        for t in tokens:
            if not self._m.consume_token(int(t)):
                raise GrammarError(
                    f"token {int(t)} is not allowed by the request's grammar here: "
                    f"{self._m.get_error()}"
                )

    def follows(self, tokens: Sequence[int]) -> bool:
        """`advance`, False instead of an error when a token is refused (the router's
        state, which only prunes: the last stage's draws decide the tokens)."""
        try:
            self.advance(tokens)
        except GrammarError:
            return False
        return True

    def allowed(self, vocab: int) -> np.ndarray:
        """Which of the first `vocab` token ids may come next (bool [vocab]); ids beyond
        the tokenizer's never."""
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        if self._m.is_error():
            raise GrammarError(f"the request's grammar failed: {self._m.get_error()}")
        mask = np.unpackbits(bits, bitorder="little")[:vocab].astype(bool)
        if mask.size < vocab:
            mask = np.concatenate([mask, np.zeros(vocab - mask.size, dtype=bool)])
        if not mask.any():
            raise GrammarError("the request's grammar allows no token here")
        return mask

    def constrain(self, logits: Tensor) -> Tensor:
        """`logits` [vocab] (on their device) with every token the grammar forbids next
        at -inf: the target's distribution renormalized over the allowed tokens."""
        allowed = torch.from_numpy(self.allowed(logits.numel())).to(logits.device)
        return logits.masked_fill(~allowed, -torch.inf)

    def forced_after(self, path: Sequence[int]) -> int | None:
        """The one token the grammar allows after the output so far and then `path`
        (tree tokens below the root), or None where it allows more (or `path` is not
        allowed); the state is unchanged (the path is consumed, then rolled back)."""
        path = [int(t) for t in path]
        if path and (path[-1] in self._eos or self._m.validate_tokens(path) != len(path)):
            return None  # nothing follows the end (or the path is not allowed)
        self._m.consume_tokens(path)
        try:
            if self._m.is_stopped():
                eos = self._eos
                return next(iter(eos)) if len(eos) == 1 else None
            words = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint32)
        finally:
            if path:
                self._m.rollback(len(path))
        nonzero = np.flatnonzero(words)
        if nonzero.size != 1:
            return None
        word = int(words[nonzero[0]])
        if word & (word - 1):  # more than one bit
            return None
        return int(nonzero[0]) * 32 + word.bit_length() - 1

    def allows(self, path: Sequence[int], token: int) -> bool:
        """Whether `token` may follow the output so far and then `path` (tree tokens
        below the root), without changing the state."""
        if not path and self._m.is_stopped():
            return int(token) in self._eos  # validate_tokens refuses all once stopped
        return self._m.validate_tokens([*path, int(token)]) == len(path) + 1


# -- tokenizers ------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def load_grammar_tokenizer(
    tokenizer_dir: str, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> llguidance.LLTokenizer:
    """The grammar library's view of the tokenizer in a model directory (its
    `tokenizer.json`), for a model of `vocab_size` logits whose generation ends at
    `eos_token_ids` (the model's; empty: the tokenizer's): a complete output allows only
    those. Built once per process, without transformers (a stage imports only
    `tokenizers`): tens of milliseconds for a small vocabulary, about a second for a
    150k-token one. Tokenizers llguidance reads from their JSON (the byte-level BPE and
    SentencePiece-style ones of real models) are read so; others (e.g. a word-level
    vocabulary of whole characters) token by token, from each token's text."""
    from tokenizers import Tokenizer

    llg = _llguidance()
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise GrammarError(
            f"structured output needs the model's tokenizer.json and {path.parent} has none: "
            "response_format is not available on this deployment"
        )
    text = path.read_text(encoding="utf-8")
    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # the tokenizers library raises its own exception type
        raise GrammarError(f"{path}: cannot read the tokenizer ({e})") from None
    eos = [int(t) for t in eos_token_ids] or _eos_of(path.parent, tok)
    n_vocab = max(vocab_size, tok.get_vocab_size(with_added_tokens=True))
    try:
        return llg.LLTokenizer(text, n_vocab=n_vocab, eos_token=eos)
    except ValueError:
        pass
    wrapper = llg.TokenizerWrapper(_TokenTexts(tok, eos[0], n_vocab))
    return llg.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=eos)


def _eos_of(model_dir: Path, tok) -> list[int]:
    """The tokenizer's end-of-sequence token (`tokenizer_config.json`'s eos_token)."""
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    name = config.get("eos_token")
    name = name.get("content") if isinstance(name, dict) else name
    eos = tok.token_to_id(name) if isinstance(name, str) else None
    if eos is None:
        raise GrammarError("the model has no end-of-sequence token to end structured output")
    return [eos]


class _TokenTexts:
    """A tokenizer as llguidance's `TokenizerWrapper` takes it: each token's bytes are its
    text decoded alone (right where every token is whole characters; refused where one
    decodes to part of a character), special tokens marked as such."""

    def __init__(self, tok, eos: int, n_vocab: int) -> None:
        self._tok = tok
        self.eos_token_id, self.bos_token_id = eos, None
        special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        self.special_token_ids = sorted(special)
        tokens = []
        for i in range(tok.get_vocab_size(with_added_tokens=True)):
            name = tok.id_to_token(i)
            if name is None:  # a gap in the ids
                tokens.append(b"")
                continue
            text = name if i in special else tok.decode([i], skip_special_tokens=False)
            if "\ufffd" in text:
                raise GrammarError(
                    "the grammar library cannot read this tokenizer (a token is part of a "
                    "character and its decoder is not one the library knows)"
                )
            # llguidance's marker for special tokens: 0xFF, then the name
            tokens.append(b"\xff" + text.encode() if i in special else text.encode())
        self.tokens = tokens

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tok.encode(text, add_special_tokens=False).ids)
