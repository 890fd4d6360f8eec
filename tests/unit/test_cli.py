"""The `specpipe generate` contract: JSON shape, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from specpipe.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse errors
        code = int(e.code)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json_contract(capsys, llama_dir) -> None:
    code, out, _ = run(
        capsys,
        "generate",
        "--target",
        str(llama_dir),
        "--draft",
        "oracle",
        "--stages",
        "3",
        "--mode",
        "specpipe",
        "--prompt-ids",
        "5,17,33,2",
        "--max-new-tokens",
        "10",
        "--json",
        "--ignore-eos",
    )
    assert code == 0
    result = json.loads(out)
    assert len(result["token_ids"]) == 10 and result["text"] is None
    stats = result["stats"]
    assert set(stats) == {
        "mode",
        "stages",
        "width",
        "prefill_steps",
        "decode_steps",
        "new_tokens",
        "tokens_per_step",
        "hit_rate",
    }
    assert stats["mode"] == "specpipe" and stats["stages"] == 3 and stats["new_tokens"] == 10
    assert stats["tokens_per_step"] == pytest.approx(10 / stats["decode_steps"], abs=1e-6)
    # Extras beside "stats" (`specpipe client generate --json` prints the same shape).
    assert set(result) == {"token_ids", "text", "stats", "speculation", "model", "weight_hash"}
    assert len(result["weight_hash"]) == 16  # the model version
    assert set(result["speculation"]) == {
        "regrowths",
        "steady_tokens_per_step",
        "layers_per_step",
        "token_source",
        "draft_hit_rate",
        "ngram_hit_rate",
    }
    spec = result["speculation"]
    assert spec["steady_tokens_per_step"] > 0 and spec["layers_per_step"] == 1
    assert spec["token_source"] == "draft" and spec["ngram_hit_rate"] == 0


def test_layers_per_step_and_token_sources_through_cli(capsys, llama_dir) -> None:
    """Several layers per step, the n-gram source (no draft model) and the hybrid: the
    tokens of plain decoding, the stats of what ran."""
    base = ["generate", "--target", str(llama_dir), "--stages", "3", "--prompt-ids",
            "5,17,33,2,5,17,33", "--max-new-tokens", "12", "--json", "--ignore-eos"]  # fmt: skip
    _, out, _ = run(capsys, *base, "--mode", "autoregressive")
    expect = json.loads(out)["token_ids"]
    for extra, source in (
        (["--draft", "oracle", "--layers-per-step", "3"], "draft"),
        (["--draft", "ngram", "--layers-per-step", "2"], "ngram"),
        (["--draft", "oracle", "--ngram", "--ranking", "beam"], "hybrid"),
        (["--draft", "oracle", "--layers-per-step", "2", "--growth", "eager"], "draft"),
    ):
        code, out, err = run(capsys, *base, *extra)
        assert code == 0, err
        result = json.loads(out)
        assert result["token_ids"] == expect, extra
        spec = result["speculation"]
        assert spec["token_source"] == source
        assert spec["layers_per_step"] == int(extra[3]) if extra[2] == "--layers-per-step" else 1
    assert json.loads(out)["stats"]["hit_rate"] == 1.0  # the oracle, with n-grams beside it
    code, out, err = run(capsys, *base, "--draft", "oracle", "--layers-per-step", "auto")
    assert code == 0 and "layers per step auto" in err and "<- chosen" in err
    assert json.loads(out)["token_ids"] == expect
    code, out, err = run(capsys, *base, "--draft", "ngram", "--ngram")
    assert code == 2 and out == "" and "--ngram adds" in err


def test_one_stage_with_a_draft_defaults_to_several_layers_per_step(capsys, llama_dir) -> None:
    """At S = 1 one layer a step verifies one token a step (as plain decoding does): the
    default is classic speculative decoding, with plain decoding's tokens."""
    base = ["generate", "--target", str(llama_dir), "--stages", "1", "--prompt-ids",
            "5,17,33,2,5,17,33", "--max-new-tokens", "12", "--json", "--ignore-eos"]  # fmt: skip
    _, out, _ = run(capsys, *base, "--mode", "autoregressive")
    expect = json.loads(out)["token_ids"]
    code, out, err = run(capsys, *base, "--draft", "oracle")
    assert code == 0, err
    result = json.loads(out)
    assert result["token_ids"] == expect and result["speculation"]["layers_per_step"] == 3
    assert result["stats"]["tokens_per_step"] > 1.5  # the oracle: up to 3 a step


