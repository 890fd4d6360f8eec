"""The deployment in Docker containers, end to end (scripts/container_e2e.sh runs this
after it has a Docker engine and the image).

What it does, as a kubelet would with the chart's pods, on one host:
  1. makes a tiny random target and draft (with a character tokenizer) in a directory
     that is mounted at the image's SPECPIPE_MODEL_CACHE (/models) in every container;
  2. renders helm/specpipe (pinned helm) for those models, and runs each pod's init and
     main container with the chart's own arguments, environment, volumes, user and
     security settings (the chart's defaults: mutual TLS among the services with the TLS
     Secret the chart renders, mounted read only as the kubelet would), `docker run
     --network host` with the image's entrypoint. The only rewrites are the ones one host
     instead of a pod network and an API server needs: `--host 0.0.0.0` becomes
     127.0.0.1 (loopback only), `$(POD_IP)` and `--peers` 127.0.0.1, every port flag (`--port`,
     `--data-port`, `--health-port`, `--metrics-port`, `--http-port`) a distinct free
     port, the router's `--discovery kubernetes` a discovery file listing the stage and
     draft containers (`file:/models/backends`; static `--stages`/`--draft` DNS names
     become those addresses);
  3. waits for each container's readiness probe (gRPC health or HTTP GET on the probe's
     port), one after the other, and records start-to-ready;
  4. sends requests from the host with `specpipe client generate --json` and checks the
     tokens against the in-process engine (`specpipe generate --json`);
  5. opens long streams, stops the last stage's container with `docker stop` (SIGTERM)
     while they run, and checks that they finish with the right tokens, that the router
     refuses new requests meanwhile (UNAVAILABLE), and that the stage exits 0 after them;
  6. stops every container (SIGTERM, router first), checks they exit 0, removes them.

Prints a JSON report on stdout; exit code 0 only if every check passed.

One module: one end-to-end script whose steps share the containers it started.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"


def log(msg: str) -> None:
    print(f"[container_e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Failed(Exception):
    pass


def check(ok: bool, what: str, failures: list[str]) -> bool:
    log(("ok: " if ok else "FAILED: ") + what)
    if not ok:
        failures.append(what)
    return ok


def run(cmd: list[str], timeout: float = 600, check: bool = True) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise Failed(f"{shlex.join(cmd)} exited {res.returncode}:\n{res.stderr[-3000:]}")
    return res.stdout


_handed_out: set[int] = set()  # the kernel may give a released port to the next bind


def free_port() -> int:
    """A port free now that this script has not handed out before (pods share one host)."""
    while True:
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


# -- models ------------------------------------------------------------------------------------
def make_models(models: Path, layers: int) -> None:
    """A tiny random Llama target and an unrelated smaller draft (same 97-id vocabulary),
    with a character tokenizer, as the tests make them (tests/conftest.py)."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<s>": 0, **{chr(c): c - 31 for c in range(32, 127)}, "</s>": 96}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    for name, n, seed in (("target", layers, 0), ("draft", 2, 1)):
        torch.manual_seed(seed)
        cfg = LlamaConfig(
            vocab_size=97,
            hidden_size=48,
            intermediate_size=90,
            num_hidden_layers=n,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            initializer_range=0.6,
            eos_token_id=96,
            bos_token_id=0,
        )
        LlamaForCausalLM(cfg).eval().save_pretrained(models / name)
        fast.save_pretrained(models / name)


