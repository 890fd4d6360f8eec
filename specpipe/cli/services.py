"""`specpipe stage|draft|router|up|client`: the network services' command lines."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from .args import (
    CliError,
    add_device_arg,
    add_dtype_arg,
    add_sampling_args,
    parse_device,
    parse_ids,
    positive_int,
)

DEFAULT_ROUTER_PORT = 50051
DEFAULT_DRAIN_SECONDS = 25.0


def _default_transport() -> str:
    from specpipe.services.transport import TCP, UCX
    from specpipe.services.transport.ucx import available

    return UCX if available() else TCP


def _service_args(p: argparse.ArgumentParser, port: int, data_plane: bool) -> None:
    from specpipe.services.transport import TRANSPORTS

    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    p.add_argument("--advertise-host", default=None, help="address others reach this one at")
    p.add_argument("--port", type=int, default=port, help="gRPC port (0: any free port)")
    if data_plane:
        p.add_argument("--data-port", type=int, default=0, help="hidden-state port (0: any)")
        p.add_argument(
            "--transport",
            choices=list(TRANSPORTS),
            default=None,
            help="data plane (default: ucx if installed)",
        )
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=DEFAULT_DRAIN_SECONDS,
        help="on SIGTERM: NOT_SERVING, refuse new requests, let open ones finish this long "
        "(keep it below the pod's terminationGracePeriodSeconds)",
    )
    p.add_argument("--ready-file", default=None, help="write addresses here (JSON) once serving")
    p.add_argument("--log-level", default=os.environ.get("SPECPIPE_LOG_LEVEL", "INFO"))
    _secure_args(p)


def _secure_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security (docs/architecture.md, section 9)")
    g.add_argument(
        "--secure",
        action="store_true",
        help="mutual TLS on gRPC among router, stages and draft, and authenticated "
        "data-plane frames (needs --tls-dir)",
    )
    g.add_argument(
        "--tls-dir",
        default=os.environ.get("SPECPIPE_TLS_DIR") or None,
        help="ca.crt, tls.crt, tls.key (a Kubernetes TLS Secret's layout) and optionally "
        "data.key (default: $SPECPIPE_TLS_DIR)",
    )
    g.add_argument(
        "--data-key-file",
        default=None,
        help="the data plane's shared secret (default: TLS_DIR/data.key, else derived "
        "from tls.key, which every service then must share)",
    )
    g.add_argument(
        "--tls-server-name",
        default="specpipe-internal",
        help="the name the deployment's certificates carry (checked instead of hosts)",
    )
    g.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="also serve plaintext gRPC health alone on this port (Kubernetes' gRPC probes "
        "speak no TLS)",
    )


def _model_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--model", required=required, help="model: name, HF directory or GGUF file")
    p.add_argument(
        "--model-id", default="", help="name reported to clients (default: directory name)"
    )
    add_dtype_arg(p)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument(
        "--max-cache-gib",
        type=float,
        default=None,
        help="KV cache budget (default: --cache-fraction of the device's free memory)",
    )
    p.add_argument(
        "--cache-fraction",
        type=float,
        default=0.8,
        help="without --max-cache-gib: this share of the device's free memory once the "
        "weights are loaded",
    )
    p.add_argument(
        "--lease-seconds",
        type=float,
        default=60.0,
        help="free a request's state when its router has not renewed it for this long",
    )
    add_device_arg(p)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `stage`, `draft`, `router`, `up` and `client` commands."""
    from specpipe.common.spec.options import (
        DEFAULT_MAX_NEW_TOKENS,
        DEFAULT_TOP_K_CHILDREN,
        DEFAULT_WIDTH,
        Mode,
    )
    from specpipe.services.transport import TCP, TRANSPORTS

    p = sub.add_parser("stage", help="serve layers of the target model (a pipeline stage)")
    _model_args(p, required=False)
    p.add_argument("--layers", default=None, help="START:END decoder layers (default: all)")
    p.add_argument(
        "--allow-configure",
        action="store_true",
        help="accept Configure calls (loading other weights over gRPC; off by default)",
    )
    p.add_argument(
        "--peers",
        default="",
        help="comma-separated hosts a request's next hop and report address may name "
        "(default: any)",
    )
    _service_args(p, 50052, data_plane=True)
    p.set_defaults(func=_cmd_stage)

    p = sub.add_parser("draft", help="serve a draft model that proposes tree layers")
    _model_args(p, required=True)
    _service_args(p, 50060, data_plane=False)
    p.set_defaults(func=_cmd_draft)

    p = sub.add_parser("router", help="serve clients: trees, verification, streaming")
    p.add_argument("--stages", required=True, help="comma-separated stage gRPC addresses HOST:PORT")
    p.add_argument("--draft", default=None, help="draft gRPC address HOST:PORT")
    p.add_argument("--target", default=None, help="target model directory (for its tokenizer)")
    p.add_argument("--model-id", default="", help="name clients use (default: the stages')")
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument(
        "--router-name",
        default="",
        help="this router's name on the stages and the draft (default HOST:PORT): a router "
        "restarted under the same name frees its predecessor's requests at once",
    )
    p.add_argument(
        "--progress-timeout",
        type=float,
        default=120.0,
        help="fail a request UNAVAILABLE when its pipeline brings no event for this long "
        "(0: never)",
    )
    _service_args(p, DEFAULT_ROUTER_PORT, data_plane=True)
    _http_args(p)
    p.set_defaults(func=_cmd_router)

    p = sub.add_parser("up", help="run router, draft and stages as local processes")
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default="none", help="draft model, 'oracle' (the target) or 'none'")
    p.add_argument("--stages", type=positive_int, default=2)
    p.add_argument("--layers", default=None, help="per-stage layer ranges: 0:7,7:14,...")
    p.add_argument(
        "--transport",
        choices=list(TRANSPORTS),
        default=TCP,
        help="data plane between the local processes (default tcp: on one host UCX has no "
        "RDMA/NVLink to use, and its polling progress was measured slower on small CPU nodes)",
    )
    p.add_argument("--router-port", type=int, default=DEFAULT_ROUTER_PORT)
    p.add_argument("--host", default="127.0.0.1")
    add_dtype_arg(p)
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: auto)")
    add_device_arg(p)
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=DEFAULT_DRAIN_SECONDS,
        help="on Ctrl-C/SIGTERM: how long open requests may finish before the processes stop",
    )
    p.add_argument("--log-dir", default=None, help="keep child logs here")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--max-cache-gib", type=float, default=None, help="KV cache budget per stage")
    p.add_argument(
        "--secure",
        action="store_true",
        help="mutual TLS and authenticated frames among the processes, with a throwaway CA "
        "and certificate made in the log directory",
    )
    p.add_argument("--lease-seconds", type=float, default=None, help="of the stages and draft")
    _http_args(p)
    p.set_defaults(func=_cmd_up)

    p = sub.add_parser(
        "certs",
        help="make a CA, a certificate and a data-plane key for --secure (ca.crt, tls.crt, "
        "tls.key, data.key: a Kubernetes Secret's files)",
    )
    p.add_argument("out", help="directory to write them to (created)")
    p.add_argument(
        "--host",
        action="append",
        default=[],
        help="an extra name or IP the certificate carries (repeatable)",
    )
    p.add_argument("--server-name", default="specpipe-internal")
    p.add_argument("--days", type=positive_int, default=365)
    p.set_defaults(func=_cmd_certs)

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
        "--width", type=int, default=None, help=f"tree width per layer (default {DEFAULT_WIDTH})"
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
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=_cmd_client_generate)
    m = csub.add_parser("models", help="list the served models")
    _client_common(m)
    m.set_defaults(func=_cmd_client_models)


