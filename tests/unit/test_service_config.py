"""Typed service configurations (services/config.py): a configuration's command line
parses back into the same configuration through the real `specpipe` parser, every
field is a flag of its command, and the defaults repeated for a light import equal
their origins."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from specpipe.services.config import (
    CommandLine,
    DeploymentConfig,
    DraftConfig,
    RouterConfig,
    SchedulingConfig,
    StageConfig,
)

from specpipe.cli import build_parser

# Every field away from its default, so that a field argv() forgets cannot parse back.
STAGE = StageConfig(
    host="0.0.0.0", advertise_host="10.0.0.5", port=7001, drain_seconds=3.5,
    metrics_port=7002, ready_file="/tmp/r.json", log_level="DEBUG", secure=True,
    tls_dir="/etc/tls", data_key_file="/etc/tls/k", tls_server_name="x-internal",
    health_port=7003, model="/models/m", model_id="m1", dtype="float64", threads=3,
    device="cuda:1", max_cache_gib=1.5, cache_fraction=0.25, step_memory_mib=96.0, lease_seconds=9.0,
    emulate_costs="/tmp/c.json", measure_costs=True, batch_wait=0.005, data_port=7004,
    transport="tcp", layers="3:7", emulate_stage=1, allow_configure=True, no_prefix_cache=True,
    peers=("10.0.0.0/8", "127.0.0.1"), no_batch_invariant=True, draft_activity="/tmp/a",
    threads_with_draft=1,
)  # fmt: skip
DRAFT = DraftConfig(
    host="::", port=7005, drain_seconds=1.0, secure=False, model="/models/d",
    model_id="d", dtype="bfloat16", threads=2, device="cuda", max_cache_gib=0.5,
    cache_fraction=0.5, step_memory_mib=48.0, lease_seconds=3.0, emulate_costs="/tmp/c.json", measure_costs=True,
    batch_wait=0.0, metrics_port=0, health_port=9, draft_activity="/tmp/a", activity_slot=2,
)  # fmt: skip
ROUTER = RouterConfig(
    host="0.0.0.0", advertise_host="r", port=7006, data_port=7007, transport="ucx",
    drain_seconds=2.0, metrics_port=7008, ready_file="/tmp/ready", log_level="WARNING",
    secure=True, tls_dir="/etc/tls", data_key_file="/k", tls_server_name="n",
    health_port=7009, stages=("a:1", "b:2"), drafts=("c:3",),
    discovery_namespace="ns", discovery_selector="app=x", replay_seconds=4.0,
    max_replays=2, path_stall_seconds=30.0, replica_stall_seconds=1.5, target="/models/m",
    health_check_interval=0.25, no_control_frames=True, no_relay_prunes=True,
    model_id="served", startup_timeout=12.0, router_name="r1", http_port=8000,
    http_metrics="open", tool_call_parser="hermes",
    api_keys=("k1", "k2"), api_key_files=("/a", "/b"), public_tls_cert="/c.pem",
    public_tls_key="/k.pem", http_max_connections=100, http_max_connections_per_client=3,
    http_header_timeout=2.5, max_priority=4, share_prefix_cache=True, describe_internals=True,
    scheduling=SchedulingConfig(
        max_running=3, max_waiting=4, max_running_per_key=2, max_waiting_per_key=3,
        row_budget="auto", width=8, layers_per_step="auto",
        token_source="ngram", tune_calibration_tokens=64, tune_price="model",
        late_draft_wait_ms=2.5,
    ),
)  # fmt: skip


def _parse(command: str, config: CommandLine):
    return type(config).from_args(build_parser().parse_args([command, *config.argv()]))


@pytest.mark.parametrize(
    "command,config",
    [
        ("stage", STAGE),
        ("draft", DRAFT),
        ("router", ROUTER),
        ("stage", StageConfig(model="m")),
        ("draft", DraftConfig(model="m")),
        ("router", RouterConfig(discovery="file:/tmp/backends")),
    ],
)
def test_a_configuration_is_its_command_line(command, config) -> None:
    assert _parse(command, config) == config


def test_every_field_differs_from_its_default_in_the_round_trip_configurations() -> None:
    """The round trip above proves a flag for each field only if the field is set."""
    for config in (STAGE, ROUTER, ROUTER.scheduling):
        default = type(config)()
        same = [
            f.name
            for f in dataclasses.fields(config)
            if getattr(config, f.name) == getattr(default, f.name)
        ]
        allowed = {"secure"} if config is ROUTER or config is STAGE else set()
        allowed |= {"discovery"} if config is ROUTER else set()  # instead of the lists
        assert set(same) <= allowed, same


def test_the_parser_defaults_are_the_configurations() -> None:
    """A command line with only what is required gives the configuration's defaults."""
    parse = build_parser().parse_args
    assert StageConfig.from_args(parse(["stage", "--secure"])) == StageConfig()
    assert DraftConfig.from_args(parse(["draft", "--secure", "--model", "m"])) == DraftConfig(
        model="m"
    )
    assert RouterConfig.from_args(parse(["router", "--secure"])) == RouterConfig()