# -- the chart's pods --------------------------------------------------------------------------
def render(
    image: str, stages: int, layers: int, drain: int, pools: list[str] | None = None
) -> list[dict]:
    """The chart's manifests for the tiny models; `pools`: layer ranges of stage pools
    (stagePools, one pod each) instead of `stages` even stages."""
    spec = importlib.util.spec_from_file_location("k8s_tools", ROOT / "scripts" / "k8s_tools.py")
    k8s_tools = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(k8s_tools)
    repo, _, tag = image.rpartition(":")
    values = {
        "image": {"repository": repo, "tag": tag, "pullPolicy": "Never"},
        "model": {
            "version": "e2e",
            "target": "/models/target",
            "draft": "/models/draft",
            "numLayers": layers,
            "stages": stages,
            "dtype": "float64",
        },
        "stage": {"threads": 1, "drainSeconds": drain},
        "draft": {"threads": 1, "drainSeconds": drain},
        "router": {"drainSeconds": drain, "startupTimeoutSeconds": 300},
    }
    if pools:
        values["stagePools"] = [
            {"name": f"pool-{i}", "layers": r, "replicas": 1, "autoscaling": {"enabled": False}}
            for i, r in enumerate(pools)
        ]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(values, f)
        f.flush()
        out = run(
            [
                str(k8s_tools.binary("helm")),
                "template",
                "specpipe",
                str(ROOT / "helm" / "specpipe"),
                "-f",
                f.name,
                "--skip-tests",
            ]
        )
    return [d for d in yaml.safe_load_all(out) if d]


