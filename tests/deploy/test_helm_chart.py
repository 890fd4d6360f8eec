"""The Helm chart (helm/specpipe) and the rendered manifests (k8s/): rendered with the real
helm, linted, validated against Kubernetes' own schemas, and checked for what a
SpecPipe deployment needs. No cluster involved."""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from specpipe.common.model.partition import split_layers

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "specpipe"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
# The chart's minimum (gRPC probes are GA from 1.27) and the newest schemas we have.
KUBE_VERSIONS = ("1.27.0", "1.37.0")
CURRENT = "v1"
GPU = "nvidia.com/gpu"

EVERYTHING_ON = {
    "gpu": {"enabled": True},
    "modelCache": {"persistentVolumeClaim": {"enabled": True}},
    "stage": {"autoscaling": {"enabled": True, "minReplicas": 2}},
    "draft": {"autoscaling": {"enabled": True}},
    "router": {
        "autoscaling": {"enabled": True},
        "service": {"type": "LoadBalancer"},
        "apiKeys": {"existingSecret": "specpipe-keys"},
        "publicTls": {"existingSecret": "specpipe-public-tls"},
    },
    "transport": "ucx",
    "security": {"leaseSeconds": 30},
}
TWO_GPUS = {
    "gpu": {"enabled": True, "count": 2},
    "stage": {"device": "cuda:1"},
    "draft": {"device": "auto"},
}
# Heterogeneous nodes: layers 0:9 on a GPU pool, 9:28 on a CPU pool and on a second GPU
# pool (a mixed replica set of one range), each placed and sized on its own.
H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
SPREAD = {
    "podAntiAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {
                "weight": 1,
                "podAffinityTerm": {
                    "topologyKey": "kubernetes.io/hostname",
                    "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "stage"}},
                },
            }
        ]
    }
}
CPU_TAINT = {"key": "cpu-only", "operator": "Exists", "effect": "NoSchedule"}
POOLS = {
    "stagePools": [
        {
            "name": "stage-0-h100",
            "layers": "0:9",
            "replicas": 2,
            "gpu": True,
            "nodeSelector": H100,
            "resources": {"limits": {"memory": "40Gi"}},
            "autoscaling": {"enabled": False},
        },
        {
            "name": "stage-1-cpu",
            "layers": "9:28",
            "replicas": 3,
            "nodeSelector": {"node.kubernetes.io/instance-type": "c7i.8xlarge"},
            "tolerations": [CPU_TAINT],
            "affinity": SPREAD,
            "resources": {"requests": {"cpu": "30", "memory": "60Gi"}},
            "threads": 30,
            "autoscaling": {"enabled": False},
        },
        {
            "name": "stage-1-h100",
            "layers": "9:28",
            "gpu": True,
            "nodeSelector": H100,
            "autoscaling": {"minReplicas": 2, "maxReplicas": 6},
        },
    ]
}
WITH_PREVIOUS = {
    "model": {"version": "v2", "stages": 3},
    "previousModels": [
        {
            "version": "v1",
            "target": "qwen2.5-coder-1.5b-instruct",
            "draft": "qwen2.5-coder-0.5b-instruct",
            "stages": 2,
        }
    ],
}


# -- helpers ---------------------------------------------------------------------------------
def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def component(d: dict) -> str:
    return d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def main_container(d: dict) -> dict:
    (c,) = d["spec"]["template"]["spec"]["containers"]
    return c


def arg(container: dict, flag: str) -> str | None:
    args = container["args"]
    return args[args.index(flag) + 1] if flag in args else None


def stage_sets(docs: list[dict], version: str = CURRENT) -> list[dict]:
    """The stage StatefulSets of one model version, in stage order."""
    sets = [
        d
        for d in of_kind(docs, "StatefulSet")
        if d["spec"]["template"]["metadata"]["labels"]["specpipe.dev/model-version"] == version
    ]
    return sorted(
        sets, key=lambda d: int(d["spec"]["selector"]["matchLabels"]["specpipe.dev/stage"])
    )


def layer_ranges(docs: list[dict], version: str = CURRENT) -> list[tuple[int, int]]:
    out = []
    for d in stage_sets(docs, version):
        a, b = arg(main_container(d), "--layers").split(":")
        out.append((int(a), int(b)))
    return out


def selects(service: dict, workload: dict) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def router(docs: list[dict]) -> dict:
    (r,) = [d for d in workloads(docs) if component(d) == "router"]
    return r


def image_config() -> dict[str, str]:
    """The final stage of docker/Dockerfile: instruction -> its argument (the last one)."""
    stage: dict[str, str] = {}
    for line in re.sub(r"\\\n", " ", DOCKERFILE.read_text()).splitlines():
        instruction, _, rest = line.strip().partition(" ")
        if instruction.upper() == "FROM":
            stage = {}
        if instruction and not instruction.startswith("#"):
            stage[instruction.upper()] = rest.strip()
    return stage


def specpipe_argv(container: dict) -> list[str]:
    """What a container runs, as the image runs it: no pod sets `command`, so the image's
    ENTRYPOINT (an init, then `specpipe`) gets the container's args."""
    assert "command" not in container, f"{container['name']} overrides the image's entrypoint"
    line = [*json.loads(image_config()["ENTRYPOINT"]), *container["args"]]
    return line[line.index("specpipe") + 1 :]


