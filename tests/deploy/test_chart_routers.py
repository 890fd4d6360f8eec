"""Several router replicas behind the one router Service (issue 35, point 6): each names
its leases on the shared stages with its own pod's name, they spread over nodes, a
disruption budget keeps one serving, and the autoscaler never goes below two."""

from __future__ import annotations

from .test_helm_chart import arg, main_container, named, of_kind, router, selects


def test_router_replicas_share_one_service(render):
    docs = render({"router": {"autoscaling": {"enabled": False}}})
    r = router(docs)
    assert r["spec"]["replicas"] >= 2
    assert selects(named(docs, "Service", "specpipe-router"), r)


def test_each_router_replica_names_its_leases_with_its_pod_name(render):
    """Two routers under one name would free each other's requests on the stages (a
    restarted router frees its predecessor's): the name is the pod's, unique."""
    c = main_container(router(render()))
    assert arg(c, "--router-name") == "$(POD_NAME)"
    (env,) = [e for e in c["env"] if e["name"] == "POD_NAME"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_router_replicas_spread_over_nodes_and_one_always_serves(render):
    docs = render()
    r = router(docs)
    (spread,) = r["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"  # a one-node cluster runs them
    labels = r["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in spread["labelSelector"]["matchLabels"].items())
    (pdb,) = [
        p for p in of_kind(docs, "PodDisruptionBudget")
        if all(labels.get(k) == v for k, v in p["spec"]["selector"]["matchLabels"].items())
    ]  # fmt: skip
    assert pdb["spec"]["minAvailable"] == 1
    (hpa,) = [h for h in of_kind(docs, "HorizontalPodAutoscaler")
              if h["spec"]["scaleTargetRef"]["name"] == r["metadata"]["name"]]  # fmt: skip
    assert hpa["spec"]["minReplicas"] >= 2
    off = router(render({"router": {"spreadAcrossNodes": False}}))
    assert "topologySpreadConstraints" not in off["spec"]["template"]["spec"]
