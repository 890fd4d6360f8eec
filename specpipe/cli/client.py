"""`specpipe client generate|models`: talk to a running router."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .args import (
    DEFAULT_ROUTER_PORT,
    add_logits_rules_args,
    add_sampling_args,
    auto_or_positive_int,
    parse_ids,
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `client` command group."""
    from specpipe.common.spec.options import (
        DEFAULT_MAX_NEW_TOKENS,
        DEFAULT_TOP_K_CHILDREN,
        Mode,
    )

    client = sub.add_parser("client", help="talk to a running router")
    csub = client.add_subparsers(dest="client_command", required=True, parser_class=type(client))
    g = csub.add_parser("generate", help="stream a completion")
    _client_common(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized by the router)")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--model", default="", help="model id (default: the deployment's)")
    g.add_argument(
        "--mode", default=Mode.SPECPIPE.value, help="specpipe, pp, specinfer or autoregressive"
    )
    g.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    g.add_argument(
        "--width",
        type=auto_or_positive_int,
        default=None,
        help="tree width per layer, or 'auto' (default: the router's; with a draft it tunes)",
    )
    g.add_argument(
        "--layers-per-step",
        type=auto_or_positive_int,
        default=None,
        help="specpipe tree layers per step, or 'auto' (default: the router's; with a draft "
        "it tunes)",
    )
    g.add_argument(
        "--token-source",
        default="",
        choices=["draft", "ngram", "hybrid", "auto"],
        help="what proposes tree tokens (default: the router's; with a draft it tunes, not "
        "using the draft among the choices)",
    )
    g.add_argument("--ranking", default="", choices=["target", "beam"], help="tree ranking")
    g.add_argument(
        "--growth",
        default="",
        choices=["verified", "eager"],
        help="a tree layer grows after the step's verification (verified, default) or as "
        "soon as the draft answers (eager)",
    )
    g.add_argument(
        "--top-k-children",
        type=int,
        default=None,
        help="draft candidates per node, capped by the width "
        f"(default {DEFAULT_TOP_K_CHILDREN}, the engine's)",
    )
    g.add_argument("--depth", type=int, default=None, help="specinfer tree depth")
    add_sampling_args(g)
    g.add_argument("--prefill-chunk", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument(
        "--stop-token-ids",
        type=_token_ids,
        default=(),
        metavar="IDS",
        help="comma-separated token ids that also end generation",
    )
    g.add_argument(
        "--resume-token-ids",
        type=_token_ids,
        default=(),
        metavar="IDS",
        help="comma-separated output token ids already received: continue after them",
    )
    g.add_argument(
        "--priority", type=int, default=0, help="higher runs first when the router is busy"
    )
    g.add_argument(
        "--response-format",
        type=_response_format,
        default=None,
        metavar="JSON",
        help='structured output, OpenAI\'s response_format as JSON: \'{"type": "json_object"}\' '
        'or \'{"type": "json_schema", "json_schema": {"schema": {...}}}\'',
    )
    add_logits_rules_args(g)
    g.add_argument(
        "--cache-salt",
        default="",
        help="prefix-cache namespace: requests of your API key with the same salt share "
        "cached prompt prefixes (default: the key's own)",
    )
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=_cmd_client_generate)
    m = csub.add_parser("models", help="list the served models")
    _client_common(m)
    m.set_defaults(func=_cmd_client_models)


def _client_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--router",
        default=f"127.0.0.1:{DEFAULT_ROUTER_PORT}",
        help="HOST:PORT, or several separated by commas: a stream whose router dies is "
        "resumed on the next",
    )
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument(
        "--api-key",
        default=os.environ.get("SPECPIPE_API_KEY", "").strip() or None,
        help="for a router with API keys (default: $SPECPIPE_API_KEY)",
    )
    p.add_argument(
        "--tls-ca",
        default=None,
        metavar="FILE",
        help="the router serves TLS (--public-tls-cert): trust the CA certificate in FILE",
    )
    p.add_argument("--tls", action="store_true", help="the router serves TLS: trust system roots")


def _response_format(text: str) -> str:
    """A response_format (JSON text), checked for its shape; the router checks the schema."""
    from specpipe.common.spec.grammar import GrammarError, ResponseFormat

    try:
        ResponseFormat.from_openai(text)
    except GrammarError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _token_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.replace(" ", "").split(",") if t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def request_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The request options of `client generate`, as the SDK's keywords: every option of
    `common/spec/request_options.py` that has a flag."""
    from specpipe.common.spec.request_options import REQUEST_OPTIONS

    return {o.keyword: getattr(args, o.dest) for o in REQUEST_OPTIONS if o.dest}


def _cmd_client_generate(args: argparse.Namespace) -> int:
    from specpipe.services.client import Client, SpecPipeError

    kwargs = request_kwargs(args)
    if args.prompt is not None:
        kwargs["prompt"] = args.prompt
    else:
        kwargs["prompt_ids"] = parse_ids(args.prompt_ids)
    with Client(
        args.router, timeout=args.timeout, api_key=args.api_key, tls=args.tls_ca or args.tls
    ) as client:
        try:
            stream = client.stream(**kwargs)
            if args.json:
                done = stream.result()
                text = done.text if args.prompt is not None else None
                out = {"token_ids": done.token_ids, "text": text, "stats": done.summary()}
                version = {"model": done.model, "weight_hash": done.weight_hash}
                print(json.dumps({**out, "speculation": done.speculation(), **version}))
                return 0
            for chunk in stream:
                if args.prompt is not None:
                    print(chunk.text, end="", flush=True)
                else:
                    print("".join(f"{t} " for t in chunk.token_ids), end="", flush=True)
            done = stream.result()
        except SpecPipeError as e:
            print(f"specpipe: error: {e.code_name}: {e.message}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            stream.cancel()
            raise
    print()
    s = done.stats
    print(
        f"[{s['mode']}] S={s['stages']} tokens={s['new_tokens']} steps={s['decode_steps']} "
        f"tokens/step={s['tokens_per_step']:.3f} hit_rate={s['hit_rate']:.3f} "
        f"ttft={s['time_to_first_token_ms']:.1f}ms tbt={s['mean_time_between_tokens_ms']:.2f}ms",
        file=sys.stderr,
    )
    return 0


def _cmd_client_models(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from specpipe.services.client import Client, SpecPipeError

    with Client(
        args.router, timeout=args.timeout, api_key=args.api_key, tls=args.tls_ca or args.tls
    ) as client:
        try:
            models = client.list_models()
        except SpecPipeError as e:
            print(f"specpipe: error: {e.code_name}: {e.message}", file=sys.stderr)
            return 1
    print(json.dumps([MessageToDict(m, preserving_proto_field_name=True) for m in models]))
    return 0