# -- lint and schema validation --------------------------------------------------------------
@pytest.mark.parametrize(
    "values", [None, EVERYTHING_ON, POOLS], ids=["defaults", "everything-on", "stage-pools"]
)
def test_chart_lints_clean(helm, tmp_path, values):
    cmd = [str(helm), "lint", "--strict", str(CHART)]
    if values:
        (tmp_path / "v.yaml").write_text(json.dumps(values))
        cmd += ["-f", str(tmp_path / "v.yaml")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize(
    "values",
    [
        None,
        EVERYTHING_ON,
        WITH_PREVIOUS,
        {"model": {"draft": ""}},
        POOLS,
        {**POOLS, **EVERYTHING_ON},
    ],
    ids=["defaults", "everything-on", "previous-model", "no-draft", "stage-pools", "pools-on"],
)
def test_every_manifest_is_valid_kubernetes(render, values):
    docs = render(values, tests=True)
    assert {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget", "Pod"} <= {
        d["kind"] for d in docs
    }
    for version in KUBE_VERSIONS:
        for d in docs:
            try:
                kubernetes_validate.validate(d, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{d['kind']} {d['metadata']['name']} (Kubernetes {version}): {e}")


# -- stages and layers -----------------------------------------------------------------------
def test_default_install_is_two_stages_of_the_coder_target(render):
    docs = render()
    assert layer_ranges(docs) == [(0, 14), (14, 28)]
    for d in stage_sets(docs):
        c = main_container(d)
        assert arg(c, "--model") == "qwen2.5-coder-1.5b-instruct"
        assert d["spec"]["template"]["metadata"]["annotations"]["specpipe.dev/layers"] == arg(
            c, "--layers"
        )
    (draft,) = [d for d in workloads(docs) if component(d) == "draft"]
    assert arg(main_container(draft), "--model") == "qwen2.5-coder-0.5b-instruct"


def test_even_split_matches_specpipe_up_for_many_layouts(render):
    """One render with many model versions (previousModels): each version's stages hold
    the ranges `split_layers` gives, contiguous from layer 0 to the last."""
    layouts = [(L, S) for L in (7, 9, 24, 28, 30) for S in range(1, min(L, 8) + 1)]
    models = [
        {"version": f"l{L}s{S}", "target": "qwen2.5-coder-1.5b-instruct", "draft": "",
         "numLayers": L, "stages": S}
        for L, S in layouts
    ]  # fmt: skip
    docs = render(
        {
            "model": models[0],
            "previousModels": models[1:],
            "stage": {"podDisruptionBudget": {"enabled": False}},
        }
    )
    for L, S in layouts:
        got = layer_ranges(docs, f"l{L}s{S}")
        assert got == [(r.start, r.end) for r in split_layers(L, S)], (L, S)
        assert got[0][0] == 0 and got[-1][1] == L
        assert all(a < b for a, b in got)
        assert all(x[1] == y[0] for x, y in itertools.pairwise(got))


def test_layer_ranges_can_be_set_by_hand(render):
    docs = render({"model": {"stages": 3, "layers": ["0:6", "6:20", "20:28"]}})
    assert layer_ranges(docs) == [(0, 6), (6, 20), (20, 28)]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"layers": ["0:10", "11:28"]}, "must start at 10"),
        ({"layers": ["0:10", "10:27"]}, "end at 27, the target has 28"),
        ({"stages": 3, "layers": ["0:10", "10:28"]}, "lists 2 ranges, stages is 3"),
        ({"stages": 29}, r"stages must be in \[1, 28\]"),
        ({"target": "my-own-model"}, "set numLayers"),
        ({"version": "V1.0"}, "version"),
    ],
)
def test_bad_layouts_fail_to_render_with_a_reason(render, model, message):
    with pytest.raises(render.error, match=message):
        render({"model": model})


def test_the_chart_knows_the_layer_count_of_every_store_model(render):
    from specpipe.common.store.registry import MODELS
    from specpipe.common.store.store import cache_root

    for name in MODELS:
        docs = render({"model": {"target": name, "draft": "", "stages": 1}})
        (only,) = layer_ranges(docs)
        config = cache_root() / name / "config.json"
        if config.is_file():  # pulled here: the count must be the real one
            assert only == (0, json.loads(config.read_text())["num_hidden_layers"]), name


# -- stage pools (heterogeneous nodes, docs/deploy.md) ----------------------------------------
def pool_sets(docs: list[dict], version: str = CURRENT) -> dict[str, dict]:
    """The stage StatefulSets of one model version by pool name."""
    out = {}
    for d in of_kind(docs, "StatefulSet"):
        labels = d["spec"]["template"]["metadata"]["labels"]
        if labels["specpipe.dev/model-version"] == version and "specpipe.dev/pool" in labels:
            out[labels["specpipe.dev/pool"]] = d
    return out


def selector_matches(selector: str, labels: dict) -> bool:
    """A label selector string of the forms the chart writes (k=v, "k in (a,b)")."""
    for term in re.split(r",(?![^(]*\))", selector):
        if " in " in term:
            key, _, values = term.partition(" in ")
            if labels.get(key.strip()) not in values.strip(" ()").split(","):
                return False
        else:
            key, _, value = term.partition("=")
            if labels.get(key.strip()) != value.strip():
                return False
    return True