def arg(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


# The flags that give a service a port to listen on: each gets a free one on this host.
PORT_FLAGS = ("--port", "--data-port", "--health-port", "--metrics-port", "--http-port")
# Where the router's discovery file is, inside the containers (the model volume).
DISCOVERY_FILE = "/models/backends"


def write_secrets(docs: list[dict], out: Path) -> dict[str, Path]:
    """The Secrets the chart renders (the internal TLS one by default), each as a
    directory of its entries (what a secret volume shows a pod); name -> directory."""
    import base64

    dirs = {}
    for d in docs:
        if d["kind"] != "Secret":
            continue
        path = out / d["metadata"]["name"]
        path.mkdir(parents=True)
        for key, value in (d.get("data") or {}).items():
            (path / key).write_bytes(base64.b64decode(value))
            (path / key).chmod(0o440)
        dirs[d["metadata"]["name"]] = path
    return dirs


def discovery_lines(pods: list[Pod]) -> str:
    """The router's discovery file: every stage and draft container, with its model
    version (what the EndpointSlices' labels say in a cluster)."""
    lines = [
        f"{pod.component} {HOST}:{pod.host_port} {pod.version}".rstrip()
        for pod in pods
        if pod.component in ("stage", "draft")
    ]
    return "".join(f"{line}\n" for line in lines)


class Pod:
    """One workload's pod, as `docker run` arguments."""

    def __init__(self, doc: dict) -> None:
        tmpl = doc["spec"]["template"]
        labels = tmpl["metadata"]["labels"]
        self.component = labels["app.kubernetes.io/component"]
        self.version = labels.get("specpipe.dev/model-version", "")
        self.name = doc["metadata"]["name"]
        self.pod_name = f"{self.name}-0" if doc["kind"] == "StatefulSet" else self.name
        self.service = doc["spec"].get("serviceName")
        self.spec = tmpl["spec"]
        (self.main,) = self.spec["containers"]
        self.grace = int(self.spec["terminationGracePeriodSeconds"])
        self.args = list(self.main["args"])
        self.port = int(self.arg("--port"))
        self.host_ports = {f: free_port() for f in PORT_FLAGS if f in self.args}
        self.host_port = self.host_ports["--port"]
        self.host_data_port = self.host_ports.get("--data-port")
        self.probe = self._probe()
        self.container = ""

    def _probe(self) -> tuple[str, int, str]:
        """The readiness probe as (grpc|http|https, host port, path): it must check a port
        the command listens on."""
        named = {p["name"]: p["containerPort"] for p in self.main.get("ports", [])}
        probe = self.main["readinessProbe"]
        if "grpc" in probe:
            kind, port, path = "grpc", probe["grpc"]["port"], ""
        else:
            get = probe["httpGet"]
            kind, port, path = get.get("scheme", "HTTP").lower(), get["port"], get["path"]
        port = int(named.get(port, port))
        flags = [f for f in self.host_ports if int(self.arg(f)) == port]
        if not flags:
            raise Failed(
                f"{self.name}: readiness probe on {port}, which the command does not listen on"
            )
        return kind, self.host_ports[flags[0]], path

    def arg(self, flag: str) -> str | None:
        return arg(self.args, flag)

    def host_args(self, addresses: dict[str, str]) -> list[str]:
        """The chart's arguments for one host: loopback, distinct ports, host addresses."""
        a = list(self.args)

        def put(flag: str, value: str) -> None:
            a[a.index(flag) + 1] = value

        if arg(a, "--host") == "0.0.0.0":
            put("--host", HOST)
        if arg(a, "--peers") is not None:  # the pod network is loopback here
            put("--peers", HOST)
        for flag, port in self.host_ports.items():
            put(flag, str(port))
        for flag in ("--stages", "--draft"):
            if arg(a, flag) is not None:
                put(flag, ",".join(addresses[x] for x in arg(a, flag).split(",")))
        if arg(a, "--discovery") == "kubernetes":  # no API server here: a discovery file
            put("--discovery", f"file:{DISCOVERY_FILE}")
            for flag in ("--discovery-selector", "--discovery-namespace"):
                if flag in a:
                    del a[a.index(flag) : a.index(flag) + 2]
        return [x.replace("$(POD_IP)", HOST).replace("$(POD_NAME)", self.pod_name) for x in a]

    def mounts(self, container: dict, models: Path, secrets: dict[str, Path]) -> dict[str, Path]:
        """The container's bind mounts, container path -> host path: the model volume and
        the Secrets' directories (read only); tmpfs and shm volumes are not mounts."""
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        out = {}
        for m in container.get("volumeMounts", []):
            v = volumes[m["name"]]
            if m["name"] == "model-cache":
                out[m["mountPath"]] = models
            elif "secret" in v:
                name = v["secret"]["secretName"]
                if name not in secrets:
                    raise Failed(f"{self.name}: Secret {name} is not rendered by the chart")
                out[m["mountPath"]] = secrets[name]
        return out

    def docker_args(
        self, container: dict, run_id: str, models: Path, name: str, secrets: dict[str, Path]
    ) -> list[str]:
        ctx = self.spec.get("securityContext", {})
        sec = container.get("securityContext", {})
        cmd = [
            "docker",
            "run",
            "-d",
            "--name",
            name,
            "--label",
            f"specpipe-e2e={run_id}",
            "--network",
            "host",
            "--user",
            f"{ctx['runAsUser']}:{ctx['runAsGroup']}",
        ]
        if sec.get("readOnlyRootFilesystem"):
            cmd.append("--read-only")
        if "ALL" in sec.get("capabilities", {}).get("drop", []):
            cmd += ["--cap-drop", "ALL"]
        if sec.get("allowPrivilegeEscalation") is False:
            cmd += ["--security-opt", "no-new-privileges"]
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        binds = self.mounts(container, models, secrets)
        for m in container.get("volumeMounts", []):
            v = volumes[m["name"]]
            if m["mountPath"] in binds:
                ro = ":ro" if m.get("readOnly") else ""
                cmd += ["-v", f"{binds[m['mountPath']]}:{m['mountPath']}{ro}"]
            elif v.get("emptyDir", {}).get("medium") == "Memory" and m["mountPath"] == "/dev/shm":
                cmd += [
                    "--shm-size",
                    str(v["emptyDir"].get("sizeLimit", "64Mi"))
                    .replace("Gi", "g")
                    .replace("Mi", "m"),
                ]
            elif "emptyDir" in v:
                cmd += ["--tmpfs", f"{m['mountPath']}:mode=1777"]
            else:
                raise Failed(f"{self.name}: volume {m['name']} not handled")
        for e in container.get("env", []):
            if "value" in e:
                cmd += ["-e", f"{e['name']}={e['value']}"]
            elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
                cmd += ["-e", f"{e['name']}={HOST}"]
            elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
                cmd += ["-e", f"{e['name']}={name}"]
        if "command" in container:  # the chart relies on the image's entrypoint
            raise Failed(f"{self.name}: sets command {container['command']}")
        return cmd


def health(port: int, timeout: float = 2.0) -> str:
    """The kubelet's gRPC probe: grpc.health.v1 Check of service "" on 127.0.0.1:port."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"{HOST}:{port}") as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def probe_passes(pod: Pod) -> str:
    """The pod's readiness probe, as the kubelet runs it: SERVING (gRPC) or HTTP 200."""
    kind, port, path = pod.probe
    if kind == "grpc":
        return health(port)
    import ssl
    import urllib.error
    import urllib.request

    ctx = ssl._create_unverified_context() if kind == "https" else None  # the kubelet's way
    try:
        with urllib.request.urlopen(f"{kind}://{HOST}:{port}{path}", timeout=2, context=ctx) as r:
            return "SERVING" if r.status == 200 else f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except OSError as e:
        return repr(e)


def docker_logs(container: str) -> str:
    res = subprocess.run(["docker", "logs", container], capture_output=True, text=True)
    return res.stdout + res.stderr


def state(container: str) -> dict:
    return json.loads(run(["docker", "inspect", "-f", "{{json .State}}", container]))


def docker_time(text: str) -> float:
    """Docker's RFC 3339 timestamps (nanoseconds, Z) as a Unix time."""
    text = re.sub(r"(\.\d{6})\d*", r"\1", text).replace("Z", "+00:00")
    return datetime.fromisoformat(text).timestamp()


# -- references and requests ------------------------------------------------------------------
def cli(*args: str) -> dict:
    out = run([sys.executable, "-m", "specpipe.cli", *args], timeout=600)
    return json.loads(out.strip().splitlines()[-1])


CASES = [
    ("specpipe, prompt ids", ["--prompt-ids", "5,17,42,8,3", "--mode", "specpipe"]),
    ("pp", ["--prompt-ids", "5,17,42,8,3", "--mode", "pp"]),
    ("specinfer", ["--prompt-ids", "11,12,13", "--mode", "specinfer"]),
    ("autoregressive", ["--prompt-ids", "11,12,13", "--mode", "autoregressive"]),
    ("text prompt", ["--prompt", "def fib(n):", "--mode", "specpipe"]),
    ("sampled", ["--prompt-ids", "7,7,7", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3"]),
]
DRAIN_PROMPTS = [[3, 1, 4, 1, 5], [2, 7, 1, 8], [9, 9, 8]]


def references(models: Path, args) -> tuple[dict[str, dict], list[list[int]]]:
    """`specpipe generate --json` (the engine in one process) for every case and every
    drained stream."""
    common = ["--target", str(models / "target"), "--draft", str(models / "draft")]
    common += ["--stages", str(args.stages), "--dtype", "float64", "--json"]
    t = time.monotonic()
    refs = {
        n: cli("generate", *common, *a, "--max-new-tokens", str(args.max_new_tokens))
        for n, a in CASES
    }
    drained = [
        cli(
            "generate",
            *common,
            "--prompt-ids",
            ",".join(map(str, ids)),
            "--max-new-tokens",
            str(args.drain_tokens),
            "--ignore-eos",
        )["token_ids"]
        for ids in DRAIN_PROMPTS
    ]
    log(f"in-process references: {len(refs) + len(drained)} in {time.monotonic() - t:.1f} s")
    return refs, drained


def start(pod: Pod, addresses: dict[str, str], models: Path, args) -> dict[str, float]:
    """Run the pod's init containers to completion, then its service until the readiness
    probe's check passes; returns the seconds until `docker run` returned and until ready."""
    for i, init in enumerate(pod.spec.get("initContainers", [])):
        name = f"specpipe-e2e-{args.run_id}-{pod.name}-init{i}"
        log(f"{pod.name}: init container {init['name']}: specpipe {shlex.join(init['args'])}")
        docker = pod.docker_args(init, args.run_id, models, name, args.secrets)
        run([*docker, args.image, *init["args"]])
        run(["docker", "wait", name], timeout=3600)
        if state(name)["ExitCode"] != 0:
            raise Failed(f"{name} failed:\n{docker_logs(name)[-3000:]}")
    name = pod.container = f"specpipe-e2e-{args.run_id}-{pod.name}"
    argv = pod.host_args(addresses)
    log(f"{pod.name}: specpipe {shlex.join(argv)}")
    t0 = time.monotonic()
    run([*pod.docker_args(pod.main, args.run_id, models, name, args.secrets), args.image, *argv])
    t_run = time.monotonic() - t0
    while (status := probe_passes(pod)) != "SERVING":
        if not state(name)["Running"]:
            raise Failed(f"{name} exited:\n{docker_logs(name)[-3000:]}")
        if time.monotonic() - t0 > 600:
            raise Failed(f"{name}: not ready after 600 s (health {status})")
        time.sleep(0.2)
    ready = time.monotonic() - t0
    log(f"{pod.name}: ready in {ready:.1f} s (docker run returned after {t_run:.1f} s)")
    return {"docker_run": round(t_run, 1), "ready": round(ready, 1)}


def check_requests(router: str, refs: dict[str, dict], args, failures: list[str]) -> dict:
    """`specpipe client generate --json` from the host against the in-process results."""
    out = {}
    for n, a in CASES:
        got = cli(
            "client",
            "generate",
            "--router",
            router,
            *a,
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--timeout",
            "300",
            "--json",
        )
        same = got["token_ids"] == refs[n]["token_ids"] and got["text"] == refs[n]["text"]
        out[n] = {
            "tokens": len(got["token_ids"]),
            "same": same,
            "tokens_per_step": got["stats"].get("tokens_per_step"),
        }
        check(
            same,
            f"{n}: {len(got['token_ids'])} tokens through the containers == in-process",
            failures,
        )
    return out


def check_drain(router: Pod, victim: Pod, refs: list[list[int]], args, failures: list[str]) -> dict:
    """Open streams, `docker stop` one stage while they run: they must finish with the
    right tokens, new requests meanwhile are refused, and the stage exits 0 after them."""
    from specpipe.client import Client, SpecPipeError

    address = f"{HOST}:{router.host_port}"
    first = [threading.Event() for _ in DRAIN_PROMPTS]
    results: list[dict] = [{} for _ in DRAIN_PROMPTS]
    counts = [0 for _ in DRAIN_PROMPTS]

    def consume(i: int) -> None:
        try:
            with Client(address, timeout=600) as c:
                stream = c.stream(
                    prompt_ids=DRAIN_PROMPTS[i], max_new_tokens=args.drain_tokens, ignore_eos=True
                )
                for chunk in stream:
                    counts[i] += len(chunk.token_ids)
                    first[i].set()
                results[i] = {"tokens": stream.result().token_ids, "finished": time.time()}
        except Exception as e:
            results[i] = {"error": repr(e), "finished": time.time()}
        finally:
            first[i].set()

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(DRAIN_PROMPTS))]
    for th in threads:
        th.start()
    for ev in first:
        ev.wait(300)
    t_stop, at_sigterm = time.time(), list(counts)
    log(f"docker stop -t {victim.grace} {victim.container}, {len(threads)} streams open")
    stopper = concurrent.futures.ThreadPoolExecutor(1).submit(
        run, ["docker", "stop", "-t", str(victim.grace), victim.container], victim.grace + 60
    )
    deadline = time.monotonic() + 10  # the router checks stage health every 0.5 s
    while health(router.host_port) == "SERVING" and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        with Client(address, timeout=30) as c:
            c.generate(prompt_ids=[1, 2, 3], max_new_tokens=4)
        refused = "accepted"
    except SpecPipeError as e:
        refused = e.code_name
    t_refused = time.time()
    for th in threads:
        th.join(600)
    stopper.result()
    stop_s = time.time() - t_stop
    st = state(victim.container)
    exited = docker_time(st["FinishedAt"])
    finish = [r["finished"] for r in results]
    streamed = all(r.get("tokens") == ref for r, ref in zip(results, refs, strict=True))
    errors = [r["error"] for r in results if "error" in r] or "no errors"
    check(
        streamed,
        f"drain: {len(results)} open streams of {args.drain_tokens} tokens finished == in-process ({errors})",
        failures,
    )
    check(
        all(n < args.drain_tokens for n in at_sigterm) and t_refused < max(finish),
        f"drain: the streams were open when the stage got SIGTERM ({at_sigterm} tokens of "
        f"{args.drain_tokens}; the last finished {max(finish) - t_stop:.1f} s later)",
        failures,
    )
    check(
        streamed
        and st["ExitCode"] == 0
        and not st["OOMKilled"]
        and exited >= max(finish) - 0.5
        and stop_s < victim.grace,
        f"drain: the stage exited {st['ExitCode']} after the streams, {stop_s:.1f} s after "
        f"SIGTERM (grace {victim.grace} s: no SIGKILL)",
        failures,
    )
    check(
        "draining" in docker_logs(victim.container), "drain: the stage logged its drain", failures
    )
    check(refused == "UNAVAILABLE", f"drain: a new request meanwhile was {refused}", failures)
    return {
        "streams": len(results),
        "tokens_each": args.drain_tokens,
        "tokens_before_sigterm": at_sigterm,
        "streams_finished_after_sigterm_s": [round(f - t_stop, 2) for f in finish],
        "stage_exited_after_sigterm_s": round(exited - t_stop, 2),
        "docker_stop_s": round(stop_s, 1),
        "stage_exit_code": st["ExitCode"],
        "new_request_while_draining": refused,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image", required=True)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the tiny target")
    p.add_argument(
        "--stage-pools",
        default="",
        help="stage pools' layer ranges, one chain (e.g. 0:2,2:4,2:4: two replicas of 2:4 "
        "in pools of their own) instead of --stages even stages",
    )
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--drain-tokens", type=int, default=160, help="length of the drained streams")
    p.add_argument("--drain-seconds", type=int, default=60)
    p.add_argument("--work", type=Path, required=True, help="scratch directory (models)")
    p.add_argument("--run-id", required=True, help="label value of every container")
    args = p.parse_args()
    started = time.monotonic()
    failures: list[str] = []

    models = args.work / "models"
    models.mkdir(parents=True)
    make_models(models, args.layers)
    pools = [r for r in args.stage_pools.split(",") if r]
    if pools:  # the pipeline's stages: the distinct ranges (the references' --stages)
        args.stages = len(set(pools))
    report: dict = {"image": args.image, "stages": args.stages, "stage_pools": pools}
    docs = render(args.image, args.stages, args.layers, args.drain_seconds, pools)
    args.secrets = write_secrets(docs, args.work / "secrets")
    order = {"stage": 0, "draft": 1, "router": 2}
    pods = [Pod(d) for d in docs if d["kind"] in ("StatefulSet", "Deployment")]
    pods.sort(key=lambda x: (order[x.component], x.name))
    (models / Path(DISCOVERY_FILE).name).write_text(discovery_lines(pods))
    # The chart's fsGroup makes the volumes the pods' (10001, the image's user).
    run(["chown", "-R", "10001:10001", str(models), str(args.work / "secrets")])
    addresses: dict[str, str] = {}
    for pod in pods:
        if pod.service:  # a stage pod's DNS name: <pod>.<headless service>:<port>
            addresses[f"{pod.pod_name}.{pod.service}:{pod.port}"] = f"{HOST}:{pod.host_port}"
        else:  # the draft's and router's ClusterIP Service names
            addresses[f"{pod.name}:{pod.port}"] = f"{HOST}:{pod.host_port}"

    refs, drain_refs = references(models, args)  # first: nothing else running
    # One pod after another, so that each start-to-ready is its own.
    report["start_to_ready_s"] = {pod.name: start(pod, addresses, models, args) for pod in pods}
    router = next(x for x in pods if x.component == "router")
    report["cases"] = check_requests(f"{HOST}:{router.host_port}", refs, args, failures)
    victim = [x for x in pods if x.component == "stage"][-1]
    report["drain"] = check_drain(router, victim, drain_refs, args, failures)

    # Stop the rest, router first (as `specpipe up` does); each must exit 0.
    for pod in [router, *[x for x in pods if x is not router and x is not victim]]:
        t = time.monotonic()
        run(["docker", "stop", "-t", str(pod.grace), pod.container], timeout=pod.grace + 60)
        code = state(pod.container)["ExitCode"]
        check(
            code == 0,
            f"{pod.name}: docker stop -> exit {code} in {time.monotonic() - t:.1f} s",
            failures,
        )
    report["failures"] = failures
    report["e2e_seconds"] = round(time.monotonic() - started, 1)
    report["result"] = "passed" if not failures else "FAILED"
    print(json.dumps(report, indent=1))
    return 0 if not failures else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failed as e:
        log(f"FAILED: {e}")
        sys.exit(1)
