"""How `specpipe up` gives the cores to its model processes (services/cpu_threads.py):
the stages the cores a deployment without a draft gives them, every core to the draft,
passive OpenMP waits unless the caller chose."""

from __future__ import annotations

import os
from pathlib import Path

from specpipe.services.config import DeploymentConfig
from specpipe.services.cpu_threads import draft_threads, model_env, model_threads


def test_stages_share_the_cores_and_the_draft_gets_every_core() -> None:
    assert model_threads(None, 2) == 2 and model_threads(0, 16) == 16
    assert model_threads(1, 2) == 1 and model_threads(None, 0) == 1
    # several stage processes on one host work at once: the cores are shared
    assert model_threads(None, 2, stages=2) == 1 and model_threads(None, 16, stages=3) == 5
    assert model_threads(None, 2, stages=4) == 1 and model_threads(3, 2, stages=4) == 3
    # the draft: --draft-threads, else --threads, else every core
    assert draft_threads(None, None, 16) == 16 and draft_threads(None, 2, 16) == 2
    assert draft_threads(4, 2, 16) == 4 and draft_threads(None, None, 0) == 1


def test_openmp_waits_are_passive_unless_the_environment_says_otherwise() -> None:
    assert model_env({"A": "1"}) == {"A": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    assert model_env({"OMP_WAIT_POLICY": "active"})["OMP_WAIT_POLICY"] == "active"
    assert "OMP_WAIT_POLICY" not in model_env({"OMP_WAIT_POLICY": ""})  # the runtime's own


def test_a_deployment_with_a_draft_does_not_split_the_cores(llama_dir: Path) -> None:
    """With a draft the stage keeps every core (an idle draft costs it nothing): the
    tuner's no-draft choice decodes as fast as a deployment without a draft."""
    from specpipe.services.launcher import ServicesDeployment

    dep = ServicesDeployment(DeploymentConfig(target=llama_dir, draft="oracle", stages=1))
    assert dep.threads == dep.draft_threads == (os.cpu_count() or 1)
    dep._stage_child("stage0", dep.target, "0:2", "")
    dep._draft_child("draft", dep.draft, "")
    for name in ("stage0", "draft"):
        argv = dep.children[name].argv
        assert argv[argv.index("--threads") + 1] == str(dep.threads)


def test_several_stages_share_the_cores_as_without_a_draft(llama_dir: Path) -> None:
    """Two stages on one host get the threads a deployment without a draft gives them;
    the draft every core."""
    from specpipe.services.launcher import ServicesDeployment

    cpus = os.cpu_count() or 1
    with_draft = ServicesDeployment(DeploymentConfig(target=llama_dir, draft="oracle", stages=2))
    without = ServicesDeployment(DeploymentConfig(target=llama_dir, draft="none", stages=2))
    assert with_draft.threads == without.threads == max(1, cpus // 2)
    assert with_draft.draft_threads == cpus


def test_only_the_model_processes_get_passive_openmp_waits(llama_dir: Path, monkeypatch) -> None:
    """The router runs no forwards: its environment is the caller's as it is."""
    from specpipe.services.launcher import ServicesDeployment

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    dep = ServicesDeployment(DeploymentConfig(target=llama_dir, draft="oracle", stages=1))
    dep._stage_child("stage0", dep.target, "0:2", "")
    dep._draft_child("draft", dep.draft, "")
    dep._router_child()
    for name in ("stage0", "draft"):
        assert dep.child_env(dep.children[name])["OMP_WAIT_POLICY"] == "PASSIVE"
    router = dep.child_env(dep.children["router"])
    assert "OMP_WAIT_POLICY" not in router and router == {**os.environ}
