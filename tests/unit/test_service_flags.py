"""Every service setting is declared once (services/settings.py): the flags of
`specpipe stage|draft|router` are exactly their configuration's fields, each built from
the field's declaration, and a bad value is one line and exit 2."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest
from specpipe.services.config import (
    DEFAULT_LATE_DRAFT_WAIT_MS,
    DEFAULT_PATH_STALL_SECONDS,
    DEFAULT_REPLAY_SECONDS,
    DraftConfig,
    RouterConfig,
    SchedulingConfig,
    StageConfig,
)
from specpipe.services.settings import CommandLine, flag_name, setting_fields

from specpipe.cli import build_parser

COMMANDS = {"stage": StageConfig, "draft": DraftConfig, "router": RouterConfig}
# The one flag that is no field: --secure's other half (`secure` False).
PAIRED = {"insecure"}


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _actions(command: str) -> list[argparse.Action]:
    return [a for a in _subparser(command)._actions if a.dest != "help"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_field_is_one_flag_and_every_flag_a_field(command) -> None:
    config: type[CommandLine] = COMMANDS[command]
    dests = [a.dest for a in _actions(command)]
    assert len(dests) == len(set(dests))
    names = [f.name for f, _ in setting_fields(config)]
    assert len(names) == len(set(names))
    assert sorted(d for d in dests if d not in PAIRED) == sorted(names)
    assert [d for d in dests if d in PAIRED] == ["insecure"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_is_built_from_its_fields_declaration(command) -> None:
    """A flag written by hand again (its own help, name or default) fails here."""
    actions = {a.dest: a for a in _actions(command)}
    for f, _ in setting_fields(COMMANDS[command]):
        action = actions[f.name]
        if f.name == "secure":  # the pair --secure/--insecure, added by its declaration
            assert action.option_strings == ["--secure"]
            continue
        assert action.help == f.metadata["help"] and action.help, f.name
        assert action.option_strings == [flag_name(f), *f.metadata["aliases"]], f.name
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if f.metadata["env"] is None:
            assert action.default == (list(default) if f.metadata["repeat"] else default), f.name


def test_the_stall_settings_have_distinct_names() -> None:
    """Path silence (the router's watchdog) and a replica's stall (Backends) are two
    settings; the old --stall-seconds still means path silence."""
    parse = build_parser().parse_args
    old = RouterConfig.from_args(parse(["router", "--insecure", "--stall-seconds", "30"]))
    new = RouterConfig.from_args(parse(["router", "--insecure", "--path-stall-seconds", "30"]))
    assert old == new and new.path_stall_seconds == 30.0
    assert new.replica_stall_seconds == RouterConfig().replica_stall_seconds != 30.0
    assert RouterConfig().path_stall_seconds == DEFAULT_PATH_STALL_SECONDS


def test_router_defaults_are_named_once() -> None:
    from specpipe.services.router.driver import DriverSettings
    from specpipe.services.router.path_session import PathSession

    settings = DriverSettings()
    assert settings.replay_timeout == RouterConfig().replay_seconds == DEFAULT_REPLAY_SECONDS
    assert settings.stall_timeout == DEFAULT_PATH_STALL_SECONDS
    assert settings.late_draft_wait * 1e3 == SchedulingConfig().late_draft_wait_ms
    assert SchedulingConfig().late_draft_wait_ms == DEFAULT_LATE_DRAFT_WAIT_MS
    replay = inspect.signature(PathSession).parameters["replay_timeout"].default
    assert replay == DEFAULT_REPLAY_SECONDS


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["router", "--max-replays", "0"], "--max-replays"),
        (["router", "--replica-stall-seconds", "-1"], "--replica-stall-seconds"),
        (["router", "--late-draft-wait-ms", "-2"], "--late-draft-wait-ms"),
        (["router", "--width", "wide"], "--width"),
        (["router", "--token-source", "oracle"], "--token-source"),
        (["router", "--http-metrics", "public"], "--http-metrics"),
        (["router", "--port", "eighty"], "--port"),
        (["router", "--http-max-connections", "0"], "--http-max-connections"),
        (["stage", "--dtype", "float16"], "--dtype"),
        (["stage", "--transport", "carrier-pigeon"], "--transport"),
        (["stage", "--cache-fraction", "most"], "--cache-fraction"),
        (["draft", "--insecure"], "--model"),
    ],
)
def test_a_bad_value_is_one_line_and_exit_2(capsys, argv, flag) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and flag in err, err
