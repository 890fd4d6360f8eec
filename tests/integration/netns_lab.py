"""Hosts as network namespaces, for tests that must run services as on separate machines
(issue 35, point 7): each host is a namespace with its own address on one private /24,
joined by veth pairs to a bridge in a switch namespace, as machines on one LAN; the test
process (the client) joins the LAN through one more veth pair. Nothing is routed beyond
the /24, so no traffic leaves the machine. Faults: a host's link taken down and brought
back (its bridge port), and a partition between two hosts that leaves both reachable by
everyone else (blackhole routes on both sides).

Needs root and `ip netns` (iproute2); `skip_reason()` says why a test cannot run here.
Everything a `Lab` creates is named with a random tag and removed by `close()`.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from specpipe.services.config import DraftConfig, RouterConfig, ServiceConfig, StageConfig
from specpipe.services.launcher import PARENT_FD_ENV, PARENT_GRACE_ENV, Child


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def skip_reason() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"spprobe{secrets.token_hex(3)}"
    try:
        made = ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"`ip netns add` failed: {made.stderr.strip()}"
        veth = ip("-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0",
                  check=False)  # fmt: skip
        if veth.returncode != 0:
            return f"no veth pairs: {veth.stderr.strip()}"
    finally:
        ip("netns", "del", probe, check=False)
    return None


NS_PREFIX = "specpipe-lab-"  # then the creating process's id: `sweep` finds leftovers


def sweep() -> None:
    """Remove the namespaces of labs whose process is gone (killed before `close`);
    their veth pairs go with them."""
    for line in ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(NS_PREFIX):
            continue
        pid = name[len(NS_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            ip("netns", "del", name, check=False)


@dataclass
class Host:
    name: str
    ns: str  # the namespace ("" : the test process's own, the client)
    address: str
    port: str  # its veth end on the bridge (in the switch namespace)


@dataclass
class Service:
    """A service process on a host (`child`: its process, log and ready file)."""

    host: Host
    child: Child
    port: int

    @property
    def kind(self) -> str:
        return self.child.kind

    @property
    def address(self) -> str:
        return f"{self.host.address}:{self.port}"


class Lab:
    """Hosts `names` on one private LAN, plus the client (this process, `.client`)."""

    def __init__(self, names: list[str], workdir: Path) -> None:
        sweep()
        self.tag = secrets.token_hex(2)
        self.workdir = workdir
        self.subnet = self._free_subnet()
        addresses = [str(a) for a in self.subnet.hosts()]
        ns = f"{NS_PREFIX}{os.getpid()}-{self.tag}"
        self.switch = f"{ns}-switch"
        self.client = Host("client", "", addresses[0], f"p{self.tag}c")
        self.hosts = {
            n: Host(n, f"{ns}-{i}", addresses[i + 1], f"p{self.tag}{i}")
            for i, n in enumerate(names)
        }
        self._client_link = f"sp{self.tag}c"
        self.services: list[Service] = []
        self._parent_r, self._parent_w = os.pipe()
        self._made: list[str] = []  # namespaces created
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _free_subnet() -> ipaddress.IPv4Network:
        """A 10.x.y.0/24 no route of this machine covers."""
        routes = ip("-4", "route", "show", "table", "all").stdout
        taken = [ipaddress.ip_network(w, strict=False) for line in routes.splitlines()
                 for w in line.split()[:1] if "/" in w]  # fmt: skip
        for _ in range(100):
            net = ipaddress.ip_network(
                f"10.{random.randrange(100, 250)}.{random.randrange(256)}.0/24"
            )
            if not any(net.overlaps(t) for t in taken):
                return net
        raise RuntimeError("no free 10.x.y.0/24")

    def _build(self) -> None:
        prefix = self.subnet.prefixlen
        ip("netns", "add", self.switch)
        self._made.append(self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for h in self.hosts.values():
            ip("netns", "add", h.ns)
            self._made.append(h.ns)
            ip("-n", h.ns, "link", "set", "lo", "up")
            ip("link", "add", "name", f"e{self.tag}", "netns", h.ns, "type", "veth", "peer",
               "name", h.port, "netns", self.switch)  # fmt: skip
            ip("-n", h.ns, "link", "set", f"e{self.tag}", "name", "eth0")
            ip("-n", h.ns, "addr", "add", f"{h.address}/{prefix}", "dev", "eth0")
            ip("-n", h.ns, "link", "set", "eth0", "up")
            ip("-n", self.switch, "link", "set", h.port, "master", "br0", "up")
        c = self.client
        ip("link", "add", "name", self._client_link, "type", "veth", "peer", "name", c.port,
           "netns", self.switch)  # fmt: skip
        ip("addr", "add", f"{c.address}/{prefix}", "dev", self._client_link)
        ip("link", "set", self._client_link, "up")
        ip("-n", self.switch, "link", "set", c.port, "master", "br0", "up")

    # -- faults ----------------------------------------------------------------------------
    def link(self, host: str, up: bool) -> None:
        """Take `host`'s link down (its packets are lost, as a pulled cable's) or back up."""
        ip("-n", self.switch, "link", "set", self.hosts[host].port, "up" if up else "down")

    def partition(self, a: str, b: str, on: bool = True) -> None:
        """Cut (or, `on` False, heal) the path between hosts `a` and `b` only: each drops
        what it sends the other; both still reach every other host."""
        verb = "add" if on else "del"
        for x, y in ((a, b), (b, a)):
            hx, hy = self.hosts[x], self.hosts[y]
            ip("-n", hx.ns, "route", verb, "blackhole", f"{hy.address}/32")

    # -- services --------------------------------------------------------------------------
    def start(self, host: str, kind: str, config: ServiceConfig) -> Service:
        """Run `specpipe <kind>` with `config` inside `host`'s namespace (its log and
        ready file in the lab's directory); wait for it with `wait_ready`."""
        h = self.hosts[host]
        name = f"{host}-{kind}"
        ready, log = self.workdir / f"{name}.ready", self.workdir / f"{name}.log"
        ready.unlink(missing_ok=True)
        config = replace(config, ready_file=str(ready))
        argv = ["ip", "netns", "exec", h.ns, sys.executable, "-m", "specpipe.cli", kind,
                *config.argv()]  # fmt: skip
        env = {**os.environ, PARENT_FD_ENV: str(self._parent_r), PARENT_GRACE_ENV: "5"}
        child = Child(name, argv, ready, log, kind=kind)
        with log.open("ab") as f:
            child.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env,
                                          pass_fds=(self._parent_r,), start_new_session=True)  # fmt: skip
        svc = Service(h, child, config.port)
        self.services.append(svc)
        return svc

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        for svc in self.services:
            c = svc.child
            while not c.ready_file.is_file():
                if c.proc.poll() is not None:
                    raise RuntimeError(f"{c.name} exited:\n{c.log_tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{c.name} not ready:\n{c.log_tail()}")
                time.sleep(0.05)
            c.info = json.loads(c.ready_file.read_text())

    def close(self) -> None:
        """Stop every service (SIGTERM, then SIGKILL), remove every namespace and link."""
        procs = [svc.child.proc for svc in self.services]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for fd in (self._parent_r, self._parent_w):
            if fd >= 0:
                os.close(fd)
        self._parent_r = self._parent_w = -1
        ip("link", "del", self._client_link, check=False)
        for ns in reversed(self._made):
            ip("netns", "del", ns, check=False)
        self._made = []


def stage_config(lab: Lab, host: str, model: Path, layers: str, **kw) -> StageConfig:
    """A stage bound to its host's address, sending hidden states only within the lab's
    LAN (`--peers` its /24)."""
    a = lab.hosts[host].address
    return StageConfig(host=a, advertise_host=a, port=50052, data_port=50053, model=str(model),
                       layers=layers, transport="tcp", peers=(str(lab.subnet),), **kw)  # fmt: skip


def draft_config(lab: Lab, host: str, model: Path, **kw) -> DraftConfig:
    a = lab.hosts[host].address
    return DraftConfig(host=a, advertise_host=a, port=50060, model=str(model), **kw)


def router_config(lab: Lab, host: str, discovery: Path, **kw) -> RouterConfig:
    a = lab.hosts[host].address
    return RouterConfig(host=a, advertise_host=a, port=50051, data_port=50055,
                        discovery=f"file:{discovery}", transport="tcp", **kw)  # fmt: skip
