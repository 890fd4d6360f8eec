"""Settings declared once: a configuration field that is also its command-line flag.

`flag(...)` declares a field of a `CommandLine` configuration (services/config.py) with
everything its flag needs: help, how its text parses (and so its validation), choices,
an environment default, its group. `add_flags` builds a parser's flags from those
fields, `CommandLine.from_args` reads the parsed flags back, and `CommandLine.argv`
writes a configuration as the command line that parses into it (the launcher's children).
So a setting is written in one place, and a flag cannot exist without its field
(tests/unit/test_service_flags.py).

No I/O, and no heavy imports: a command line's parser should not wait for torch or grpc.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from collections.abc import Callable, Collection, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, TypeVar

Render = Callable[[str, Any], list[str]]
Parse = Callable[[str], Any]
# Adds a field's flags itself (a pair such as --secure/--insecure): (container, dest, default).
Adder = Callable[[Any, str, Any], None]


def flag(
    default: Any = None,
    *,
    help: str | None = None,
    name: str | None = None,
    aliases: Sequence[str] = (),
    parse: Parse | None = None,
    render: Render | None = None,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    env: str | None = None,
    group: str | None = None,
    repeat: bool = False,
    add: Adder | None = None,
    exclusive: str | None = None,
    command_default: Any = MISSING,
) -> Any:
    """A field that is one command-line flag: `--<field-name>` unless `name` says
    otherwise (`aliases`: older names it still answers to). `parse` turns its text into
    the value (default: the field's type; an `argparse.ArgumentTypeError` is a clear CLI
    error); `render` writes a value back as arguments (default: booleans as a bare flag
    when true, tuples as a repeated flag, None as nothing, anything else as `str`).
    `env`: the environment variable that overrides the default on the command line;
    `group`: the title of its help section; `repeat`: given once per value;
    `add`: adds the flag itself (what a plain `add_argument` cannot say); `exclusive`:
    a name shared by flags of which one at most may be given; `command_default`: the
    command line's default where it differs from the field's (a library caller's)."""
    meta = {
        "flag": name,
        "help": help,
        "aliases": tuple(aliases),
        "parse": parse,
        "render": render,
        "choices": tuple(choices) if choices is not None else None,
        "metavar": metavar,
        "env": env,
        "group": group,
        "repeat": repeat,
        "add": add,
        "exclusive": exclusive,
        "command_default": command_default,
    }
    return field(default=default, metadata=meta)


def flag_name(f: Field) -> str:
    return f.metadata.get("flag") or f"--{f.name.replace('_', '-')}"


# -- parsing: each an argparse `type`, so a bad value is a one-line error and exit 2 --------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def auto_or_positive_int(text: str) -> int | str:
    """A positive integer, or 'auto' (the router's or the engine's choice)."""
    return text if text == "auto" else positive_int(text)


def comma_list(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def ms_or_auto(upper_ms: float) -> Parse:
    """Milliseconds in [0, upper_ms] as seconds, or None for 'auto'."""

    def parse(text: str) -> float | None:
        if text == "auto":
            return None
        try:
            ms = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected milliseconds or 'auto', got {text!r}"
            ) from None
        if not 0 <= ms <= upper_ms:
            raise argparse.ArgumentTypeError(f"must be in [0, {upper_ms:.0f}] ms, got {text}")
        return ms / 1e3

    return parse


# -- rendering: a value as the arguments that parse back into it ---------------------------


def render_comma(name: str, values: Sequence[str]) -> list[str]:
    return [name, ",".join(values)] if values else []


def render_ms(name: str, seconds: float | None) -> list[str]:
    if seconds is None:
        return []
    ms = seconds * 1e3
    return [name, str(int(ms)) if ms == int(ms) else repr(ms)]


def _render(name: str, value: Any) -> list[str]:
    if value is None or value is False:
        return []
    if value is True:
        return [name]
    if isinstance(value, tuple):
        return [a for v in value for a in (name, str(v))]
    return [name, str(value)]


C = TypeVar("C", bound="CommandLine")


@dataclass(frozen=True, kw_only=True)
class CommandLine:
    """A configuration whose fields are flags (see `flag`); a field holding another
    `CommandLine` contributes that one's flags."""

    def argv(self) -> list[str]:
        """The command-line arguments that parse back into this configuration."""
        out: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, CommandLine):
                out += value.argv()
                continue
            out += (f.metadata.get("render") or _render)(flag_name(f), value)
        return out

    @classmethod
    def from_args(cls: type[C], args: argparse.Namespace) -> C:
        """From parsed arguments whose names are this configuration's fields (lists, as
        argparse's repeated flags give them, become tuples)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            nested = _nested(f)
            if nested is not None:
                values[f.name] = nested.from_args(args)
                continue
            value = getattr(args, f.name)
            values[f.name] = tuple(value) if isinstance(value, list) else value
        return cls(**values)


def _nested(f: Field) -> type[CommandLine] | None:
    factory = f.default_factory
    if isinstance(factory, type) and issubclass(factory, CommandLine):
        return factory
    return None


def _plain_type(cls: type, name: str) -> Any:
    """The field's type without None (`int | None` -> int)."""
    hint = typing.get_type_hints(cls)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
        raise TypeError(f"{cls.__name__}.{name}: give its flag a parse= for {hint}")
    return hint


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    only: Collection[str] | None = None,
    skip: Collection[str] = (),
    required: Collection[str] = (),
) -> None:
    """Add the flags of `cls`'s fields (`only` these, or all but `skip`; `required`:
    these must be given) to `parser`, in field order."""
    groups: dict[str, Any] = {}
    exclusive: dict[str, Any] = {}
    for f, owner in setting_fields(cls):
        if (only is not None and f.name not in only) or f.name in skip:
            continue
        meta = f.metadata
        if meta.get("group"):
            title = meta["group"]
            container = groups.get(title) or groups.setdefault(
                title, parser.add_argument_group(title)
            )
        else:
            container = parser
        if meta.get("exclusive"):
            key = meta["exclusive"]
            container = exclusive.get(key) or exclusive.setdefault(
                key, container.add_mutually_exclusive_group()
            )
        default = f.default if f.default is not MISSING else f.default_factory()
        if meta.get("command_default", MISSING) is not MISSING:
            default = meta["command_default"]
        if meta.get("env"):
            default = os.environ.get(meta["env"]) or default
        if meta.get("add"):
            meta["add"](container, f.name, default)
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "help": meta.get("help")}
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        if f.name in required:
            kwargs["required"] = True
        if default is False:
            kwargs["action"] = "store_true"
        elif meta.get("repeat"):
            kwargs.update(action="append", default=list(default))
        else:
            kwargs["default"] = default
            kwargs["type"] = meta.get("parse") or _plain_type(owner, f.name)
            if meta.get("choices"):
                kwargs["choices"] = list(meta["choices"])
        container.add_argument(flag_name(f), *meta.get("aliases", ()), **kwargs)


def setting_fields(cls: type) -> list[tuple[Field, type]]:
    """Every flag-carrying field of dataclass `cls` with the class whose hints type it,
    nested configurations' included."""
    out: list[tuple[Field, type]] = []
    for f in fields(cls):
        nested = _nested(f)
        if nested is not None:
            out += setting_fields(nested)
        elif "flag" in f.metadata:
            out.append((f, cls))
    return out