def _http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health) on this port (0: any free port; default: no HTTP API)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require this key (Authorization: Bearer KEY) on the HTTP API and the gRPC "
        "Generation API; repeatable",
    )
    p.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        metavar="FILE",
        help="require one of the keys in FILE (one a line, '#' comments); repeatable",
    )
    p.add_argument(
        "--public-tls-cert",
        default=None,
        help="serve the public gRPC and HTTP ports over TLS with this certificate (PEM)",
    )
    p.add_argument("--public-tls-key", default=None, help="the key of --public-tls-cert (PEM)")


def _public_tls(args: argparse.Namespace):
    if bool(args.public_tls_cert) != bool(args.public_tls_key):
        raise CliError("--public-tls-cert and --public-tls-key go together")
    if not args.public_tls_cert:
        return None
    from specpipe.services.security import PublicTls, SecurityError

    try:
        return PublicTls.load(args.public_tls_cert, args.public_tls_key)
    except (SecurityError, ValueError) as e:
        raise CliError(f"public TLS: {e}") from None


def _api_keys(args: argparse.Namespace):
    from specpipe.services.auth import ApiKeyError, ApiKeys

    try:
        return ApiKeys.load(args.api_key, args.api_key_file)
    except ApiKeyError as e:
        raise CliError(str(e)) from None


def _client_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", default=f"127.0.0.1:{DEFAULT_ROUTER_PORT}", help="HOST:PORT")
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