def test_stage_pools_make_one_workload_each_with_its_own_placement(render):
    """One StatefulSet and headless Service per pool, each with the pool's layers,
    replicas, resources, node selector, affinity and tolerations (GPU pools get the GPU
    and --device cuda, the CPU pool neither), and nothing of the per-stage layout."""
    docs = render(POOLS)
    pools = {p["name"]: p for p in POOLS["stagePools"]}
    sets = pool_sets(docs)
    assert set(sets) == set(pools)
    assert len(of_kind(docs, "StatefulSet")) == len(pools)  # no model.stages workloads
    for name, sts in sets.items():
        pool = pools[name]
        assert sts["metadata"]["name"] == f"specpipe-{CURRENT}-{name}"
        c, spec = main_container(sts), sts["spec"]["template"]["spec"]
        assert arg(c, "--layers") == pool["layers"]
        assert (
            sts["spec"]["template"]["metadata"]["annotations"]["specpipe.dev/layers"]
            == (pool["layers"])
        )
        svc = named(docs, "Service", sts["spec"]["serviceName"])
        assert svc["spec"]["clusterIP"] == "None" and selects(svc, sts)
        assert [d for d in of_kind(docs, "StatefulSet") if selects(svc, d)] == [sts]
        assert spec["nodeSelector"] == pool["nodeSelector"]
        assert spec.get("affinity") == pool.get("affinity")
        gpu = pool.get("gpu", False)
        tolerations = spec.get("tolerations", [])
        assert (CPU_TAINT in tolerations) == (CPU_TAINT in pool.get("tolerations", []))
        assert any(t.get("key") == GPU for t in tolerations) == gpu
        assert arg(c, "--device") == ("cuda" if gpu else "cpu")
        res = c["resources"]
        assert res.get("limits", {}).get(GPU) == (1 if gpu else None)
        if "resources" in pool:  # the pool's own, not merged with stage.resources
            for part in ("requests", "limits"):
                own = {k: v for k, v in res.get(part, {}).items() if k != GPU}
                assert own == pool["resources"].get(part, {}), (name, part)
        else:
            assert res["requests"]["memory"] == "8Gi"  # the stage values'
        assert arg(c, "--threads") == str(pool.get("threads", 4))
        assert "--measure-costs" in c["args"]  # the router prefers the faster by its curve
    # Replicas: the pool's when it is not autoscaled; else an HPA of its own.
    assert sets["stage-0-h100"]["spec"]["replicas"] == 2
    assert sets["stage-1-cpu"]["spec"]["replicas"] == 3
    assert "replicas" not in sets["stage-1-h100"]["spec"]
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h["spec"]
            for h in of_kind(docs, "HorizontalPodAutoscaler")}  # fmt: skip
    hpa = hpas["specpipe-v1-stage-1-h100"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
    assert "specpipe-v1-stage-0-h100" not in hpas and "specpipe-v1-stage-1-cpu" not in hpas
    pdbs = {p["metadata"]["name"] for p in of_kind(docs, "PodDisruptionBudget")}
    assert {s["metadata"]["name"] for s in sets.values()} <= pdbs


def test_the_router_and_the_network_policies_cover_every_pool(render):
    """Discovery (the EndpointSlices of Services matching the router's selector: Kubernetes
    copies a Service's labels onto its slices), the static address list and the
    NetworkPolicies reach every pool's pods."""
    docs = render(POOLS)
    sets = pool_sets(docs)
    selector = arg(main_container(router(docs)), "--discovery-selector")
    for sts in sets.values():
        svc = named(docs, "Service", sts["spec"]["serviceName"])
        assert selector_matches(selector, svc["metadata"]["labels"]), svc["metadata"]["name"]
        pod = sts["spec"]["template"]["metadata"]["labels"]
        assert _admits(docs, pod, 50052, None, {**pod, "app.kubernetes.io/component": "router"})
        assert not _admits(docs, pod, 50052, None, {"app": "other"})
    static = render({**POOLS, "router": {"discovery": "static"}})
    addresses = arg(main_container(router(static)), "--stages").split(",")
    expected = [f"specpipe-v1-{n}-{i}.specpipe-v1-{n}:50052" for n, count in
                (("stage-0-h100", 2), ("stage-1-cpu", 3), ("stage-1-h100", 2)) for i in range(count)]  # fmt: skip
    assert addresses == expected


def test_stage_pools_of_a_previous_version_stay_as_they_were(render):
    """Rolling out a new version: the old one's pools move into its previousModels entry
    and render exactly as before (same names, same pods)."""
    before = pool_sets(render(POOLS))
    old = {"version": CURRENT, "target": "qwen2.5-coder-1.5b-instruct",
           "draft": "qwen2.5-coder-0.5b-instruct", "stages": 2, **POOLS}  # fmt: skip
    docs = render({"model": {"version": "v2"}, "previousModels": [old]})
    assert pool_sets(docs) == before
    assert layer_ranges(docs, "v2") == [(0, 14), (14, 28)]  # the new one per stage
    v2 = [d for d in stage_sets(docs, "v2")]
    assert all("--measure-costs" not in main_container(d)["args"] for d in v2)


def test_a_draft_on_cpu_nodes_beside_gpu_stages(render):
    docs = render(
        {"gpu": {"enabled": True}, "draft": {"gpu": False, "nodeSelector": {"pool": "cpu"}}}
    )
    (draft,) = [d for d in workloads(docs) if component(d) == "draft"]
    c = main_container(draft)
    assert arg(c, "--device") == "cpu" and GPU not in c["resources"].get("limits", {})
    assert draft["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert all(arg(main_container(d), "--device") == "cuda" for d in stage_sets(docs))


@pytest.mark.parametrize(
    ("pools", "extra", "message"),
    [
        ([("a", "0:10"), ("b", "11:28")], {}, "ends at layer 10, where no pool's layers start"),
        ([("a", "0:10"), ("b", "10:27")], {}, "ends at layer 27"),
        ([("a", "1:28")], {}, "starts at layer 1, where no pool's layers end"),
        ([("a", "0:10"), ("b", "10:28"), ("c", "0:14")], {}, "ends at layer 14"),
        ([("a", "0:10"), ("a", "10:28")], {}, "listed twice"),
        ([("draft", "0:28")], {}, "may not be named"),
        ([("a", "0:29")], {}, "within the target's 28 layers"),
        ([("a", "9:9")], {}, "non-empty range"),
        ([("a" * 50, "0:28")], {}, "at most 52"),
        ([("A", "0:28")], {}, "does not match pattern"),
        ([("a", "0-28")], {}, "does not match pattern"),
        ([("a", "0:28")], {"model": {"layers": ["0:28"], "stages": 1}}, "not both"),
    ],
)
def test_bad_stage_pools_fail_to_render_with_a_reason(render, pools, extra, message):
    values = {"stagePools": [{"name": n, "layers": r} for n, r in pools], **extra}
    with pytest.raises(render.error, match=message):
        render(values)


def test_stage_pool_typos_and_misplaced_pools_are_refused(render):
    with pytest.raises(render.error, match="additional properties 'colour'"):
        render({"stagePools": [{"name": "a", "layers": "0:28", "colour": "red"}]})
    with pytest.raises(render.error, match="top-level stagePools"):
        render({"model": {"stagePools": [{"name": "a", "layers": "0:28"}]}})


def test_specpipe_plan_helm_values_render_through_the_chart(render, llama_dir, tmp_path, capsys):
    """`specpipe plan --helm-values` output is chart values as they are: one workload
    per planned stage with the planned layers and each node kind's placement."""
    from specpipe.common.model.config import ModelConfig

    from specpipe.cli import main

    fast = tmp_path / "fast.json"
    fast.write_text(json.dumps({"name": "fast", "seconds_per_layer": 0.01, "seconds_head": 0.01,
                                "memory_gib": 1, "nodeSelector": {"accelerator": "h100"},
                                "resources": {"limits": {GPU: 1}}}))  # fmt: skip
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps({"name": "slow", "seconds_per_layer": 0.025,
                                "seconds_head": 0.025, "memory_gib": 1}))  # fmt: skip
    out = tmp_path / "stages.yaml"
    argv = ["plan", "--target", str(llama_dir), "--nodes", f"{fast}:2,{slow}:2", "--json"]
    assert main([*argv, "--helm-values", str(out)]) == 0
    plan = json.loads(capsys.readouterr().out)
    values = yaml.safe_load(out.read_text())
    n = ModelConfig.from_dir(llama_dir).num_layers
    values["model"] = {"target": str(llama_dir), "draft": "", "numLayers": n}
    docs = render(values)
    sets = list(pool_sets(docs).values())
    assert [arg(main_container(d), "--layers") for d in sets] == [
        s["layers"] for s in plan["stages"]
    ]
    for sts, stage in zip(sets, plan["stages"], strict=True):
        spec = sts["spec"]["template"]["spec"]
        if stage["node"] == "fast":
            assert spec["nodeSelector"] == {"accelerator": "h100"}
            assert main_container(sts)["resources"] == {"limits": {GPU: 1}}
        else:
            assert "nodeSelector" not in spec
    for d in docs:
        kubernetes_validate.validate(d, KUBE_VERSIONS[-1], strict=True)


# -- wiring ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("stage", "replicas"),
    [({}, [1, 1, 1]), ({"replicas": 2}, [2, 2, 2]), ({"replicasPerStage": [1, 2]}, [1, 2, 1])],
)
def test_static_router_names_every_stage_pod_and_the_draft(render, stage, replicas):
    stage = {**stage, "autoscaling": {"enabled": False}}
    docs = render({"model": {"stages": 3}, "stage": stage, "router": {"discovery": "static"}})
    r = main_container(router(docs))
    addresses = arg(r, "--stages").split(",")
    expected = []
    for sts, n in zip(stage_sets(docs), replicas, strict=True):
        name = sts["metadata"]["name"]
        svc = named(docs, "Service", sts["spec"]["serviceName"])
        assert svc["spec"]["clusterIP"] == "None" and selects(svc, sts)
        (port,) = [p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc"]
        container_ports = {p["name"]: p["containerPort"] for p in main_container(sts)["ports"]}
        assert port == container_ports["grpc"] == int(arg(main_container(sts), "--port"))
        assert container_ports["data"] == int(arg(main_container(sts), "--data-port"))
        assert sts["spec"]["replicas"] == n
        expected += [f"{name}-{i}.{svc['metadata']['name']}:{port}" for i in range(n)]
    assert addresses == expected

    draft_host, draft_port = arg(r, "--draft").split(":")
    draft_svc = named(docs, "Service", draft_host)
    (draft,) = [d for d in workloads(docs) if component(d) == "draft"]
    assert selects(draft_svc, draft)
    assert int(draft_port) == draft_svc["spec"]["ports"][0]["port"]
    assert int(draft_port) == int(arg(main_container(draft), "--port"))


def test_services_listen_on_all_interfaces_and_advertise_the_pod_ip(render):
    docs = render()
    for d in workloads(docs):
        c = main_container(d)
        assert arg(c, "--host") == "0.0.0.0"
        assert arg(c, "--advertise-host") == "$(POD_IP)"
        (env,) = [e for e in c["env"] if e["name"] == "POD_IP"]
        assert env["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert arg(c, "--transport") == "tcp"
        if component(d) in ("stage", "draft"):  # hops and answers on the pod network only
            assert "10.0.0.0/8" in arg(c, "--peers").split(",")  # (issue 22, N8)
    no_peers = render({"stage": {"peers": []}, "draft": {"peers": []}})
    assert all(arg(main_container(d), "--peers") is None for d in workloads(no_peers))
    ucx = render({"transport": "ucx", "ucxEnv": [{"name": "UCX_TLS", "value": "rc,tcp"}]})
    for d in workloads(ucx):
        c = main_container(d)
        assert arg(c, "--transport") == "ucx"
        assert any(e["name"] == "UCX_TLS" for e in c["env"])


def test_the_draft_listens_for_control_frames_on_its_own_data_port(render):
    """The routers' calls reach the draft as control frames on its data port (the
    backends' NetworkPolicy admits the release's pods to it: the test below)."""
    (draft,) = [d for d in workloads(render()) if component(d) == "draft"]
    c = main_container(draft)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["data"] == int(arg(c, "--data-port")) != ports["grpc"]


@pytest.mark.parametrize(
    "values",
    [None, EVERYTHING_ON, TWO_GPUS, POOLS],
    ids=["defaults", "everything-on", "two-gpus", "stage-pools"],
)
def test_every_container_command_line_is_one_specpipe_accepts(render, values, capsys, monkeypatch):
    """The chart's arguments against the real `specpipe` parser (catches flag drift), and
    the --device values against the services' own check (as if the pod's GPUs were here)."""
    import torch
    from specpipe.services.modelinfo import resolve_device

    from specpipe.cli import build_parser

    gpus = ((values or {}).get("gpu") or {}).get("count", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    docs = render(values, tests=True)
    pods = [d["spec"]["template"]["spec"] for d in workloads(docs)] + [
        d["spec"] for d in of_kind(docs, "Pod")
    ]
    seen = set()
    for spec in pods:
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            try:
                parsed = build_parser().parse_args(specpipe_argv(c))
            except SystemExit:
                pytest.fail(
                    f"{c['name']}: specpipe {' '.join(c['args'])}: {capsys.readouterr().err}"
                )
            seen.add(parsed.command)
            if parsed.command in ("stage", "draft", "router"):
                assert "--drain-seconds" in c["args"], c["name"]
            if parsed.command in ("stage", "draft"):
                assert "--device" in c["args"], c["name"]
                resolve_device(parsed.device)  # raises ValueError for a device it refuses
    assert seen == {"models", "stage", "draft", "router", "client"}


def test_router_service_is_the_client_entry_point(render):
    docs = render()
    svc = named(docs, "Service", "specpipe-router")
    assert selects(svc, router(docs))
    c = main_container(router(docs))
    grpc_port, http_port = svc["spec"]["ports"]
    assert grpc_port["port"] == int(arg(c, "--port"))
    # The OpenAI-compatible HTTP API: on by default, port "http" of the same Service.
    container_ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert http_port["name"] == http_port["targetPort"] == "http"
    assert container_ports["http"] == int(arg(c, "--http-port")) == http_port["port"]


def test_http_api_can_be_turned_off(render):
    docs = render({"router": {"http": {"enabled": False}}})
    c = main_container(router(docs))
    assert arg(c, "--http-port") is None and "http" not in {p["name"] for p in c["ports"]}
    assert [p["name"] for p in named(docs, "Service", "specpipe-router")["spec"]["ports"]] == [
        "grpc"
    ]
    # gRPC health instead (on the plaintext health port: the services speak mutual TLS).
    assert c["readinessProbe"]["grpc"]["port"] == int(arg(c, "--health-port"))


def test_api_keys_come_from_a_secret_file(render):
    assert arg(main_container(router(render())), "--api-key-file") is None  # off by default
    values = {"router": {"apiKeys": {"existingSecret": "keys", "testSecretKey": "one"}}}
    docs = render(values, tests=True)
    r = router(docs)
    c = main_container(r)
    path = arg(c, "--api-key-file")
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "api-keys"]
    assert path == f"{mount['mountPath']}/api-keys" and mount["readOnly"]
    (vol,) = [v for v in r["spec"]["template"]["spec"]["volumes"] if v["name"] == "api-keys"]
    assert vol["secret"]["secretName"] == "keys"
    assert vol["secret"]["items"] == [{"key": "api-keys", "path": "api-keys"}]
    (pod,) = of_kind(docs, "Pod")  # helm test: the client's key from the Secret
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}["SPECPIPE_API_KEY"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "one"}


def test_api_keys_are_one_value_away(render):
    """router.apiKeys.generate: the chart makes a Secret with one random key, which the
    router requires and `helm test` sends; a Secret of your own wins."""
    import base64

    docs = render({"router": {"apiKeys": {"generate": True}}}, tests=True)
    secret = named(docs, "Secret", "specpipe-api-keys")
    (key,) = base64.b64decode(secret["data"]["api-keys"]).decode().splitlines()
    assert re.fullmatch(r"sk-[A-Za-z0-9]{40}", key)
    r = router(docs)
    assert arg(main_container(r), "--api-key-file") == "/etc/specpipe/api-keys/api-keys"
    assert _volume(r, "api-keys")["secret"]["secretName"] == "specpipe-api-keys"
    (pod,) = of_kind(docs, "Pod")
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}["SPECPIPE_API_KEY"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "specpipe-api-keys", "key": "api-keys"}
    theirs = render({"router": {"apiKeys": {"generate": True, "existingSecret": "keys"}}})
    assert _volume(router(theirs), "api-keys")["secret"]["secretName"] == "keys"
    assert not [d for d in of_kind(theirs, "Secret") if d["metadata"]["name"].endswith("api-keys")]