def test_insecure_is_written_out() -> None:
    assert "--insecure" in DraftConfig(model="m", secure=False).argv()
    assert "--secure" in StageConfig().argv() and "--insecure" not in StageConfig().argv()


def test_public_tls_needs_both_files() -> None:
    with pytest.raises(ValueError, match="go together"):
        RouterConfig(public_tls_cert="/c.pem")


def test_scheduling_from_a_mapping_keeps_the_defaults_of_what_is_none() -> None:
    s = DeploymentConfig(target="t", scheduling={"max_running": None, "width": "auto"})
    assert s.scheduling == SchedulingConfig(width="auto")
    assert s.scheduling.needs_costs(stage=False)
    budget = SchedulingConfig(row_budget="auto")
    assert budget.needs_costs(stage=True) and not budget.needs_costs(stage=False)


def test_repeated_defaults_equal_their_origins() -> None:
    from specpipe.common.runtime.lease import DEFAULT_LEASE_SECONDS
    from specpipe.common.spec.scheduler import (
        DEFAULT_MAX_RUNNING,
        DEFAULT_MAX_WAITING,
        DEFAULT_MAX_WAITING_PER_TENANT,
    )
    from specpipe.common.spec.tool_parsers import AUTO as AUTO_PARSER
    from specpipe.common.spec.tool_parsers import PARSER_CHOICES
    from specpipe.services import config, modelinfo, security, transport
    from specpipe.services.auth import DEFAULT_MAX_PRIORITY
    from specpipe.services.router.backends import DEFAULT_STALL_SECONDS
    from specpipe.services.router.edge import DEFAULT_PER_CLIENT, HEADER_TIMEOUT
    from specpipe.services.router.side_endpoints import METRICS_ACCESS

    assert config.DEFAULT_HTTP_PER_CLIENT == DEFAULT_PER_CLIENT
    assert config.DEFAULT_HTTP_HEADER_TIMEOUT == HEADER_TIMEOUT
    assert config.DEFAULT_MAX_PRIORITY == DEFAULT_MAX_PRIORITY
    assert config.DEFAULT_CACHE_FRACTION == modelinfo.DEFAULT_CACHE_FRACTION
    assert config.DEFAULT_REPLICA_STALL_SECONDS == DEFAULT_STALL_SECONDS
    assert config.DEFAULT_SERVER_NAME == security.DEFAULT_SERVER_NAME
    assert config.DEFAULT_LEASE_SECONDS == DEFAULT_LEASE_SECONDS
    assert (config.DEFAULT_MAX_RUNNING, config.DEFAULT_MAX_WAITING) == (
        DEFAULT_MAX_RUNNING,
        DEFAULT_MAX_WAITING,
    )
    assert config.DEFAULT_MAX_WAITING_PER_KEY == DEFAULT_MAX_WAITING_PER_TENANT
    assert config.TRANSPORTS == transport.TRANSPORTS and config.TCP == transport.TCP
    assert config.HTTP_METRICS_ACCESS == METRICS_ACCESS
    assert config.TOOL_CALL_PARSERS == PARSER_CHOICES
    assert config.DEFAULT_TOOL_CALL_PARSER == AUTO_PARSER


def test_the_launcher_gives_each_child_a_command_line_that_parses(llama_dir: Path) -> None:
    """`specpipe up`'s children: every argv the launcher builds is a valid command line
    whose configuration carries the deployment's choices (no process is started)."""
    from specpipe.services.launcher import ServicesDeployment

    dep = ServicesDeployment(
        DeploymentConfig(
            target=llama_dir, draft="oracle", stages=2, dtype="float64", threads=1,
            secure=False, lease_seconds=7.0, batch_wait=0.002, metrics=True,
            scheduling={"width": "auto", "max_running": 5}, api_keys=["secret-key"],
            http_port=0,
        )
    )  # fmt: skip
    try:
        for i, r in enumerate(dep.ranges):
            dep._stage_child(f"stage{i}", dep.target, f"{r.start}:{r.end}", "", index=i)
        dep._draft_child("draft", dep.draft, "")
        dep._router_child()
        parse = build_parser().parse_args
        configs = {}
        for name, child in dep.children.items():
            i = child.argv.index(child.kind)
            kind = {"stage": StageConfig, "draft": DraftConfig, "router": RouterConfig}
            configs[name] = kind[child.kind].from_args(parse(child.argv[i:]))
        stage0, draft, router = configs["stage0"], configs["draft"], configs["router"]
        assert (stage0.layers, stage0.dtype, stage0.threads) == ("0:2", "float64", 1)
        assert stage0.lease_seconds == 7.0 and stage0.batch_wait == pytest.approx(0.002)
        assert not stage0.secure and stage0.peers == ("127.0.0.1",)
        assert stage0.measure_costs and draft.measure_costs  # width auto: costs measured
        assert all(c.metrics_port for c in configs.values())
        assert router.scheduling == SchedulingConfig(width="auto", max_running=5)
        assert router.http_port and router.discovery == f"file:{dep.discovery_file}"
        assert router.api_keys == () and len(router.api_key_files) == 1  # not on argv
        assert "secret-key" not in " ".join(dep.children["router"].argv)
        assert Path(router.api_key_files[0]).read_text() == "secret-key\n"
    finally:
        dep.stop()