def test_every_mode_same_tokens_through_cli(capsys, llama_dir, unrelated_draft_dir) -> None:
    outs = {}
    for mode in ("specpipe", "pp", "specinfer", "autoregressive"):
        code, out, _ = run(
            capsys,
            "generate",
            "--target",
            str(llama_dir),
            "--draft",
            str(unrelated_draft_dir),
            "--stages",
            "2",
            "--mode",
            mode,
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "8",
            "--json",
            "--ignore-eos",
        )
        assert code == 0
        outs[mode] = json.loads(out)["token_ids"]
    assert len({tuple(v) for v in outs.values()}) == 1
    assert outs["pp"] and json.loads(out)["stats"]["mode"] == "autoregressive"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mode", "fastest"], "invalid choice"),
        (["--stages", "99"], "exceeds"),
        (["--stages", "0"], "must be positive"),
        (["--prompt-ids", "1,2,100000"], "outside the vocabulary"),
        (["--prompt-ids", "1,x"], "comma-separated integers"),
        (["--prompt-ids", ","], "empty"),
        (["--max-new-tokens", "0"], "must be positive"),
        (["--max-new-tokens", "100000"], "exceeds the model's context"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "1.5"], "top_p"),
        (["--width", "zero"], "--width"),
        (["--mode", "specpipe", "--layers-per-step", "two"], "--layers-per-step"),
        (["--mode", "specpipe", "--layers-per-step", "0"], "must be positive"),
        (["--mode", "specpipe", "--layers-per-step", "99"], "layers_per_step must be in"),
        (["--target", "/nonexistent/model"], "not found|no such"),
        (["--mode", "specpipe", "--no-draft"], "needs --draft"),
        (["--prompt", "hello"], "tokenizer"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, llama_dir, args, message) -> None:
    base = {
        "--target": str(llama_dir),
        "--stages": "2",
        "--mode": "pp",
        "--prompt-ids": "1,2,3",
        "--max-new-tokens": "4",
    }
    no_draft = "--no-draft" in args
    args = [a for a in args if a != "--no-draft"]
    override = dict(zip(args[::2], args[1::2], strict=True))
    merged = {**base, **override}
    if "--prompt" in merged:
        merged.pop("--prompt-ids")
    argv = ["generate"]
    for k, v in merged.items():
        argv += [k, v]
    if not no_draft and merged["--mode"] in ("specpipe", "specinfer"):
        argv += ["--draft", "oracle"]
    code, out, err = run(capsys, *argv)
    assert code == 2, err
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err