def test_no_draft_means_no_draft_workload(render):
    docs = render({"model": {"draft": ""}}, tests=True)
    assert not [d for d in workloads(docs) if component(d) == "draft"]
    assert arg(main_container(router(docs)), "--draft") is None
    (test_pod,) = of_kind(docs, "Pod")
    assert arg(test_pod["spec"]["containers"][0], "--mode") == "pp"


# -- models, GPUs, probes ----------------------------------------------------------------------
def test_each_pod_pulls_its_model_into_the_cache_first(render):
    for values in (None, {"modelCache": {"persistentVolumeClaim": {"enabled": True}}}):
        docs = render(values)
        for d in workloads(docs):
            spec = d["spec"]["template"]["spec"]
            (init,) = spec["initContainers"]
            c = main_container(d)
            model = arg(c, "--model") or arg(c, "--target")
            assert init["args"] == ["models", "pull", model]
            for container in (init, c):
                env = {e["name"]: e.get("value") for e in container["env"]}
                (mount,) = [m for m in container["volumeMounts"] if m["name"] == "model-cache"]
                assert env["SPECPIPE_MODEL_CACHE"] == mount["mountPath"]
            (vol,) = [v for v in spec["volumes"] if v["name"] == "model-cache"]
            if values is None:
                assert "emptyDir" in vol
            else:
                claim = vol["persistentVolumeClaim"]["claimName"]
                named(docs, "PersistentVolumeClaim", claim)
            assert spec["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize("enabled", [False, True])
def test_gpu_per_stage_and_draft_pod_when_enabled(render, enabled):
    docs = render({"gpu": {"enabled": enabled}})
    for d in workloads(docs):
        res = main_container(d)["resources"]
        wants_gpu = enabled and component(d) in ("stage", "draft")
        assert res.get("limits", {}).get(GPU) == (1 if wants_gpu else None), d["metadata"]["name"]
        assert res.get("requests", {}).get(GPU) == (1 if wants_gpu else None)
        tolerations = d["spec"]["template"]["spec"].get("tolerations", [])
        assert any(t.get("key") == GPU for t in tolerations) == wants_gpu
        c = main_container(d)
        if component(d) == "router":
            assert arg(c, "--device") is None  # the router never touches the model
        else:
            assert arg(c, "--dtype") == ("bfloat16" if enabled else "float32")
            # --device cuda exactly where the GPU is; cpu (or the services' default) elsewhere
            assert arg(c, "--device") in (("cuda",) if enabled else ("cpu", None))
        for init in d["spec"]["template"]["spec"]["initContainers"]:
            assert GPU not in init["resources"].get("limits", {})
            assert "--device" not in init["args"]


@pytest.mark.parametrize(
    ("values", "stage", "draft"),
    [
        ({"stage": {"device": "auto"}}, "auto", "cpu"),
        ({"gpu": {"enabled": True}, "draft": {"device": "cpu"}}, "cuda", "cpu"),
        ({"gpu": {"enabled": True, "count": 2}, "stage": {"device": "cuda:1"}}, "cuda:1", "cuda"),
    ],
)
def test_device_can_be_set_per_service(render, values, stage, draft):
    docs = render(values)
    devices = {component(d): arg(main_container(d), "--device") for d in workloads(docs)}
    assert devices == {"stage": stage, "draft": draft, "router": None}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"stage": {"device": "gpu"}}, "does not match pattern"),
        ({"gpu": {"enabled": True}, "stage": {"device": "cuda:1"}}, "gpu.count=1"),
    ],
)
def test_bad_devices_fail_to_render_with_a_reason(render, values, message):
    with pytest.raises(render.error, match=message):
        render(values)


