"""Tokenization, chat templates and streaming detokenization across byte boundaries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from specpipe.common.text import TextCodec, TokenizerError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specpipe.cli import main

from ..conftest import make_tiny_model

CORPUS = [
    "héllo wörld",
    "naïve café",
    "日本語のテキスト",
    "emoji 🙂🚀 rocket",
    "plain ascii text here",
] * 20
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"


def byte_level_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    fast.chat_template = TEMPLATE
    return fast


@pytest.fixture(scope="module")
def model_with_tokenizer(tmp_path_factory) -> Path:
    tok = byte_level_tokenizer()
    path = make_tiny_model(tmp_path_factory.mktemp("tok_model"), layers=2, vocab=len(tok))
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("text", ["héllo wörld", "日本語", "🙂🚀 and more 🙂", "a naïve café"])
def test_stream_deltas_join_to_the_text_and_never_split_characters(
    model_with_tokenizer, text
) -> None:
    codec = TextCodec.from_dir(model_with_tokenizer)
    ids = codec.tokenizer.encode(text, add_special_tokens=False)
    # the test only bites if some token holds part of a multi-byte character
    assert any("\ufffd" in codec.tokenizer.decode([t]) for t in ids)
    stream = codec.stream()
    deltas = [stream.push(t) for t in ids]
    deltas.append(stream.flush())
    assert "".join(deltas) == codec.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_chat_template_is_applied(model_with_tokenizer) -> None:
    codec = TextCodec.from_dir(model_with_tokenizer)
    ids = codec.encode("hi", chat=True)
    assert codec.tokenizer.decode(ids) == "<|user|>hi<|end|><|assistant|>"


def test_missing_tokenizer_is_a_clear_error(llama_dir) -> None:
    with pytest.raises(TokenizerError, match="tokenizer"):
        TextCodec.from_dir(llama_dir)


def test_cli_chat_prompt_streams_text(model_with_tokenizer, capsys) -> None:
    code = main(
        [
            "generate",
            "--target",
            str(model_with_tokenizer),
            "--draft",
            "oracle",
            "--stages",
            "2",
            "--prompt",
            "héllo",
            "--chat",
            "--max-new-tokens",
            "6",
            "--json",
            "--ignore-eos",
        ]
    )
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and len(result["token_ids"]) == 6
    codec = TextCodec.from_dir(model_with_tokenizer)
    assert result["text"] == codec.decode(result["token_ids"])


def test_cli_streamed_text_equals_the_json_text(model_with_tokenizer, capsys) -> None:
    argv = [
        "generate",
        "--target",
        str(model_with_tokenizer),
        "--draft",
        "oracle",
        "--stages",
        "2",
        "--prompt",
        "日本語",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
    ]
    assert main([*argv, "--json"]) == 0
    expect = json.loads(capsys.readouterr().out)["text"]
    assert main(argv) == 0
    assert capsys.readouterr().out == expect + "\n"