def test_console_script_is_installed() -> None:
    exe = shutil.which("specpipe")
    assert exe, "pip install should provide the specpipe command"
    proc = subprocess.run(
        [exe, "generate", "--target", "/nope", "--prompt-ids", "1"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and re.search("not found|no such", proc.stderr)


@pytest.mark.parametrize("command", ["stage", "draft", "up"])
def test_batch_wait_flag(capsys, command) -> None:
    """`--batch-wait-ms`: milliseconds (0: off) or auto; out of range is one line, exit 2."""
    from specpipe.cli import build_parser

    need = {"stage": [], "draft": ["--model", "m"], "up": ["--target", "t"]}[command]
    parse = build_parser().parse_args
    assert parse([command, *need]).batch_wait is None  # auto
    assert parse([command, *need, "--batch-wait-ms", "auto"]).batch_wait is None
    assert parse([command, *need, "--batch-wait-ms", "5"]).batch_wait == pytest.approx(0.005)
    assert parse([command, *need, "--batch-wait-ms", "0"]).batch_wait == 0.0
    for bad in ("-1", "5000", "soon"):
        with pytest.raises(SystemExit) as e:
            parse([command, *need, "--batch-wait-ms", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "--batch-wait-ms" in err, err


@pytest.mark.parametrize(
    "argv",
    [["stage", "--model", "m"], ["draft", "--model", "m"], ["router", "--stages", "h:1"]],
)
def test_services_started_by_hand_say_secure_or_insecure(capsys, argv) -> None:
    """Issue 22: nothing is plaintext by default. Neither flag: one line, exit 2, before
    anything loads; both: an argument error."""
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert "--secure" in err and "--insecure" in err, err
    code, _, err = run(capsys, *argv, "--secure", "--insecure")
    assert code == 2 and "not allowed with" in err, err


def test_insecure_warns_in_exactly_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "specpipe.cli", "draft", "--insecure", "--model", "/nope/model"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    warned = [line for line in proc.stderr.splitlines() if "--insecure:" in line]
    assert len(warned) == 1 and "WARNING" in warned[0], proc.stderr
    assert proc.returncode == 2 and re.search("not found|no such", proc.stderr), proc.stderr


def test_up_is_secure_unless_told_otherwise(capsys) -> None:
    from specpipe.cli import build_parser

    parse = build_parser().parse_args
    assert not parse(["up", "--target", "t"]).insecure
    assert parse(["up", "--target", "t", "--insecure"]).insecure
    with pytest.raises(SystemExit) as e:
        parse(["up", "--target", "t", "--secure", "--insecure"])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_generate_response_format_with_and_without_forced_tokens(
    capsys, llama_dir, tmp_path
) -> None:
    """`--response-format` constrains the output (it parses and validates); forced tokens
    change no token and are hits (`--no-forced-tokens` to compare); a format the grammar
    engine cannot use is a one-line error."""
    import jsonschema

    from tests.integration.conftest import add_char_tokenizer

    target = tmp_path / "m"
    shutil.copytree(llama_dir, target)
    add_char_tokenizer(target)
    schema = {"type": "object", "properties": {"kind": {"const": "point"},
              "x": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["kind", "x"], "additionalProperties": False,
              "x-guidance": {"whitespace_flexible": False}}  # fmt: skip
    fmt = json.dumps({"type": "json_schema", "json_schema": {"schema": schema}})
    (tmp_path / "fmt.json").write_text(fmt)
    base = ["generate", "--target", str(target), "--stages", "2", "--prompt", "JSON: ",
            "--max-new-tokens", "40", "--json", "--draft", "ngram"]  # fmt: skip
    results = {}
    for extra in ([], ["--no-forced-tokens"]):
        code, out, err = run(
            capsys, *base, "--response-format", f"@{tmp_path / 'fmt.json'}", *extra
        )
        assert code == 0, err
        results[bool(extra)] = json.loads(out)
    forced, plain = results[False], results[True]
    assert forced["token_ids"] == plain["token_ids"]
    jsonschema.validate(json.loads(forced["text"]), schema)
    assert forced["forced_hits"] >= len('{"kind":"point","x":') - 1 and plain["forced_hits"] == 0
    assert forced["stats"]["hit_rate"] > plain["stats"]["hit_rate"]
    code, _, err = run(capsys, *base, "--response-format", '{"type": "xml"}')
    assert code == 2 and "--response-format: response_format type must be one of" in err
    code, _, err = run(
        capsys, *base, "--response-format", '{"type": "json_object"}', "--ignore-eos"
    )
    assert code == 2 and "--ignore-eos cannot be combined" in err
