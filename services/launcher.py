"""`specpipe up`: router, draft and S stages as separate OS processes on this machine.

Each child is a plain `specpipe stage|draft|router` process (the same command a
container runs), started with free ports chosen here; a child reports readiness by
writing a small JSON file. The launcher waits until all are ready, then stays in the
foreground; stopping it stops every child (SIGTERM, then SIGKILL after a grace period).
Children die with the launcher however it ends: each watches a pipe whose only writer
is the launcher, and the pipe's end (the launcher exited, even by SIGKILL) stops the
child as the launcher's own stop would (`watch_parent`).

Secure by default: a throwaway CA and certificate for mutual TLS and authenticated
frames among the processes, and next hops only to this host's addresses (`--peers`);
`secure=False` (`specpipe up --insecure`) for plaintext.

Each stage and the draft gets its device from the deployment's placement
(`placement.py`): with `--device cuda`, one GPU per service, round-robin over the
visible ones; each one's KV cache budget is its share of its own device's memory.

The router finds the stages and the draft through a discovery file the launcher writes
(`--discovery file:PATH`, one `stage|draft HOST:PORT [GROUP]` a line), so replicas can
be added and removed while it serves (`add_stage`, `add_draft`, `unlist`): the same
live membership Kubernetes gives the chart's routers through EndpointSlices.

One module: the children, the ports handed out, the discovery file and the pipe the
children watch are the state of one deployment, started and stopped together.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from specpipe.common.model.config import ModelConfig
from specpipe.common.model.partition import parse_layer_ranges, split_layers

from .config import (
    DEFAULT_CACHE_FRACTION,
    DeploymentConfig,
    DraftConfig,
    RouterConfig,
    ServiceConfig,
    StageConfig,
)
from .cpu_threads import (
    DraftActivity,
    draft_threads,
    env_of,
    model_threads,
    small_model,
    threads_with_draft,
)
from .placement import Placement, one_per_gpu, plan


class LaunchError(RuntimeError):
    """A child did not come up; the message includes the tail of its log."""


class StopRequested(Exception):
    """A stop signal arrived while the deployment was starting (it has been stopped)."""


# A child's end of the launcher's pipe (its fd number) and how long it may drain when the
# launcher is gone before it kills itself (`watch_parent`).
PARENT_FD_ENV = "SPECPIPE_PARENT_FD"
PARENT_GRACE_ENV = "SPECPIPE_PARENT_GRACE"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# How long a stopping child may take beyond its drain (closing servers, exiting) before
# it is killed.
STOP_SLACK = 5.0


def _stage_name(stage: int, replica: int) -> str:
    return f"stage{stage}" if replica == 0 else f"stage{stage}.{replica}"


def visible_gpus() -> int:
    """GPUs this process sees (torch is imported only when a placement needs it)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Child:
    name: str
    argv: list[str]
    ready_file: Path
    log_file: Path
    proc: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)
    kind: str = ""  # "stage", "draft" or "router"
    group: str = ""  # the model version it belongs to (discovery file)
    started_at: float = 0.0  # time.monotonic() at spawn

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class ServicesDeployment:
    """`specpipe up` from a `DeploymentConfig`. `ServicesDeployment(target, draft, stages,
    **fields)` is the same with the configuration's fields given one by one."""

    def __init__(
        self,
        config: DeploymentConfig | str | Path,
        draft: str | Path | None = None,
        stages: int | None = None,
        **fields,
    ) -> None:
        if not isinstance(config, DeploymentConfig):
            stages = 2 if stages is None else stages
            config = DeploymentConfig(target=config, draft=draft, stages=stages, **fields)
        elif draft is not None or stages is not None or fields:
            raise TypeError("a DeploymentConfig says everything; give nothing else")
        self.config = c = config
        self.target = Path(c.target)
        self.draft = (
            None
            if c.draft in (None, "none")
            else Path(self.target if c.draft == "oracle" else c.draft)
        )
        cfg = ModelConfig.from_dir(self.target)
        if c.stages < 1 or c.stages > cfg.num_layers:
            raise ValueError(f"--stages must be in [1, {cfg.num_layers}], got {c.stages}")
        self.ranges = (
            parse_layer_ranges(c.layers, cfg.num_layers)
            if c.layers
            else split_layers(cfg.num_layers, c.stages)
        )
        if c.layers and len(self.ranges) != c.stages:
            raise ValueError(f"--layers lists {len(self.ranges)} stages, --stages is {c.stages}")
        self.host = c.host
        # The address every child advertises (a wildcard listens everywhere, but the
        # children reach each other on loopback): the stages' only --peers.
        self.advertise_host = "127.0.0.1" if c.host in ("0.0.0.0", "::", "") else c.host
        per_stage = (
            [c.stage_replicas] * len(self.ranges)
            if isinstance(c.stage_replicas, int)
            else list(c.stage_replicas)
        )
        if len(per_stage) != len(self.ranges) or min(per_stage) < 1:
            raise ValueError(f"--stage-replicas must be at least 1, got {c.stage_replicas}")
        self.stage_replicas = per_stage  # replicas of each stage
        names = [_stage_name(i, j) for i, n in enumerate(per_stage) for j in range(n)]
        device = c.device
        if device == "auto":  # the command line resolves it; callers of this class may not
            from .modelinfo import resolve_device

            device = resolve_device(device)
        gpus = visible_gpus() if one_per_gpu(device) and not c.devices else 0
        self.placement: Placement = plan(
            [*names, *(["draft"] if self.draft else [])], device, c.devices, gpus
        )
        self._ordinals = {n: k for k, n in enumerate(self.placement.names)}
        self.group = c.group  # discovery group of the first model version
        # The stages' cores as without a draft, every core to the draft (or split with it
        # while it works, opt-in), one thread for a small model, passive OpenMP waits
        # (services/cpu_threads.py)
        cpus, stages = os.cpu_count() or 1, sum(per_stage)
        small = small_model(cfg, stages)
        self.threads = model_threads(c.threads, cpus, stages, small)
        small_draft = self.draft is not None and small_model(ModelConfig.from_dir(self.draft))
        split = c.split_cores_while_drafting
        self.draft_threads = draft_threads(
            c.draft_threads, c.threads, cpus, stages, small_draft, split
        )
        # fewer while the draft works (--split-cores-while-drafting): on one CPU host with
        # a draft, threads not fixed
        self.threads_with_draft = (
            threads_with_draft(self.threads, self.draft_threads, cpus, stages)
            if split and self.draft is not None and c.threads is None and self._all_on_cpus()
            else 0
        )
        self.drain_seconds = c.drain_seconds
        self.startup_timeout = c.startup_timeout
        self._own_dir = c.log_dir is None
        self.log_dir = Path(c.log_dir or tempfile.mkdtemp(prefix="specpipe-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.draft_activity = (  # the drafts' flags, read by the stages (cpu_threads)
            DraftActivity.create(self.log_dir / "draft-activity")
            if self.threads_with_draft
            else None
        )
        self._draft_slots = 0  # slots of that file handed out
        # the children's environment; a model process's adds passive OpenMP waits (`env_of`)
        self.env = {**os.environ, **(c.env or {})}
        self.api_keys = list(c.api_keys)
        self.secure = c.secure
        self.emulate_costs = Path(c.emulate_costs).resolve() if c.emulate_costs else None
        if self.emulate_costs is not None:
            from specpipe.common.perf.emulate import EmulatedCosts

            EmulatedCosts.load(self.emulate_costs).check_stages(len(self.ranges))
        self.children: dict[str, Child] = {}
        self._ports: set[int] = set()  # handed out: two children never get the same one
        self.listed: list[str] = []  # children in the discovery file, in order
        self.discovery_file = self.log_dir / "backends"
        self.router_address = ""
        self.http_address = ""  # HOST:PORT of the HTTP API once started
        # Every child holds the read end; only this process the write end: when it exits
        # (however), the children see the pipe end (`watch_parent`).
        self._parent_r, self._parent_w = os.pipe()
        self.stop_signal: int | None = None  # the first stop signal (`stop_on_signals`)
        self._hurry = False  # a second one: kill the children now

    def _all_on_cpus(self) -> bool:
        """Whether every model process runs on this host's CPUs (they share its cores)."""
        return all(self.placement.device_of(k) == "cpu" for k in range(len(self.placement.names)))

    def _free_port(self) -> int:
        """A free port not handed to another child of this deployment (the kernel may
        give a port just released back; children bind theirs only when they start)."""
        for _ in range(100):
            port = free_port(self.host)
            if port not in self._ports:
                self._ports.add(port)
                return port
        raise LaunchError("no free port")

    # -- children: their configurations and command lines --------------------------------
    def _child(self, name: str, kind: str, config: ServiceConfig, group: str = "") -> Child:
        """A child process running `config` (its ready file and metrics port set here)."""
        ready = self.log_dir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        metrics_port = self._free_port() if self.config.metrics else None
        config = replace(config, ready_file=str(ready), metrics_port=metrics_port)
        argv = [sys.executable, "-m", "specpipe.cli", kind, *config.argv()]
        child = Child(name, argv, ready, self.log_dir / f"{name}.log", kind=kind, group=group)
        child.info["address"] = f"{self.host}:{config.port}"
        if isinstance(config, (StageConfig, DraftConfig)):
            child.info["device"] = config.device
        self.children[name] = child
        return child

    def _service(self) -> dict[str, object]:
        """What every child's configuration shares."""
        return dict(
            host=self.host,
            drain_seconds=self.drain_seconds,
            log_level=self.env.get("SPECPIPE_LOG_LEVEL", ServiceConfig().log_level),
            secure=self.secure,
            tls_dir=str(self._tls()) if self.secure else None,
        )

    def data_plane(self) -> str:
        """How hidden states will cross between the stages' devices: what each stage
        decides at start (`transport/device_memory.py`) and logs, said here before."""
        c = self.config
        device = self.device_of(self.placement.names[0])
        if device == "cpu":
            return f"data plane {c.transport}: host memory"
        from .transport.device_memory import HOST_ONLY, default_tls, ucx_device_memory

        tls = self.env.get("UCX_TLS") or default_tls(device)
        memory = HOST_ONLY if c.transport != "ucx" else ucx_device_memory(device, self.secure, tls)
        could = ucx_device_memory(device, False, tls).carried  # with --transport ucx --insecure
        hint = " (--transport ucx --insecure keeps them on the GPUs)" if could else ""
        return f"data plane {c.transport}: {memory.why}{'' if memory.carried else hint}"

    def device_of(self, name: str) -> str:
        """The device of model service `name`: its place in the plan, or (one added
        later) the next one the placement gives."""
        k = self._ordinals.setdefault(name, len(self._ordinals))
        return self.placement.device_of(k)

    def _model_service(self, stage: bool, name: str) -> dict[str, object]:
        """What a stage's and the draft's configurations share; `name`'s device."""
        c = self.config
        device = self.device_of(name)
        return dict(
            self._service(),
            dtype=c.dtype,
            threads=self.threads if stage else self.draft_threads,
            draft_activity=str(self.draft_activity) if self.draft_activity else None,
            device=device,
            **self._cache_budget(device),
            lease_seconds=c.lease_seconds,
            emulate_costs=str(self.emulate_costs) if self.emulate_costs else None,
            measure_costs=c.scheduling.needs_costs(stage),
            batch_wait=c.batch_wait,
        )

    def _stage_child(
        self,
        name: str,
        target: Path,
        layers: str,
        group: str,
        index: int | None = None,
    ) -> Child:
        """`index`: the stage's place in the pipeline (its curve of --emulate-costs)."""
        config = StageConfig(
            **self._model_service(stage=True, name=name),
            model=str(target),
            layers=layers,
            port=self._free_port(),
            data_port=self._free_port(),
            transport=self.config.transport,
            peers=(self.advertise_host,),
            emulate_stage=index if self.emulate_costs is not None else None,
            threads_with_draft=self.threads_with_draft,
        )
        return self._child(name, "stage", config, group)

    def _draft_child(self, name: str, model: Path, group: str) -> Child:
        config = DraftConfig(
            **self._model_service(stage=False, name=name),
            model=str(model),
            port=self._free_port(),
            data_port=self._free_port(),
            transport=self.config.transport,
            peers=(self.advertise_host,),
            activity_slot=self._draft_slots,
        )
        self._draft_slots += 1
        return self._child(name, "draft", config, group)

    def _router_child(self, name: str = "router") -> Child:
        """The router (`name` "router"), or another replica of it on free ports."""
        c = self.config
        first = name == "router"
        config = RouterConfig(
            **self._service(),
            target=str(self.target),
            discovery=f"file:{self.discovery_file}",
            port=(c.router_port if first else 0) or self._free_port(),
            data_port=self._free_port(),
            transport=c.transport,
            startup_timeout=c.startup_timeout,
            replay_seconds=c.replay_seconds,
            # 0: a free port picked here, like every other one
            http_port=None
            if c.http_port is None
            else (c.http_port if first else 0) or self._free_port(),
            http_metrics=c.http_metrics,
            tool_call_parser=c.tool_call_parser,
            public_tls_cert=str(c.public_tls.cert_file) if c.public_tls else None,
            public_tls_key=str(c.public_tls.key_file) if c.public_tls else None,
            api_key_files=(str(self._write_keys()),) if self.api_keys else (),
            describe_internals=True,  # every service on this host: its operator's
            scheduling=c.scheduling,
            no_control_frames=not c.control_frames,
            no_relay_prunes=not c.relay_prunes,
        )
        return self._child(name, "router", config)

    def add_routers(self, count: int = 1) -> list[Child]:
        """More router replicas over the same stages and draft (routers share them: each
        names its requests' leases with its own name and epoch), started together and
        ready. Their `info` holds their addresses ("grpc", "http")."""
        children = [self._router_child(self._free_name("router")) for _ in range(count)]
        for child in children:
            self._spawn(child)
        self._wait_ready([c.name for c in children])
        return children

    def _cache_budget(self, device: str | None = None) -> dict[str, float]:
        """A fixed budget, or an equal share of the free memory of `device` (default:
        the first service's) among the services placed on it; and the prefix cache off
        and a step's memory budget, if asked."""
        off: dict = {} if self.config.prefix_cache else {"no_prefix_cache": True}
        if self.config.step_memory_mib is not None:
            off["step_memory_mib"] = self.config.step_memory_mib
        if self.config.max_cache_gib is not None:
            return {"max_cache_gib": self.config.max_cache_gib, **off}
        device = self.placement.device_of(0) if device is None else device
        share = DEFAULT_CACHE_FRACTION / self.placement.sharing(device)
        return {"cache_fraction": round(share, 4), **off}

    def _write_keys(self) -> Path:
        """The API keys in a private file, not on the command line (ps shows that)."""
        path = self._keys_file()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{k}\n" for k in self.api_keys))
        return path

    # -- discovery -----------------------------------------------------------------------
    def write_discovery(self) -> None:
        """The router's discovery file: every listed child, `KIND HOST:PORT [GROUP]`."""
        lines = []
        for name in self.listed:
            c = self.children[name]
            lines.append(f"{c.kind} {c.info['address']} {c.group}".rstrip())
        tmp = self.discovery_file.with_name(f"{self.discovery_file.name}.tmp")
        tmp.write_text("".join(f"{line}\n" for line in lines))
        tmp.replace(self.discovery_file)

    def _list(self, name: str) -> None:
        if name not in self.listed:
            self.listed.append(name)
        self.write_discovery()

    def unlist(self, name: str) -> None:
        """Take a child out of the discovery file: the router sends it no new requests."""
        if name in self.listed:
            self.listed.remove(name)
        self.write_discovery()

    def add_stage(
        self,
        index: int,
        target: str | Path | None = None,
        layers: str | None = None,
        group: str | None = None,
        name: str | None = None,
        wait: bool = True,
    ) -> Child:
        """Start one more stage process (a replica of stage `index` of this deployment's
        layout, or `layers` of another `target`) and list it for the router at once: the
        router describes it before it takes requests."""
        r = self.ranges[index] if layers is None else None
        layers = layers or f"{r.start}:{r.end}"
        name = name or self._free_name(f"stage{index}")
        group = self.group if group is None else group
        child = self._stage_child(name, Path(target or self.target), layers, group, index=index)
        self._spawn(child)
        self._list(name)
        if wait:
            self._wait_ready([name])
        return child

    def add_draft(
        self, model: str | Path, group: str | None = None, name: str | None = None
    ) -> Child:
        name = name or self._free_name("draft")
        child = self._draft_child(name, Path(model), self.group if group is None else group)
        self._spawn(child)
        self._list(name)
        self._wait_ready([name])
        return child

    def _free_name(self, base: str) -> str:
        if base not in self.children:
            return base
        i = 1
        while f"{base}.{i}" in self.children:
            i += 1
        return f"{base}.{i}"

    def child_env(self, child: Child) -> dict[str, str]:
        """`child`'s environment before the launcher's own variables (services/
        cpu_threads.py decides what a model process's adds)."""
        return env_of(child.kind, self.env)

    def _spawn(self, child: Child) -> None:
        if self.stop_signal is not None:
            raise StopRequested(f"stopping (signal {self.stop_signal})")
        if self._parent_r < 0:
            raise LaunchError("this deployment was stopped")
        child.started_at = time.monotonic()
        env = {
            **self.child_env(child),
            PARENT_FD_ENV: str(self._parent_r),
            PARENT_GRACE_ENV: f"{self.drain_seconds + STOP_SLACK:g}",
        }
        with child.log_file.open("ab") as log:
            child.proc = subprocess.Popen(
                child.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                pass_fds=(self._parent_r,),
                start_new_session=True,  # a terminal's Ctrl-C reaches only the launcher
            )

    def start(self) -> str:
        """Start every process, wait until all are ready; returns the router address."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    @property
    def tls_dir(self) -> Path:
        return self.log_dir / "pki"

    @property
    def security(self):
        """The deployment's credentials (`security.Security`) with --secure, else None:
        what a test needs to call a stage or the draft itself."""
        if not self.secure:
            return None
        from .security import Security

        return Security.load(self.tls_dir)

    def _tls(self) -> Path:
        """The deployment's throwaway CA and certificate, made at first use."""
        from .security import make_pki

        if not (self.tls_dir / "tls.crt").is_file():
            make_pki(self.tls_dir, hosts=[self.host, "127.0.0.1", "localhost"])
        return self.tls_dir

    def build(self) -> dict[str, Child]:
        """Every child of the deployment with its command line, none started yet
        (`start` starts them; a test reads their argv)."""
        if self.children:
            return self.children
        for i, r in enumerate(self.ranges):
            for j in range(self.stage_replicas[i]):
                name = _stage_name(i, j)
                self._stage_child(name, self.target, f"{r.start}:{r.end}", self.group, index=i)
                self.listed.append(name)
        if self.draft is not None:
            self._draft_child("draft", self.draft, self.group)
            self.listed.append("draft")
        self.write_discovery()
        self._router_child()
        return self.children

    def _start(self) -> str:
        self.build()
        # All at once: the router waits for the stages itself.
        for child in self.children.values():
            self._spawn(child)
        self._wait_ready()
        self.router_address = self.children["router"].info["grpc"]
        self.http_address = self.children["router"].info.get("http", "")
        return self.router_address

    def metrics_addresses(self) -> dict[str, str]:
        """HOST:PORT of every running process's /metrics (with `metrics`)."""
        return {
            n: c.info["metrics"]
            for n, c in self.children.items()
            if "metrics" in c.info and c.proc is not None and c.proc.poll() is None
        }

    def _keys_file(self) -> Path:
        return self.log_dir / "router.api-keys"

    def _wait_ready(self, names: Sequence[str] | None = None) -> None:
        deadline = time.monotonic() + self.startup_timeout
        waiting = set(self.children if names is None else names)
        while waiting:
            if self.stop_signal is not None:
                raise StopRequested(f"stopped while starting (signal {self.stop_signal})")
            for name in list(waiting):
                child = self.children[name]
                assert child.proc is not None
                if child.proc.poll() is not None:
                    raise LaunchError(
                        f"{name} exited with code {child.proc.returncode}:\n{child.log_tail()}"
                    )
                if child.ready_file.is_file():
                    child.info.update(json.loads(child.ready_file.read_text()))
                    waiting.discard(name)
            if time.monotonic() > deadline:
                raise LaunchError(f"not ready after {self.startup_timeout:.0f}s: {sorted(waiting)}")
            time.sleep(0.05)

    # -- running -------------------------------------------------------------------------
    def dead_children(self) -> list[str]:
        return [
            n for n, c in self.children.items() if c.proc is not None and c.proc.poll() is not None
        ]

    def wait(self) -> int:
        """Foreground until a stop signal (`stop_on_signals`). A child that dies is
        reported and left dead (the router then reports itself not ready, as it would in
        a cluster); the exit code is 1 if any child died, else 0."""
        reported: set[str] = set()
        while self.stop_signal is None:
            for n in self.dead_children():
                if n not in reported:
                    reported.add(n)
                    c = self.children[n]
                    print(
                        f"{n} exited (code {c.proc.returncode}):\n{c.log_tail()}",
                        file=sys.stderr,
                        flush=True,
                    )
            time.sleep(0.1)
        return 1 if reported else 0

    def request_stop(self, signum: int) -> None:
        """A stop signal: the first makes `start` give up and `wait` return (the caller
        then `stop`s: the children drain); a second one kills every child at once."""
        if self.stop_signal is None:
            self.stop_signal = signum
            return
        self._hurry = True
        for child in self.children.values():
            if child.proc is not None and child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()

    def kill(self, name: str) -> None:
        """SIGKILL one child (tests: a stage dying mid-request)."""
        child = self.children[name]
        if child.proc is not None and child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()

    def restart(self, name: str) -> None:
        """SIGKILL one child and start it again with the same command line (ports and
        all: tests of a service restarted at its address); not waited for."""
        self.kill(name)
        child = self.children[name]
        child.ready_file.unlink(missing_ok=True)
        self._spawn(child)

    def terminate(self, name: str, wait: bool = True) -> int | None:
        """SIGTERM one child (it drains); with `wait`, its exit code."""
        child = self.children[name]
        if child.proc is None:
            return None
        if child.proc.poll() is None:
            child.proc.terminate()
        return child.proc.wait(timeout=self.drain_seconds + 30) if wait else None

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM every child at once (router first; each drains its open requests,
        and a stage or draft whose router is gone frees them within its drain lease),
        SIGKILL what is left after `grace` (default: the drain time plus STOP_SLACK) or
        at a second stop signal."""
        if grace is None:
            grace = self.drain_seconds + STOP_SLACK
        order = ["router", *[n for n in self.children if n != "router"]]
        procs = [p for n in order if n in self.children and (p := self.children[n].proc)]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in procs):
            if self._hurry or time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                for p in procs:
                    p.wait()
                break
            time.sleep(0.02)
        self._keys_file().unlink(missing_ok=True)
        if self._own_dir and os.environ.get("SPECPIPE_KEEP_LOGS") != "1":
            shutil.rmtree(self.log_dir, ignore_errors=True)
        for fd in (self._parent_r, self._parent_w):  # nothing is started after a stop
            if fd >= 0:
                os.close(fd)
        self._parent_r = self._parent_w = -1

    def __enter__(self) -> ServicesDeployment:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def stop_on_signals(dep: ServicesDeployment) -> Iterator[None]:
    """While in the foreground (starting, serving, stopping): SIGINT, SIGTERM and SIGHUP
    ask `dep` to stop (`request_stop`); a second one kills its children at once."""

    def handler(signum, frame) -> None:
        dep.request_stop(signum)

    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def watch_parent() -> None:
    """In a child of `ServicesDeployment` (its environment names the pipe; nothing
    otherwise): when the launcher is gone, stop as its `stop` would have stopped this
    process, SIGTERM (the drain), then SIGKILL after the grace it was given."""
    fd_text = os.environ.pop(PARENT_FD_ENV, None)
    grace = float(os.environ.pop(PARENT_GRACE_ENV, None) or STOP_SLACK)
    if fd_text is None:
        return
    fd = int(fd_text)
    os.set_inheritable(fd, False)  # not into this process's own children

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(fd, 1):  # nobody writes: returns b"" once the launcher is gone
                pass
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
