"""Argument helpers shared by the `specpipe` subcommands."""

from __future__ import annotations

import argparse
import json
from typing import NoReturn

from specpipe.services.config import DEFAULT_ROUTER_PORT as DEFAULT_ROUTER_PORT
from specpipe.services.config import DTYPE_CHOICES as DTYPE_CHOICES
from specpipe.services.config import ModelServiceConfig
from specpipe.services.settings import add_flags
from specpipe.services.settings import auto_or_positive_int as auto_or_positive_int
from specpipe.services.settings import non_negative_float as non_negative_float
from specpipe.services.settings import positive_int as positive_int


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """Argument errors as one line and exit code 2 (no usage text)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_ids(text: str) -> list[int]:
    """`--prompt-ids`: comma-separated token ids."""
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise CliError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise CliError("--prompt-ids is empty")
    return ids


def add_dtype_arg(p: argparse.ArgumentParser) -> None:
    """--dtype as the model services declare it."""
    add_flags(p, ModelServiceConfig, only=("dtype",))


def add_device_arg(p: argparse.ArgumentParser) -> None:
    """--device as the model services declare it."""
    add_flags(p, ModelServiceConfig, only=("device",))


def parse_device(spec: str) -> str:
    """The torch device a `--device` value names (a CliError for one the services refuse)."""
    from specpipe.services.modelinfo import resolve_device

    try:
        return resolve_device(spec)
    except ValueError as e:
        raise CliError(f"--device: {e}") from None


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """--temperature, --top-k, --top-p and --seed, defaulting to `SamplingParams`' defaults."""
    from specpipe.common.spec.sampling import SamplingParams

    default = SamplingParams()
    p.add_argument("--temperature", type=float, default=default.temperature)
    p.add_argument("--top-k", type=int, default=default.top_k)
    p.add_argument("--top-p", type=float, default=default.top_p)
    p.add_argument("--seed", type=int, default=default.seed)


def add_logits_rules_args(p: argparse.ArgumentParser) -> None:
    """The logits rules' flags (common/spec/penalties.py), defaulting to none."""
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="over the prompt's and the output's tokens, in (0, 2] (default 1: none)",
    )
    p.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="over the output's tokens, in [-2, 2]"
    )
    p.add_argument(
        "--presence-penalty", type=float, default=0.0, help="over the output's tokens, in [-2, 2]"
    )
    p.add_argument(
        "--logit-bias",
        type=logit_bias,
        default=None,
        metavar="JSON",
        help="token id -> bias added to its logit, as JSON: '{\"50256\": -100}'",
    )
    p.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        help="the end-of-sequence and stop tokens cannot come before this many tokens",
    )


def logit_bias(text: str) -> dict[int, float]:
    """A logit bias as JSON ({"token id": bias}, OpenAI's shape)."""
    try:
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError("not an object")
        return {int(t): float(b) for t, b in value.items()}
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(
            f'expected a JSON object of token ids and biases, e.g. {{"50256": -100}}: {e}'
        ) from None
