"""The `specpipe` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import bench, client, generate, models, planning, selfcheck, services
from .args import CliError, Parser


def _user_errors() -> tuple[type[Exception], ...]:
    from specpipe.common.model.config import ModelConfigError
    from specpipe.common.store.errors import ModelNotFoundError
    from specpipe.common.text import TokenizerError

    return (ModelConfigError, ModelNotFoundError, TokenizerError)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="specpipe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    generate.register(sub)
    models.register(sub)
    services.register(sub)
    client.register(sub)
    bench.register(sub)
    planning.register(sub)
    selfcheck.register(sub)
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
