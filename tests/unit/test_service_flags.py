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
    assert settings.late_draft_wait == SchedulingConfig().late_draft_wait_ms
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


# `specpipe up`'s flags that are no DeploymentConfig field as they are: turned into one
# by `deployment_config` (resolved, inverted, loaded), or --secure's other half.
UP_BY_HAND = {"target", "draft", "threads", "no_prefix_cache", "no_metrics", "secure", "insecure"}


def test_up_flags_are_deployment_fields_or_few_by_hand() -> None:
    from specpipe.cli.service_flags import UP_FIELDS, UP_ROUTER_FILES

    dests = [a.dest for a in _actions("up")]
    assert len(dests) == len(set(dests))
    scheduling = {f.name for f, _ in setting_fields(SchedulingConfig)}
    declared = set(UP_FIELDS) | set(UP_ROUTER_FILES) | scheduling | {"dtype"}
    assert set(dests) == declared | UP_BY_HAND
    assert not declared & UP_BY_HAND


def test_up_builds_its_deployment_from_the_flags(monkeypatch) -> None:
    """Each field `up` sets from its flag of the same name arrives; the command line's
    own defaults (--router-port, --startup-timeout) differ from a library caller's."""
    from specpipe.services.config import DEFAULT_ROUTER_PORT, DeploymentConfig

    from specpipe.cli import services

    monkeypatch.setattr(services, "_resolve", lambda spec: spec)
    parse = build_parser().parse_args
    default = services.deployment_config(parse(["up", "--target", "t"]))
    assert default.router_port == DEFAULT_ROUTER_PORT != DeploymentConfig(target="t").router_port
    assert default.startup_timeout == 300.0 and default.secure and default.metrics
    argv = ["up", "--target", "t", "--stages", "3", "--stage-replicas", "2", "--layers", "0:1,1:2,2:3",
            "--transport", "ucx", "--router-port", "0", "--host", "0.0.0.0", "--devices", "cpu,cpu",
            "--drain-seconds", "4", "--log-dir", "/tmp/logs", "--startup-timeout", "9",
            "--max-cache-gib", "0.5", "--step-memory-mib", "32", "--lease-seconds", "7",
            "--batch-wait-ms", "3", "--emulate-costs", "c.json", "--http-port", "0",
            "--http-metrics", "open", "--tool-call-parser", "hermes", "--max-running", "5",
            "--threads", "2", "--no-metrics", "--insecure", "--no-prefix-cache"]  # fmt: skip
    c = services.deployment_config(parse(argv))
    assert (c.stages, c.stage_replicas, c.layers, c.transport) == (3, 2, "0:1,1:2,2:3", "ucx")
    assert (c.router_port, c.host, tuple(c.devices), c.drain_seconds) == (
        0,
        "0.0.0.0",
        ("cpu", "cpu"),
        4.0,
    )
    assert (c.log_dir, c.startup_timeout, c.max_cache_gib, c.step_memory_mib) == (
        "/tmp/logs",
        9.0,
        0.5,
        32.0,
    )
    assert (c.lease_seconds, c.batch_wait, c.emulate_costs) == (7.0, 0.003, "c.json")
    assert (c.http_port, c.http_metrics, c.tool_call_parser) == (0, "open", "hermes")
    assert c.scheduling.max_running == 5 and c.threads == 2
    assert not (c.metrics or c.secure or c.prefix_cache)


@pytest.mark.parametrize("command", [*COMMANDS, "up", "certs"])
def test_help_renders(command) -> None:
    """Every declared help text formats (a stray `%` or `%(name)s` fails here)."""
    assert "--" in _subparser(command).format_help()