def test_the_image_runs_specpipe_as_the_pods_user_with_the_model_cache(render, capsys):
    """docker/Dockerfile against the chart: the entrypoint the pods rely on, the user they
    run as, the cache volume's path and the ports (scripts/container_e2e.sh runs it)."""
    from specpipe.cli import build_parser

    image = image_config()
    entrypoint = json.loads(image["ENTRYPOINT"])
    # dumb-init is PID 1 (it forwards SIGTERM, for the drain); it comes from the wheelhouse.
    assert entrypoint == ["/opt/specpipe/bin/dumb-init", "--", "specpipe"]
    assert "dumb-init==" in (ROOT / "scripts" / "build_image.sh").read_text()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["specpipe"] == "specpipe.cli:main"  # the parser of build_parser()
    with pytest.raises(SystemExit) as done:  # the default command: `specpipe --help`
        build_parser().parse_args(json.loads(image["CMD"]))
    assert done.value.code == 0
    env = dict(kv.split("=", 1) for kv in shlex.split(image["ENV"]))
    exposed = {int(p) for p in image["EXPOSE"].split()}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert image["USER"] == "{runAsUser}:{runAsGroup}".format(**values["podSecurityContext"])
    assert env["SPECPIPE_MODEL_CACHE"] == values["modelCache"]["mountPath"]
    assert exposed == set(values["ports"].values())
    for d in workloads(render()):
        for c in [*d["spec"]["template"]["spec"]["initContainers"], main_container(d)]:
            cache = {e["name"]: e.get("value") for e in c["env"]}["SPECPIPE_MODEL_CACHE"]
            assert cache == env["SPECPIPE_MODEL_CACHE"], c["name"]


def test_models_already_in_a_volume_are_not_pulled(render):
    """A model directory given by path needs no init container (`models pull` takes store
    names and .gguf files only); a .gguf path is converted into the cache first."""
    model = {"target": "/models/target", "draft": "/models/draft.gguf", "numLayers": 4}
    for d in workloads(render({"model": model})):
        spec = d["spec"]["template"]["spec"]
        if component(d) == "draft":
            (init,) = spec["initContainers"]
            assert specpipe_argv(init) == ["models", "pull", "/models/draft.gguf"]
        else:
            assert "initContainers" not in spec, d["metadata"]["name"]


@pytest.mark.parametrize("secure", [True, False])
def test_probes_use_grpc_health_on_the_port_the_command_listens_on(render, secure):
    """gRPC probes on the port the command serves, or with security.enabled (the default)
    on its plaintext health port: the kubelet's gRPC probes speak no TLS."""
    from specpipe.cli import build_parser

    values = {"security": {"enabled": secure}}
    for d in workloads(render({**EVERYTHING_ON, **values})) + workloads(render(values)):
        c = main_container(d)
        parsed = build_parser().parse_args(specpipe_argv(c))
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == parsed.port
        if "data" in ports:
            assert ports["data"] == parsed.data_port
        assert parsed.host == "0.0.0.0"  # the kubelet probes the pod IP
        assert (parsed.health_port is not None) == secure
        port = ports["health"] if secure else parsed.port
        if secure:
            assert parsed.health_port == port
        assert "startupProbe" in c
        if component(d) == "router":
            # Ready: the HTTP API's /health (200 only while every backend is up).
            ready = c["readinessProbe"]["httpGet"]
            assert {k: ready[k] for k in ("path", "port")} == {"path": "/health", "port": "http"}
            # HTTPS when the router serves public TLS.
            tls = arg(c, "--public-tls-cert") is not None
            assert ready.get("scheme", "HTTP") == ("HTTPS" if tls else "HTTP")
            # The router's health follows its backends: a stage outage must not restart it.
            assert c["livenessProbe"]["tcpSocket"]["port"] == "grpc"
        else:
            assert c["readinessProbe"]["grpc"]["port"] == port
            assert c["livenessProbe"]["grpc"]["port"] == port
            assert c["startupProbe"]["grpc"]["port"] == port


# -- scaling and rollouts ------------------------------------------------------------------------
ADAPTER_VALUES = CHART / "files" / "prometheus-adapter-values.yaml"


def served_series(samples: bool = True) -> set[str]:
    """Every metric family (and, with `samples`, sample) name the three services export."""
    from types import SimpleNamespace

    from specpipe.services.metrics import (
        DraftMetrics,
        RouterMetrics,
        StageMetrics,
        _BackendCollector,
    )

    families = [m for cls in (RouterMetrics, StageMetrics, DraftMetrics)
                for m in cls().registry.collect()]  # fmt: skip
    families += _BackendCollector(SimpleNamespace(by_key={}, versions={}, model=None)).collect()
    names = {m.name for m in families}
    if samples:
        names |= {f"{m.name}{sfx}" for m in families for sfx in ("_total", "_bucket", "_count")}
    return names