# -- services ----------------------------------------------------------------------------
def _prepare(args: argparse.Namespace) -> None:
    from specpipe.services.serve import security_of, setup_logging

    setup_logging(args.log_level)
    if args.secure and not args.tls_dir:
        raise CliError("--secure needs --tls-dir (or $SPECPIPE_TLS_DIR)")
    if args.secure:
        from specpipe.services.security import SecurityError

        try:
            security_of(args)
        except SecurityError as e:
            raise CliError(str(e)) from None
    if getattr(args, "transport", "x") is None:
        args.transport = _default_transport()
    threads = getattr(args, "threads", 0)
    if threads and threads > 0:
        import torch

        torch.set_num_threads(threads)


def _resolve(spec: str | None) -> str | None:
    if spec is None:
        return None
    from specpipe.common.store.resolver import resolve_model

    return str(resolve_model(spec))


def _cmd_stage(args: argparse.Namespace) -> int:
    from specpipe.services.serve import run_stage

    if not args.model and not args.allow_configure:
        raise CliError("a stage without --model waits for Configure: give --allow-configure")
    args.peers = [h.strip() for h in args.peers.split(",") if h.strip()]
    args.device = parse_device(args.device)
    _prepare(args)
    args.model = _resolve(args.model)
    asyncio.run(run_stage(args))
    return 0


def _cmd_draft(args: argparse.Namespace) -> int:
    from specpipe.services.serve import run_draft

    args.device = parse_device(args.device)
    _prepare(args)
    args.model = _resolve(args.model)
    asyncio.run(run_draft(args))
    return 0


def _cmd_router(args: argparse.Namespace) -> int:
    from specpipe.services.serve import run_router

    _prepare(args)
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    if not args.stages:
        raise CliError("--stages lists no addresses")
    args.api_keys = _api_keys(args)
    args.public_tls = _public_tls(args)
    args.target = _resolve(args.target)
    asyncio.run(run_router(args))
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from specpipe.services.launcher import LaunchError, ServicesDeployment

    transport = args.transport
    device = parse_device(args.device)
    target = _resolve(args.target)
    draft = args.draft if args.draft in ("oracle", "none") else _resolve(args.draft)
    api_keys = _api_keys(args)
    public_tls = _public_tls(args)
    try:
        dep = ServicesDeployment(
            target,
            draft,
            args.stages,
            transport=transport,
            router_port=args.router_port,
            layers=args.layers,
            host=args.host,
            dtype=args.dtype,
            threads=args.threads or None,
            device=device,
            drain_seconds=args.drain_seconds,
            log_dir=args.log_dir,
            startup_timeout=args.startup_timeout,
            max_cache_gib=args.max_cache_gib,
            http_port=args.http_port,
            api_keys=api_keys.keys,
            secure=args.secure,
            lease_seconds=args.lease_seconds,
            public_tls=public_tls,
        )
    except ValueError as e:
        raise CliError(str(e)) from None
    print(
        f"starting {len(dep.ranges)} stages "
        f"({', '.join(f'{r.start}:{r.end}' for r in dep.ranges)}), "
        f"draft={draft}, transport={transport}, device={device} ...",
        file=sys.stderr,
        flush=True,
    )
    try:
        address = dep.start()
    except LaunchError as e:
        raise CliError(str(e)) from None
    print(f"router: {address}", flush=True)
    if dep.http_address:
        scheme = "https" if public_tls else "http"
        print(f"http: {scheme}://{dep.http_address}/v1", flush=True)
    print("serving; Ctrl-C stops every process", file=sys.stderr, flush=True)
    try:
        return dep.wait()
    finally:
        dep.stop()


def _cmd_certs(args: argparse.Namespace) -> int:
    from specpipe.services.security import make_pki

    hosts = ["127.0.0.1", "localhost", *args.host]
    out = make_pki(args.out, hosts=hosts, server_name=args.server_name, days=args.days)
    print(f"wrote {out}/ca.crt, tls.crt, tls.key, data.key (the CA's key is not kept)")
    print(f"kubectl create secret generic specpipe-internal-tls --from-file={out}")
    return 0


# -- client ------------------------------------------------------------------------------
def _cmd_client_generate(args: argparse.Namespace) -> int:
    from specpipe.services.client import Client, SpecPipeError

    kwargs = dict(
        model=args.model,
        mode=args.mode,
        chat=args.chat,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        width=args.width,
        top_k_children=args.top_k_children,
        depth=args.depth,
        ignore_eos=args.ignore_eos,
        prefill_chunk=args.prefill_chunk,
    )
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
                print(json.dumps({**out, "speculation": done.speculation()}))
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
