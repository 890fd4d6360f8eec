"""The chart's default pods as container_e2e.py would give them to `docker run`, run as
local processes instead (no Docker engine needed): scripts/container_e2e.py's one-host
rewrites checked on every machine, and the chart's secure defaults (mutual TLS with the
Secret the chart renders) seen working together."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(
        "container_e2e", ROOT / "scripts" / "container_e2e.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("container_e2e", module)  # dataclass-free, but annotations resolve
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(600)
def test_the_charts_secure_pods_serve_together_on_one_host(helm, tmp_path):
    """What container_e2e.py gives `docker run`, without Docker: the chart's default pods
    (mutual TLS with the Secret the chart renders, the probes' ports, the router's
    discovery) with the script's one-host rewrites, run as local processes with the
    volumes' host paths. They come up, a stage refuses a caller without the deployment's
    certificate, a request goes through, and SIGTERM stops each with exit 0."""
    import signal
    import sys
    import time

    import grpc
    from specpipe.v1 import dataplane_pb2, stage_pb2_grpc

    from specpipe.client import Client

    e2e = _script()
    models, secrets_dir = tmp_path / "models", tmp_path / "secrets"
    models.mkdir()
    e2e.make_models(models, 4)
    docs = e2e.render("specpipe:e2e", 2, 4, 30)
    secrets = e2e.write_secrets(docs, secrets_dir)
    pods = [e2e.Pod(d) for d in docs if d["kind"] in ("StatefulSet", "Deployment")]
    assert sorted(p.component for p in pods) == ["draft", "router", "stage", "stage"]
    ports = [port for p in pods for port in p.host_ports.values()]
    assert len(ports) == len(set(ports))  # one host: every listening port distinct
    (models / "backends").write_text(e2e.discovery_lines(pods))
    procs = []
    try:
        for pod in sorted(pods, key=lambda p: p.component == "router"):
            argv = pod.host_args({})
            assert "--secure" in argv and argv[argv.index("--tls-dir") + 1] == "/etc/specpipe/tls"
            mounts = pod.mounts(pod.main, models, secrets)
            assert mounts["/etc/specpipe/tls"] == secrets["specpipe-internal-tls"]
            docker = pod.docker_args(pod.main, "t", models, "n", secrets)
            assert f"{secrets['specpipe-internal-tls']}:/etc/specpipe/tls:ro" in docker
            for inside, outside in sorted(mounts.items(), key=lambda m: -len(m[0])):
                argv = [a.replace(inside, str(outside)) for a in argv]
            env = {**os.environ, "SPECPIPE_MODEL_CACHE": str(models)}
            log = (tmp_path / f"{pod.name}.log").open("wb")
            procs.append((pod, subprocess.Popen(
                [sys.executable, "-m", "specpipe.cli", *argv], stdout=log, stderr=subprocess.STDOUT, env=env
            )))  # fmt: skip
        deadline = time.monotonic() + 300
        for pod, proc in procs:
            while e2e.probe_passes(pod) != "SERVING":
                assert proc.poll() is None, (tmp_path / f"{pod.name}.log").read_text()[-3000:]
                assert time.monotonic() < deadline, f"{pod.name} not ready"
                time.sleep(0.2)
        stage = next(p for p in pods if p.component == "stage")
        with (
            grpc.insecure_channel(f"{e2e.HOST}:{stage.host_port}") as ch,
            pytest.raises(grpc.RpcError) as info,
        ):
            stage_pb2_grpc.StageStub(ch).Describe(dataplane_pb2.DescribeRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        router = next(p for p in pods if p.component == "router")
        with Client(f"{e2e.HOST}:{router.host_port}", timeout=120) as c:
            done = c.generate(prompt_ids=[5, 17, 42], max_new_tokens=8, ignore_eos=True)
        assert len(done.token_ids) == 8 and done.stats["stages"] == 2
        for _, proc in procs:
            proc.send_signal(signal.SIGTERM)
        assert [proc.wait(timeout=60) for _, proc in procs] == [0, 0, 0, 0]
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_stage_pool_pods_get_the_same_one_host_rewrites(helm):
    """container_e2e.py with stage pools (`--stage-pools 0:2,2:4,2:4`): every pool's pod
    is a stage container of its own, with its own ports, its layers, and a line in the
    router's discovery file (two replicas of 2:4 for the router to choose from)."""
    e2e = _script()
    docs = e2e.render("specpipe:e2e", 2, 4, 30, ["0:2", "2:4", "2:4"])
    pods = [e2e.Pod(d) for d in docs if d["kind"] in ("StatefulSet", "Deployment")]
    stages = sorted((p for p in pods if p.component == "stage"), key=lambda p: p.name)
    assert [(p.name, p.arg("--layers")) for p in stages] == [
        ("specpipe-e2e-pool-0", "0:2"),
        ("specpipe-e2e-pool-1", "2:4"),
        ("specpipe-e2e-pool-2", "2:4"),
    ]
    ports = [port for p in pods for port in p.host_ports.values()]
    assert len(ports) == len(set(ports))
    lines = e2e.discovery_lines(pods).splitlines()
    assert sorted(line.split()[0] for line in lines) == ["draft", "stage", "stage", "stage"]
    for pod in stages:
        assert f"stage {e2e.HOST}:{pod.host_port} e2e" in lines
        argv = pod.host_args({})
        assert argv[argv.index("--port") + 1] == str(pod.host_port)
        assert argv[argv.index("--host") + 1] == e2e.HOST