def adapter_metric_names() -> set[str]:
    """The custom metrics the Prometheus adapter serves with the chart's rules, for every
    series the services export."""
    import re

    series = served_series(samples=False)
    names = set()
    for rule in yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]:
        wanted = re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"]).group(1)
        for name in series:
            if re.fullmatch(wanted, name):
                names.add(re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"),
                                 name))  # fmt: skip
    return names


def test_an_hpa_per_service_on_serving_metrics_by_default(render):
    docs = render()
    hpas = {
        h["spec"]["scaleTargetRef"]["name"]: h for h in of_kind(docs, "HorizontalPodAutoscaler")
    }
    assert set(hpas) == {d["metadata"]["name"] for d in workloads(docs)}  # stages, draft, router
    served = adapter_metric_names()
    wanted = {"stage": {"specpipe_stage_busy_ratio"}, "draft": {"specpipe_draft_busy_ratio"},
              "router": {"specpipe_num_requests_running", "specpipe_num_requests_waiting"}}  # fmt: skip
    for d in workloads(docs):
        hpa = hpas[d["metadata"]["name"]]
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"]["kind"] == d["kind"]
        assert "replicas" not in d["spec"]  # the HPA owns it
        assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
        assert names == wanted[component(d)]
        assert names <= served  # the Prometheus adapter's rules (files/) serve them
    # Off: the replicas are the values'.
    off = {"autoscaling": {"enabled": False}}
    docs = render({"stage": {**off, "replicas": 2}, "draft": off, "router": off})
    assert not of_kind(docs, "HorizontalPodAutoscaler")
    assert all(d["spec"]["replicas"] == 2 for d in stage_sets(docs))
    # A static router knows the replicas every stage always has: the HPA minimum.
    docs = render({"stage": {"autoscaling": {"minReplicas": 2}}, "router": {"discovery": "static"}})
    addresses = arg(main_container(router(docs)), "--stages").split(",")
    assert len(addresses) == 2 * len(stage_sets(docs))


def test_keda_scaled_objects_instead_of_hpas(render):
    docs = render({"keda": {"enabled": True}})
    assert not of_kind(docs, "HorizontalPodAutoscaler")
    scaled = {s["spec"]["scaleTargetRef"]["name"]: s for s in of_kind(docs, "ScaledObject")}
    assert set(scaled) == {d["metadata"]["name"] for d in workloads(docs)}
    for d in workloads(docs):
        so = scaled[d["metadata"]["name"]]
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        assert so["spec"]["scaleTargetRef"]["kind"] == d["kind"]
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "prometheus"
        query = trigger["metadata"]["query"]
        name = d["metadata"]["name"]
        assert f'pod=~"{name}-' in query and 'namespace="default"' in query
        metric = {"stage": "stage_busy_ratio", "draft": "draft_busy_ratio",
                  "router": "num_requests_running"}[component(d)]  # fmt: skip
        assert f"specpipe:{metric}" in query
        assert float(trigger["metadata"]["threshold"]) > 0


def test_discovery_rbac_lets_only_the_router_watch_endpointslices(render):
    docs = render()
    (sa,) = of_kind(docs, "ServiceAccount")
    (role,) = of_kind(docs, "Role")
    (binding,) = of_kind(docs, "RoleBinding")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]  # fmt: skip
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}  # fmt: skip
    assert binding["subjects"][0]["name"] == sa["metadata"]["name"]
    for d in workloads(docs):
        spec = d["spec"]["template"]["spec"]
        if component(d) == "router":
            assert spec["serviceAccountName"] == sa["metadata"]["name"]
            assert spec["automountServiceAccountToken"] is True
        else:
            assert spec["automountServiceAccountToken"] is False
    # The router's selector picks the stage and draft Services (their EndpointSlices carry
    # the Services' labels), not the router's own.
    c = main_container(router(docs))
    assert arg(c, "--discovery") == "kubernetes" and arg(c, "--stages") is None
    selector = arg(c, "--discovery-selector")
    equal = dict(p.split("=") for p in selector.split(",") if "=" in p and " in " not in p)
    allowed = selector.split(" in (")[1].rstrip(")").split(",")
    picked = {
        svc["metadata"]["labels"]["app.kubernetes.io/component"]
        for svc in of_kind(docs, "Service")
        if all(svc["metadata"]["labels"].get(k) == v for k, v in equal.items())
        and svc["metadata"]["labels"].get("app.kubernetes.io/component") in allowed
    }
    assert picked == {"stage", "draft"}
    static = render({"router": {"discovery": "static"}})
    assert not of_kind(static, "Role") and "serviceAccountName" not in router(static)["spec"][
        "template"]["spec"]  # fmt: skip
    with pytest.raises(render.error, match="discovery"):
        render({"router": {"discovery": "dns"}})


