"""`specpipe client generate|models`: talk to a running router."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .args import DEFAULT_ROUTER_PORT, logit_bias, parse_ids


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `client` command group."""
    client = sub.add_parser("client", help="talk to a running router")
    csub = client.add_subparsers(dest="client_command", required=True, parser_class=type(client))
    g = csub.add_parser("generate", help="stream a completion")
    _client_common(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized by the router)")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    add_request_option_flags(g)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=_cmd_client_generate)
    m = csub.add_parser("models", help="list the served models")
    _client_common(m)
    m.set_defaults(func=_cmd_client_models)


def add_request_option_flags(p: argparse.ArgumentParser) -> None:
    """A flag per request option with a `cli` entry in common/spec/request_options.py,
    with its help, type, bounds and choices; a flag left out leaves the option to the
    SDK and the router (None)."""
    from specpipe.common.spec.request_options import REQUEST_OPTIONS

    for o in REQUEST_OPTIONS:
        if o.cli is None:
            continue
        if o.kind is bool:
            p.add_argument(o.cli, action="store_true", help=o.help)
            continue
        kw: dict[str, object] = {"default": None, "help": o.help + _default_of(o)}
        if o.choices:
            kw["choices"] = [str(c) for c in o.choices]
        if o.kind is tuple:
            kw.update(type=_token_ids, metavar="IDS")
            kw["help"] += " (comma-separated)"
        elif o.kind is dict:
            kw.update(type=_JSON_PARSERS[o.name], metavar="JSON")
        elif o.kind in (int, float):
            kw["type"] = _number_of(o)
        p.add_argument(o.cli, **kw)


def _default_of(o) -> str:
    if o.auto:
        return "; or 'auto' (default: the router's; with a draft it tunes)"
    return f" (default: {o.default})" if o.default not in ("", None, {}, ()) else ""


def _number_of(o):
    """The flag's type: a number of the option's kind within its declared bounds (and
    'auto' where the router may choose)."""

    def parse(text: str) -> int | float | str:
        if o.auto and text == "auto":
            return text
        try:
            value = o.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {o.kind.__name__}, got {text!r}") from None
        if (o.low is not None and value < o.low) or (o.high is not None and value > o.high):
            low = "-inf" if o.low is None else f"{o.low:g}"
            high = "inf" if o.high is None else f"{o.high:g}"
            raise argparse.ArgumentTypeError(f"{o.name} must be in [{low}, {high}], got {value}")
        return value

    parse.__name__ = o.kind.__name__  # argparse names the type in its errors
    return parse


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


# The options given as JSON on the command line, each parsed into the SDK's form.
_JSON_PARSERS = {"response_format": _response_format, "logit_bias": logit_bias}


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
