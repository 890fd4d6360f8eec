"""`specpipe generate`: decoding in one process, the stages stepped as a pipeline."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .args import (
    CliError,
    add_device_arg,
    add_dtype_arg,
    add_logits_rules_args,
    add_sampling_args,
    parse_device,
    parse_ids,
    positive_int,
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `generate` command to the top-level subparsers."""
    from specpipe.common.spec.options import (
        DEFAULT_LAYERS_PER_STEP,
        DEFAULT_LAYERS_PER_STEP_ONE_STAGE,
        DEFAULT_MAX_NEW_TOKENS,
        DEFAULT_PREFILL_CHUNK,
        DEFAULT_SPECINFER_DEPTH,
        DEFAULT_TOP_K_CHILDREN,
        DEFAULT_WIDTH,
        Growth,
        Mode,
    )
    from specpipe.common.spec.ranking import Ranking

    p = sub.add_parser(
        "generate", help="generate text in one process, stages stepped as a pipeline"
    )
    p.add_argument("--target", required=True, help="target model: name, HF directory or GGUF file")
    p.add_argument(
        "--draft",
        default=None,
        help="draft model, 'oracle' for the target itself, or 'ngram' for n-gram lookup over "
        "prompt and output (no draft model)",
    )
    p.add_argument(
        "--ngram",
        action="store_true",
        help="hybrid: add n-gram proposals to the draft model's in every tree layer",
    )
    p.add_argument(
        "--layers-per-step",
        default=None,
        help="specpipe: tree layers entering stage 1 per step (a step emits up to that many "
        "tokens), or 'auto' (chosen from measured stage costs and hit rates); default "
        f"{DEFAULT_LAYERS_PER_STEP}, at --stages 1 {DEFAULT_LAYERS_PER_STEP_ONE_STAGE} (one "
        "layer a step would verify one token a step, as plain decoding does)",
    )
    p.add_argument(
        "--ranking",
        choices=[r.value for r in Ranking],
        default=Ranking.TARGET.value,
        help="tree nodes kept per layer by the chance the target's decoding takes them "
        "(target) or by cumulative draft probability (beam)",
    )
    p.add_argument(
        "--growth",
        choices=[g.value for g in Growth],
        default=Growth.VERIFIED.value,
        help="specpipe: a tree layer grows from the draft's answer after the step's "
        "verification, from the nodes it kept (verified), or as soon as the draft answers, "
        "pruned by the verification after (eager: no round trip between the last stage "
        "and stage 1)",
    )
    p.add_argument("--stages", type=positive_int, default=1)
    p.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.SPECPIPE.value)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with the target's tokenizer)")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-new-tokens", type=positive_int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--width", default=str(DEFAULT_WIDTH), help="tree width per layer, or 'auto'")
    p.add_argument(
        "--top-k-children",
        type=positive_int,
        default=DEFAULT_TOP_K_CHILDREN,
        help="draft children per node (capped by width)",
    )
    p.add_argument(
        "--depth", type=positive_int, default=DEFAULT_SPECINFER_DEPTH, help="specinfer tree depth"
    )
    add_sampling_args(p)
    add_logits_rules_args(p)
    add_dtype_arg(p)
    add_device_arg(p)
    p.add_argument("--prefill-chunk", type=positive_int, default=DEFAULT_PREFILL_CHUNK)
    p.add_argument(
        "--split",
        choices=["even", "balanced"],
        default="even",
        help="layers per stage: even, or balanced by estimated cost (counts the LM head)",
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens"
    )
    p.add_argument(
        "--response-format",
        default=None,
        metavar="JSON",
        help='structured output, in OpenAI\'s shape: \'{"type": "json_object"}\' or '
        '\'{"type": "json_schema", "json_schema": {"schema": {...}}}\' (or @FILE holding it)',
    )
    p.add_argument(
        "--no-forced-tokens",
        action="store_true",
        help="with --response-format: do not put the one token the grammar allows in the "
        "tree without the draft (to measure what forced tokens gain)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    from specpipe.common.model.config import ModelConfig, ModelConfigError
    from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local, parse_dtype
    from specpipe.common.runtime.lockstep import LockstepGeneration
    from specpipe.common.spec.options import (
        DecodeOptions,
        Mode,
        TokenSource,
        check_context,
        check_prompt_ids,
        default_layers_per_step,
    )
    from specpipe.common.spec.sampling import SamplingParams
    from specpipe.common.store.resolver import resolve_model
    from specpipe.common.text import TextCodec

    mode = Mode(args.mode)
    device = parse_device(args.device)
    rep = args.repetition_penalty
    try:
        sampling = SamplingParams(
            args.temperature,
            args.top_k,
            args.top_p,
            args.seed,
            repetition_penalty=1.0 if rep is None else rep,
            frequency_penalty=args.frequency_penalty,
            presence_penalty=args.presence_penalty,
            logit_bias=args.logit_bias or {},
        )
    except ValueError as e:
        raise CliError(str(e)) from None
    target = resolve_model(args.target)
    try:
        cfg = ModelConfig.from_dir(target)
    except ModelConfigError as e:
        raise CliError(str(e)) from None
    if args.stages > cfg.num_layers:
        raise CliError(f"--stages {args.stages} exceeds the target's {cfg.num_layers} layers")
    draft, source = None, TokenSource.HYBRID if args.ngram else TokenSource.DRAFT
    if mode.uses_draft:
        if args.draft is None:
            raise CliError(f"--mode {mode} needs --draft (a model, 'oracle' or 'ngram')")
        if args.draft == TokenSource.NGRAM.value:
            if args.ngram:
                raise CliError(
                    "--ngram adds n-grams to a draft model's proposals: give --draft MODEL"
                )
            source = TokenSource.NGRAM
        else:
            draft = ORACLE_DRAFT if args.draft == ORACLE_DRAFT else resolve_model(args.draft)
    codec = None
    if args.prompt is not None:
        codec = TextCodec.from_dir(target)
        prompt_ids = codec.encode(args.prompt, chat=args.chat)
    else:
        if args.chat:
            raise CliError("--chat needs --prompt text")
        prompt_ids = parse_ids(args.prompt_ids)
    try:  # before loading any weights
        check_prompt_ids(prompt_ids, cfg.vocab_size)
        check_context(len(prompt_ids), args.max_new_tokens, cfg.max_position_embeddings)
    except ValueError as e:
        raise CliError(str(e)) from None

    grammar = _grammar(args, target, cfg)
    stages = args.stages
    deployment = build_local(
        target, stages, draft, parse_dtype(args.dtype), split=args.split, device=device
    )
    given = args.layers_per_step
    layers = _parse_layers(given if given is not None else str(default_layers_per_step(stages)))
    width = _choose_width(args, deployment, mode, prompt_ids, sampling)
    try:
        opts = DecodeOptions(
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            width=width,
            top_k_children=args.top_k_children,
            depth=args.depth,
            prefill_chunk=args.prefill_chunk,
            stop_token_ids=() if args.ignore_eos else cfg.eos_token_ids,
            layers_per_step=layers or 1,
            token_source=source,
            ranking=args.ranking,
            growth=args.growth,
            min_tokens=args.min_tokens,
            grammar=grammar,
            forced_tokens=not args.no_forced_tokens,
        )
    except ValueError as e:
        raise CliError(str(e)) from None
    if layers is None:
        opts = _choose_layers(deployment, mode, prompt_ids, opts)
    try:
        gen = LockstepGeneration(deployment.pipeline, deployment.draft, prompt_ids, mode, opts)
    except ValueError as e:
        raise CliError(str(e)) from None
    if args.json:
        tokens = gen.run()
        text = codec.decode(tokens) if codec else None
        st = gen.stats
        # Beside "stats" (whose keys are a contract), the same extras `client generate` prints.
        out = {"token_ids": tokens, "text": text, "stats": st.summary()}
        if grammar is not None:  # hits of the tokens the grammar forced
            out["forced_hits"] = st.forced_hits
        from specpipe.common.model.loading import weight_fingerprint

        version = {"model": Path(target).name, "weight_hash": weight_fingerprint(target)}
        print(json.dumps({**out, "speculation": st.speculation(), **version}))
    else:
        stream = codec.stream() if codec else None
        for tok in gen:
            piece = stream.push(tok) if stream else f"{tok} "
            print(piece, end="", flush=True)
        print(stream.flush() if stream else "")
        s = gen.stats.summary()
        print(
            f"[{s['mode']}] S={s['stages']} tokens={s['new_tokens']} steps={s['decode_steps']} "
            f"tokens/step={s['tokens_per_step']:.3f} hit_rate={s['hit_rate']:.3f}"
            + _per_source(gen.stats)
            + (f" forced_hits={gen.stats.forced_hits}" if grammar is not None else ""),
            file=sys.stderr,
        )
    return 0


def _grammar(args: argparse.Namespace, target, cfg):
    """`--response-format` compiled for the target's tokenizer (None: none); a format
    the grammar engine cannot use is an error naming the problem."""
    from specpipe.common.spec.grammar import (
        Grammar,
        GrammarError,
        ResponseFormat,
        load_grammar_tokenizer,
    )

    value = args.response_format
    if value is None:
        return None
    if value.startswith("@"):
        try:
            value = Path(value[1:]).read_text(encoding="utf-8")
        except OSError as e:
            raise CliError(f"--response-format {value}: {e.strerror}") from None
    try:
        fmt = ResponseFormat.from_openai(value)
        if not fmt.constrains:
            return None
        if args.ignore_eos:
            raise CliError("--ignore-eos cannot be combined with --response-format")
        tok = load_grammar_tokenizer(str(target), cfg.vocab_size, tuple(cfg.eos_token_ids))
        return Grammar(fmt.grammar_text() or "", tok)
    except GrammarError as e:
        raise CliError(f"--response-format: {e}") from None


def _parse_layers(text: str) -> int | None:
    """`--layers-per-step`: a positive integer, or None for 'auto'."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise CliError(
            f"--layers-per-step must be a positive integer or 'auto', got {text!r}"
        ) from None
    if value <= 0:
        raise CliError(f"--layers-per-step must be positive, got {value}")
    return value


def _choose_layers(deployment, mode, prompt_ids: list[int], opts):
    """`--layers-per-step auto`: the K with the least expected time per token from this
    machine's stage costs and calibration runs (`common/perf/layers_per_step.py`)."""
    from dataclasses import replace

    from specpipe.common.perf.layers_per_step import choose_layers
    from specpipe.common.spec.options import Mode

    if mode != Mode.SPECPIPE:
        return opts  # only specpipe grows several layers per step
    choice = choose_layers(deployment, [prompt_ids], opts)
    print(choice.explain(), file=sys.stderr)
    return replace(opts, layers_per_step=choice.layers)


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
    from specpipe.common.spec.options import DEFAULT_WIDTH, Mode

    if mode != Mode.SPECPIPE or deployment.draft is None:
        return DEFAULT_WIDTH  # width only shapes specpipe's tree; specinfer keeps its default
    choice = choose_width(deployment, [prompt_ids], sampling, args.top_k_children)
    print(choice.explain(), file=sys.stderr)
    return choice.width


def _per_source(stats) -> str:
    """Hit rate per token source, when the tree had more than the draft model."""
    if stats.token_source not in ("ngram", "hybrid"):
        return ""
    return f" (draft {stats.draft_hit_rate:.3f}, ngram {stats.ngram_hit_rate:.3f})"