def test_every_service_serves_metrics(render):
    docs = render()
    for d in workloads(docs):
        c = main_container(d)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert int(arg(c, "--metrics-port")) == ports["metrics"] == 9090
        ann = d["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "9090"
    off = render({"metrics": {"enabled": False}})
    assert all(arg(main_container(d), "--metrics-port") is None for d in workloads(off))
    assert not of_kind(off, "ConfigMap")


def test_grafana_dashboard_and_pod_monitor(render):
    import re

    docs = render()
    (cm,) = of_kind(docs, "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["specpipe.json"])
    assert dash == json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    served = served_series()
    used = set()
    for panel in dash["panels"]:
        for target in panel["targets"]:
            used |= set(re.findall(r"specpipe:[a-z0-9_]+", target["expr"]))
    assert used and used <= served, used - served
    assert not of_kind(docs, "PodMonitor")  # off by default (needs the Prometheus Operator)
    (pm,) = of_kind(render({"metrics": {"podMonitor": {"enabled": True}}}), "PodMonitor")
    assert pm["spec"]["podMetricsEndpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s"}
    ]
    labels = pm["spec"]["selector"]["matchLabels"]
    for d in workloads(docs):
        pod = d["spec"]["template"]["metadata"]["labels"]
        assert all(pod[k] == v for k, v in labels.items())


def test_pod_disruption_budget_per_workload(render):
    docs = render()
    pdbs = of_kind(docs, "PodDisruptionBudget")
    for d in workloads(docs):
        labels = d["spec"]["template"]["metadata"]["labels"]
        matching = [
            p for p in pdbs
            if all(labels.get(k) == v for k, v in p["spec"]["selector"]["matchLabels"].items())
        ]  # fmt: skip
        assert len(matching) == 1, d["metadata"]["name"]


def prestop_sleep(container: dict) -> int:
    if "lifecycle" not in container:
        return 0
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return int(command[1])


def test_rollouts_keep_capacity_and_drain(render):
    docs = render()
    for d in workloads(docs):
        if d["kind"] == "Deployment":
            rolling = d["spec"]["strategy"]["rollingUpdate"]
            assert rolling["maxUnavailable"] == 0 and rolling["maxSurge"] >= 1
        else:
            assert d["spec"]["updateStrategy"]["type"] == "RollingUpdate"
        spec = d["spec"]["template"]["spec"]
        c = main_container(d)
        # A short preStop sleep covers endpoint propagation; the service drains by itself
        # on SIGTERM, and the grace period (counted from preStop) covers both.
        assert 0 < prestop_sleep(c) <= 10
        drain = int(arg(c, "--drain-seconds"))
        assert drain > 0
        assert spec["terminationGracePeriodSeconds"] > prestop_sleep(c) + drain


@pytest.mark.parametrize(
    "service",
    [
        {"preStopSeconds": 2, "drainSeconds": 600},
        {"preStopSeconds": 0, "drainSeconds": 0},
        {"preStopSeconds": 30, "drainSeconds": 5},
    ],
)
def test_drain_seconds_and_grace_period_follow_the_values(render, service):
    docs = render({"stage": service, "draft": service, "router": service})
    for d in workloads(docs):
        c = main_container(d)
        spec = d["spec"]["template"]["spec"]
        assert int(arg(c, "--drain-seconds")) == service["drainSeconds"], d["metadata"]["name"]
        assert prestop_sleep(c) == service["preStopSeconds"]
        grace = spec["terminationGracePeriodSeconds"]
        assert grace == service["preStopSeconds"] + service["drainSeconds"] + 15


def test_model_version_is_on_every_stage_and_draft_pod_and_in_their_names(render):
    docs = render()
    for d in workloads(docs):
        meta = d["spec"]["template"]["metadata"]
        if component(d) != "router":
            assert meta["labels"]["specpipe.dev/model-version"] == CURRENT
            assert "specpipe.dev/target-weight-hash" in meta["annotations"]
            assert f"-{CURRENT}-" in d["metadata"]["name"]
            assert d["spec"]["selector"]["matchLabels"]["specpipe.dev/model-version"] == CURRENT
        else:  # the routers serve every version: nothing of one in their pods
            assert "specpipe.dev/model-version" not in meta["labels"]
            assert "specpipe.dev/model-version" not in d["spec"]["selector"]["matchLabels"]


def test_previous_model_keeps_running_and_the_routers_stay_as_they_are(render):
    docs = render(WITH_PREVIOUS)
    assert layer_ranges(docs, "v2") == [(0, 9), (9, 19), (19, 28)]
    assert layer_ranges(docs, "v1") == [(0, 14), (14, 28)]
    # The same router pods before, during and after the update: it follows every
    # version's replicas through discovery and moves new requests to the newest.
    before = router(render())["spec"]["template"]
    assert router(docs)["spec"]["template"] == before
    assert router(render({"model": WITH_PREVIOUS["model"]}))["spec"]["template"] == before
    # A new target name changes the tokenizer the router loads, unless it is pinned.
    new_target = {"model": {**WITH_PREVIOUS["model"], "target": "smollm2-135m-instruct",
                            "draft": ""}}  # fmt: skip
    assert router(render(new_target))["spec"]["template"] != before
    pinned = {**new_target, "router": {"tokenizerModel": "qwen2.5-coder-1.5b-instruct"}}
    assert router(render(pinned))["spec"]["template"] == before
    # A static router is wired to the current version only.
    c = main_container(router(render({**WITH_PREVIOUS, "router": {"discovery": "static"}})))
    assert all("-v2-stage-" in a for a in arg(c, "--stages").split(","))
    assert arg(c, "--draft").startswith("specpipe-v2-draft:")
    with pytest.raises(render.error, match="listed twice"):
        render({"previousModels": WITH_PREVIOUS["previousModels"]})


# -- k8s/ ------------------------------------------------------------------------------------
def test_k8s_manifests_match_a_fresh_render(helm):
    env = {**os.environ, "SPECPIPE_HELM": str(helm)}
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "render_k8s.sh"), "--check"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, f"run scripts/render_k8s.sh:\n{result.stderr[-3000:]}"


