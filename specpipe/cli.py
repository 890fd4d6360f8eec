"""The `specpipe` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _add_generate(sub: argparse._SubParsersAction) -> None:
    from specpipe.common.spec.options import Mode

    p = sub.add_parser(
        "generate", help="generate text in one process, stages stepped as a pipeline"
    )
    p.add_argument("--target", required=True, help="target model: name, HF directory or GGUF file")
    p.add_argument("--draft", default=None, help="draft model, or 'oracle' for the target itself")
    p.add_argument("--stages", type=_positive_int, default=1)
    p.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.SPECPIPE.value)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with the target's tokenizer)")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument("--width", default="8", help="tree width per layer, or 'auto'")
    p.add_argument(
        "--top-k-children",
        type=_positive_int,
        default=64,
        help="draft children per node (capped by width)",
    )
    p.add_argument("--depth", type=_positive_int, default=8, help="specinfer tree depth")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float64"],
        help="float64: exactness checks (no rounding noise between cache shapes)",
    )
    p.add_argument("--prefill-chunk", type=_positive_int, default=128)
    p.add_argument(
        "--split",
        choices=["even", "balanced"],
        default="even",
        help="layers per stage: even, or balanced by estimated cost (counts the LM head)",
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_generate)


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise CliError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise CliError("--prompt-ids is empty")
    return ids


def _cmd_generate(args: argparse.Namespace) -> int:
    from specpipe.common.model.config import ModelConfig, ModelConfigError
    from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local, parse_dtype
    from specpipe.common.runtime.lockstep import Generation
    from specpipe.common.spec.options import DecodeOptions, Mode, check_context, check_prompt_ids
    from specpipe.common.spec.sampling import SamplingParams
    from specpipe.common.store.resolver import resolve_model
    from specpipe.common.text import TextCodec

    mode = Mode(args.mode)
    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as e:
        raise CliError(str(e)) from None
    target = resolve_model(args.target)
    try:
        cfg = ModelConfig.from_dir(target)
    except ModelConfigError as e:
        raise CliError(str(e)) from None
    if args.stages > cfg.num_layers:
        raise CliError(f"--stages {args.stages} exceeds the target's {cfg.num_layers} layers")
    needs_draft = mode in (Mode.SPECPIPE, Mode.SPECINFER)
    draft = None
    if needs_draft:
        if args.draft is None:
            raise CliError(f"--mode {mode} needs --draft (a model, or 'oracle')")
        draft = ORACLE_DRAFT if args.draft == ORACLE_DRAFT else resolve_model(args.draft)
    codec = None
    if args.prompt is not None:
        codec = TextCodec.from_dir(target)
        prompt_ids = codec.encode(args.prompt, chat=args.chat)
    else:
        if args.chat:
            raise CliError("--chat needs --prompt text")
        prompt_ids = _parse_ids(args.prompt_ids)
    try:  # before loading any weights
        check_prompt_ids(prompt_ids, cfg.vocab_size)
        check_context(len(prompt_ids), args.max_new_tokens, cfg.max_position_embeddings)
    except ValueError as e:
        raise CliError(str(e)) from None

    stages = 1 if mode == Mode.AUTOREGRESSIVE else args.stages
    deployment = build_local(target, stages, draft, parse_dtype(args.dtype), split=args.split)
    width = _choose_width(args, deployment, mode, prompt_ids, sampling)
    try:
        opts = DecodeOptions(
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            width=width,
            top_k_children=args.top_k_children,
            specinfer_depth=args.depth,
            prefill_chunk=args.prefill_chunk,
            stop_token_ids=() if args.ignore_eos else cfg.eos_token_ids,
        )
    except ValueError as e:
        raise CliError(str(e)) from None
    try:
        gen = Generation(deployment.pipeline, deployment.draft, prompt_ids, mode, opts)
    except ValueError as e:
        raise CliError(str(e)) from None
    if args.json:
        tokens = gen.run()
        text = codec.decode(tokens) if codec else None
        st = gen.stats
        # Beside "stats" (whose keys are a contract), the same extras `client generate` prints.
        extra = {
            "regrowths": st.regrowths,
            "steady_tokens_per_step": round(st.steady_tokens_per_step, 6),
        }
        print(
            json.dumps(
                {"token_ids": tokens, "text": text, "stats": st.summary(), "speculation": extra}
            )
        )
    else:
        stream = codec.stream() if codec else None
        for tok in gen:
            piece = stream.push(tok) if stream else f"{tok} "
            print(piece, end="", flush=True)
        print(stream.flush() if stream else "")
        s = gen.stats.summary()
        print(
            f"[{s['mode']}] S={s['stages']} tokens={s['new_tokens']} steps={s['decode_steps']} "
            f"tokens/step={s['tokens_per_step']:.3f} hit_rate={s['hit_rate']:.3f}",
            file=sys.stderr,
        )
    return 0


def _choose_width(
    args: argparse.Namespace, deployment, mode, prompt_ids: list[int], sampling
) -> int:
    if args.width != "auto":
        try:
            width = int(args.width)
        except ValueError:
            raise CliError(
                f"--width must be a positive integer or 'auto', got {args.width!r}"
            ) from None
        if width <= 0:
            raise CliError(f"--width must be positive, got {width}")
        return width
    from specpipe.common.perf.width import choose_width
    from specpipe.common.spec.options import Mode

    if mode != Mode.SPECPIPE or deployment.draft is None:
        return 8  # width only shapes specpipe's tree; specinfer keeps its default
    choice = choose_width(deployment, [prompt_ids], sampling, args.top_k_children)
    print(choice.explain(), file=sys.stderr)
    return choice.width


def _user_errors() -> tuple[type[Exception], ...]:
    from specpipe.common.model.config import ModelConfigError
    from specpipe.common.store.errors import ModelNotFoundError
    from specpipe.common.text import TokenizerError

    return (ModelConfigError, ModelNotFoundError, TokenizerError)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specpipe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate(sub)
    from specpipe import cli_models

    cli_models.register(sub)
    from specpipe import cli_services

    cli_services.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CliError as e:
        print(f"specpipe: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if isinstance(e, _user_errors()):
            print(f"specpipe: error: {e}", file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["CliError", "Path", "build_parser", "main"]