def test_kustomization_builds_the_rendered_manifests(kubectl, render):
    result = subprocess.run(
        [str(kubectl), "kustomize", str(ROOT / "k8s")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    built = [d for d in yaml.safe_load_all(result.stdout) if d]
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    # k8s/ names its TLS Secret rather than making one (see scripts/render_k8s.sh).
    rendered = render({"security": {"tls": {"existingSecret": "specpipe-internal-tls"}}})
    assert sorted(map(key, built)) == sorted(map(key, rendered))


# -- security (docs/architecture.md, "9. Security") ------------------------------------------
def _volume(workload: dict, name: str) -> dict:
    (v,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == name]
    return v


def test_every_service_is_secure_by_default(render):
    """--secure on router, stages and draft with the release's TLS Secret mounted read
    only; the chart makes that Secret (CA, certificate, data key) when none is named."""
    docs = render()
    (secret,) = of_kind(docs, "Secret")
    assert secret["metadata"]["name"] == "specpipe-internal-tls"
    assert set(secret["data"]) == {"ca.crt", "tls.crt", "tls.key", "data.key"}
    for d in workloads(docs):
        c = main_container(d)
        assert "--secure" in c["args"] and arg(c, "--tls-dir") == "/etc/specpipe/tls", c["name"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "internal-tls"]
        assert mount["mountPath"] == "/etc/specpipe/tls" and mount["readOnly"]
        assert _volume(d, "internal-tls")["secret"]["secretName"] == "specpipe-internal-tls"
        assert "--allow-configure" not in c["args"]
        # Non-root, read-only root filesystem, no service account token (but the router's,
        # which follows the EndpointSlices).
        spec = d["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"]
        assert spec["automountServiceAccountToken"] == (component(d) == "router")
        assert c["securityContext"]["readOnlyRootFilesystem"]
        assert not c["securityContext"]["allowPrivilegeEscalation"]
    mine = render({"security": {"tls": {"existingSecret": "mine"}}})
    assert not of_kind(mine, "Secret")
    for d in workloads(mine):
        assert _volume(d, "internal-tls")["secret"]["secretName"] == "mine"
    off = render({"security": {"enabled": False}})
    assert not of_kind(off, "Secret")
    for d in workloads(off):  # plaintext only when asked for, and then explicitly
        args = main_container(d)["args"]
        assert "--insecure" in args and "--secure" not in args, component(d)


def test_cert_manager_can_fill_the_tls_secret(render):
    docs = render({"security": {"certManager": {"enabled": True}}})
    assert not of_kind(docs, "Secret")
    certs = {d["metadata"]["name"]: d["spec"] for d in of_kind(docs, "Certificate")}
    leaf = certs["specpipe-internal"]
    assert leaf["secretName"] == "specpipe-internal-tls"
    assert leaf["dnsNames"] == ["specpipe-internal"]
    assert {"server auth", "client auth"} <= set(leaf["usages"])
    assert leaf["issuerRef"] == {"name": "specpipe-ca", "kind": "Issuer"}  # the chart's own CA
    assert certs["specpipe-ca"]["isCA"]
    theirs = render({"security": {"certManager": {
        "enabled": True, "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}}}})  # fmt: skip
    (leaf,) = of_kind(theirs, "Certificate")
    assert leaf["spec"]["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer"}
    assert not of_kind(theirs, "Issuer")


def test_network_policies_admit_only_the_release_to_backend_ports(render):
    docs = render()
    ports = lambda rule: sorted(p["port"] for p in rule["ports"])  # noqa: E731
    own = {"app.kubernetes.io/name": "specpipe", "app.kubernetes.io/instance": "specpipe"}
    backends = named(docs, "NetworkPolicy", "specpipe-backends")["spec"]
    assert backends["podSelector"]["matchExpressions"] == [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["stage", "draft"]}
    ]
    inner, probes, _scrape = backends["ingress"]
    assert inner["from"] == [{"podSelector": {"matchLabels": own}}]
    assert ports(inner) == [50052, 50053, 50060, 50061] and ports(probes) == [50059]
    assert "from" not in probes  # health only: the kubelet's probes
    router_policy = named(docs, "NetworkPolicy", "specpipe-router")["spec"]
    public, data, _scrape = router_policy["ingress"]
    assert "from" not in public and ports(public) == [8000, 50051, 50059]
    assert data["from"] == [{"podSelector": {"matchLabels": own}}] and ports(data) == [50055]
    # Every stage, draft and router pod is selected by one of them.
    for d in workloads(docs):
        labels = d["spec"]["template"]["metadata"]["labels"]
        comp = labels["app.kubernetes.io/component"]
        assert all(labels[k] == v for k, v in own.items()) and comp in ("stage", "draft", "router")
    assert not of_kind(render({"security": {"networkPolicy": {"enabled": False}}}), "NetworkPolicy")


def _selected(selector: dict | None, labels: dict) -> bool:
    """A label selector (matchLabels, matchExpressions) against labels; {} selects all."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and value in e.get("values", []),
              "NotIn": not has or value not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]  # fmt: skip
        if not ok:
            return False
    return True


def _admits(docs: list[dict], pod: dict, port: int, peer_ns: dict, peer_pod: dict) -> bool:
    """Whether the release's NetworkPolicies let a peer (its namespace's labels and its
    own; None: the release's namespace) reach `port` of a pod (its labels), as a CNI
    enforces them: a pod no policy selects admits all; else any rule of those may."""
    policies = [p["spec"] for p in of_kind(docs, "NetworkPolicy")]
    mine = [p for p in policies if _selected(p["podSelector"], pod)]
    if not mine:
        return True
    for policy in mine:
        for rule in policy.get("ingress", []):
            if "ports" in rule and port not in {p["port"] for p in rule["ports"]}:
                continue
            if "from" not in rule:
                return True
            for peer in rule["from"]:
                if "namespaceSelector" in peer:
                    in_ns = peer_ns is not None and _selected(peer["namespaceSelector"], peer_ns)
                else:
                    in_ns = peer_ns is None
                if in_ns and _selected(peer.get("podSelector"), peer_pod):
                    return True
    return False


MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}


def test_prometheus_may_scrape_every_pod_through_the_network_policies(render):
    """Issue 22, N7: with the defaults no NetworkPolicy admitted the metrics port, so
    Prometheus scraped nothing and the serving-metric autoscalers never got data. Now
    the monitoring namespace reaches every pod's metrics port (and nothing else there);
    the peers are values (namespace and/or pod selectors)."""
    docs = render()
    pods = [d["spec"]["template"]["metadata"]["labels"] for d in workloads(docs)]
    assert {p["app.kubernetes.io/component"] for p in pods} == {"router", "stage", "draft"}
    for d in workloads(docs):
        c = main_container(d)
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"] == 9090
        assert arg(c, "--metrics-port") == "9090"
    other = {"kubernetes.io/metadata.name": "default"}
    for pod in pods:
        assert _admits(docs, pod, 9090, MONITORING, PROMETHEUS), pod
        assert not _admits(docs, pod, 9090, other, PROMETHEUS), pod
        if pod["app.kubernetes.io/component"] != "router":  # the backends stay closed
            assert not _admits(docs, pod, 50052, MONITORING, PROMETHEUS)
            assert not _admits(docs, pod, 50053, MONITORING, PROMETHEUS)
    # Narrowed to Prometheus' own pods in that namespace.
    only = {
        "namespaceSelector": {"matchLabels": MONITORING},
        "podSelector": {"matchLabels": PROMETHEUS},
    }
    narrow = render({"security": {"networkPolicy": {"metricsFrom": [only]}}})
    for pod in pods:
        assert _admits(narrow, pod, 9090, MONITORING, PROMETHEUS)
        assert not _admits(narrow, pod, 9090, MONITORING, {"app": "grafana"})
    # A Prometheus in the release's own namespace (a pod selector alone).
    local = render(
        {
            "security": {
                "networkPolicy": {"metricsFrom": [{"podSelector": {"matchLabels": PROMETHEUS}}]}
            }
        }
    )
    assert all(_admits(local, pod, 9090, None, PROMETHEUS) for pod in pods)
    assert not any(_admits(local, pod, 9090, MONITORING, PROMETHEUS) for pod in pods)
    # Nobody, or no metrics at all: no rule for the port.
    for values in (
        {"security": {"networkPolicy": {"metricsFrom": []}}},
        {"metrics": {"enabled": False}},
    ):
        closed = render(values)
        assert not any(_admits(closed, pod, 9090, MONITORING, PROMETHEUS) for pod in pods)


def test_public_tls_on_the_router_ports(render):
    docs = render({"router": {"publicTls": {"existingSecret": "pub"}}}, tests=True)
    r = router(docs)
    c = main_container(r)
    assert arg(c, "--public-tls-cert") == "/etc/specpipe/public-tls/tls.crt"
    assert arg(c, "--public-tls-key") == "/etc/specpipe/public-tls/tls.key"
    assert _volume(r, "public-tls")["secret"]["secretName"] == "pub"
    assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    (pod,) = of_kind(docs, "Pod")
    assert "--tls-ca" in pod["spec"]["containers"][0]["args"]


def test_tree_defaults_and_auto_make_the_stages_and_draft_measure_costs(render):
    def mains(docs):
        return [main_container(d) for d in workloads(docs)]

    assert not any("--measure-costs" in c["args"] for c in mains(render(None)))
    docs = render(
        {"router": {"treeDefaults": {"layersPerStep": "auto", "tokenSource": "hybrid",
                                     "width": 4}, "lateDraftWaitMs": 250}}
    )  # fmt: skip
    (router,) = [c for c in mains(docs) if c["args"][0] == "router"]
    assert arg(router, "--layers-per-step") == "auto" and arg(router, "--width") == "4"
    assert arg(router, "--token-source") == "hybrid"
    assert arg(router, "--late-draft-wait-ms") == "250"
    measured = {c["args"][0] for c in mains(docs) if "--measure-costs" in c["args"]}
    assert measured == {"stage", "draft"}


def test_router_replay_budget(render):
    (router,) = [
        c for c in map(main_container, workloads(render(None))) if c["args"][0] == "router"
    ]
    assert arg(router, "--max-replays") == "8" and arg(router, "--replay-seconds") == "10"
    docs = render({"router": {"maxReplays": 3}})
    (router,) = [c for c in map(main_container, workloads(docs)) if c["args"][0] == "router"]
    assert arg(router, "--max-replays") == "3"
