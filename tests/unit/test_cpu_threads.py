"""How `specpipe up` gives the cores to its model processes (services/cpu_threads.py):
the stages the cores a deployment without a draft gives them, fewer while the draft
works (set on the compute thread before each forward), one thread for a small model,
passive OpenMP waits unless the caller chose."""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from pathlib import Path

import pytest
import torch
from specpipe.common.model.config import ModelConfig
from specpipe.services import cpu_threads
from specpipe.services.config import DeploymentConfig
from specpipe.services.cpu_threads import (
    DraftActivity,
    draft_threads,
    model_env,
    model_threads,
    publish,
    small_model,
    threads_with_draft,
)

# Qwen2.5-0.5B's shape (config.json): the real draft of bench_cores.py
QWEN_05B = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
    intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
)  # fmt: skip


def test_stages_share_the_cores_and_the_draft_gets_its_split() -> None:
    assert model_threads(None, 2) == 2 and model_threads(0, 16) == 16
    assert model_threads(1, 2) == 1 and model_threads(None, 0) == 1
    # several stage processes on one host work at once: the cores are shared
    assert model_threads(None, 2, stages=2) == 1 and model_threads(None, 16, stages=3) == 5
    assert model_threads(None, 2, stages=4) == 1 and model_threads(3, 2, stages=4) == 3
    # the draft: --draft-threads, else --threads, else its part of the split
    assert draft_threads(None, None, 16) == 16 and draft_threads(None, 2, 16) == 2
    assert draft_threads(4, 2, 16) == 4 and draft_threads(None, None, 0) == 1
    assert draft_threads(None, None, 2) == 2 and draft_threads(None, None, 16, stages=3) == 16
    # split while drafting (opt-in): the draft's part of the split
    assert draft_threads(None, None, 16, split=True) == 8
    assert draft_threads(None, None, 2, split=True) == 1
    assert draft_threads(None, None, 16, stages=3, split=True) == 4
    assert draft_threads(3, None, 16, split=True) == 3
    # a small model runs one thread unless told otherwise
    assert model_threads(None, 16, small=True) == 1 and model_threads(4, 16, small=True) == 4
    assert draft_threads(None, None, 16, small=True) == 1
    assert draft_threads(3, None, 16, small=True) == 3


def test_a_stage_runs_fewer_threads_while_the_draft_works_only_where_that_is_fewer() -> None:
    assert threads_with_draft(2, 1, 2) == 1 and threads_with_draft(16, 8, 16) == 8
    assert threads_with_draft(8, 4, 16, stages=2) == 6
    assert threads_with_draft(1, 1, 2) == 0  # one thread already: nothing to switch
    assert threads_with_draft(2, 2, 2) == 1  # the draft on every core: the stage keeps one


def test_only_a_small_model_is_small(llama_dir: Path) -> None:
    """The test Llama (a few thousand weights per row) runs one thread; Qwen2.5-0.5B (the
    real draft) and its stages do not."""
    assert small_model(ModelConfig.from_dir(llama_dir))
    qwen = ModelConfig.from_dict(QWEN_05B)
    assert cpu_threads.weights_per_row(qwen) > 400_000_000
    assert not small_model(qwen) and not small_model(qwen, stages=4)


def test_openmp_waits_are_passive_unless_the_environment_says_otherwise() -> None:
    assert model_env({"A": "1"}) == {"A": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    assert model_env({"OMP_WAIT_POLICY": "active"})["OMP_WAIT_POLICY"] == "active"
    assert "OMP_WAIT_POLICY" not in model_env({"OMP_WAIT_POLICY": ""})  # the runtime's own


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.fixture
def four_cores(monkeypatch):
    """A 4-core host whose models count as large (the tiny test models would run one
    thread each: nothing to split)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr("specpipe.services.launcher.small_model", lambda *a: False)


def test_the_launcher_gives_the_stage_its_share_while_the_draft_works(
    llama_dir: Path, four_cores
) -> None:
    """With a draft the stage keeps every core while the draft idles and the split while
    it works: both counts and the activity file on the stage's command line, the same
    file and a slot of its own on the draft's."""
    from specpipe.services.launcher import ServicesDeployment

    dep = ServicesDeployment(
        DeploymentConfig(
            target=llama_dir, draft="oracle", stages=1, split_cores_while_drafting=True
        )
    )
    dep.build()
    stage, draft = dep.children["stage0"].argv, dep.children["draft"].argv
    assert (_flag(stage, "--threads"), _flag(stage, "--threads-with-draft")) == ("4", "2")
    assert (_flag(draft, "--threads"), _flag(draft, "--activity-slot")) == ("2", "0")
    path = _flag(stage, "--draft-activity")
    assert path and path == _flag(draft, "--draft-activity") and Path(path).is_file()
    assert not DraftActivity(path).working()
    dep._draft_child("draft.1", dep.draft, "")
    assert _flag(dep.children["draft.1"].argv, "--activity-slot") == "1"


def test_fixed_threads_or_no_draft_switch_nothing(llama_dir: Path, four_cores) -> None:
    """`--threads N` is every process's count all along; without a draft, or with models
    so small they run one thread, there is nothing to switch."""
    from specpipe.services.launcher import ServicesDeployment

    split = dict(split_cores_while_drafting=True)
    for config in (
        DeploymentConfig(target=llama_dir, draft="oracle", stages=1, threads=3, **split),
        DeploymentConfig(target=llama_dir, draft="none", stages=1, **split),
    ):
        dep = ServicesDeployment(config)
        dep.build()
        stage = dep.children["stage0"].argv
        assert dep.threads_with_draft == 0 and dep.draft_activity is None
        assert _flag(stage, "--threads-with-draft") in (None, "0")
        assert "--draft-activity" not in stage
    fixed = ServicesDeployment(
        DeploymentConfig(target=llama_dir, draft="oracle", stages=1, draft_threads=1, **split)
    )
    assert (fixed.threads, fixed.draft_threads, fixed.threads_with_draft) == (4, 1, 3)


def test_by_default_every_process_gets_every_core_and_nothing_switches(
    llama_dir: Path, four_cores
) -> None:
    """Without --split-cores-while-drafting (measured faster on idle cores) the stage
    keeps its cores and the draft gets every core; no activity file is made."""
    from specpipe.services.launcher import ServicesDeployment

    dep = ServicesDeployment(DeploymentConfig(target=llama_dir, draft="oracle", stages=1))
    dep.build()
    stage, draft = dep.children["stage0"].argv, dep.children["draft"].argv
    assert (dep.threads, dep.draft_threads, dep.threads_with_draft) == (4, 4, 0)
    assert dep.draft_activity is None
    assert (_flag(stage, "--threads"), _flag(draft, "--threads")) == ("4", "4")
    assert "--draft-activity" not in stage and "--draft-activity" not in draft


def test_small_models_run_one_thread_and_switch_nothing(llama_dir: Path, monkeypatch) -> None:
    from specpipe.services.launcher import ServicesDeployment

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    dep = ServicesDeployment(DeploymentConfig(target=llama_dir, draft="oracle", stages=1))
    assert (dep.threads, dep.draft_threads, dep.threads_with_draft) == (1, 1, 0)


def test_several_stages_share_the_cores_as_without_a_draft(llama_dir: Path, four_cores) -> None:
    """Two stages on one host get the threads a deployment without a draft gives them
    while the draft idles; the draft a third of the cores."""
    from specpipe.services.launcher import ServicesDeployment

    with_draft = ServicesDeployment(
        DeploymentConfig(
            target=llama_dir, draft="oracle", stages=2, split_cores_while_drafting=True
        )
    )
    without = ServicesDeployment(DeploymentConfig(target=llama_dir, draft="none", stages=2))
    assert with_draft.threads == without.threads == 2
    assert (with_draft.draft_threads, with_draft.threads_with_draft) == (1, 1)


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


def test_the_draft_flag_follows_its_open_requests_and_goes_stale(tmp_path: Path) -> None:
    """A draft's slot says whether it holds requests (polled), idle once it stops; a flag
    not refreshed (a draft that died holding requests) stops counting."""
    path = DraftActivity.create(tmp_path / "activity")
    seen, held = DraftActivity(path), [0]
    stop = publish(path, 3, lambda: held[0])
    try:
        assert not seen.working()
        held[0] = 2
        assert _eventually(seen.working)
        held[0] = 0
        assert _eventually(lambda: not seen.working())
        held[0] = 1
        assert _eventually(seen.working)
    finally:
        stop.set()
    assert _eventually(lambda: not seen.working())
    DraftActivity(path).set(5, True)
    assert seen.working()
    dead = time.monotonic_ns() - cpu_threads.STALE_NS - 1
    import struct

    struct.pack_into("q", seen._map, 8 * 5, dead)
    assert not seen.working()


def _eventually(check, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_the_compute_thread_runs_its_forwards_on_the_share_while_the_draft_works(
    llama_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """A stage's rounds on one thread of their own (as its compute thread): each forward
    runs on 3 torch threads while no draft holds requests and on 1 while one does,
    `torch.get_num_threads()` read on that thread inside the forward; the tokens drawn
    are the same at both counts."""
    from specpipe.common.model.loading import load_stage
    from specpipe.common.model.partition import LayerRange
    from specpipe.common.runtime.loader import LoadedModel
    from specpipe.common.runtime.stage import StageRuntime
    from specpipe.services.stage_service import StageService

    from .test_compute_round import _frame, _open

    model = load_stage(llama_dir, LayerRange(2, 5, 5), torch.float32)
    activity = DraftActivity(DraftActivity.create(tmp_path / "activity"))
    follow = cpu_threads.stage_share(model, tmp_path / "activity", 3, 1)
    assert follow is not None
    counts: list[int] = []
    outputs = []
    tasks: queue.Queue = queue.Queue()

    def compute_thread() -> None:
        while (task := tasks.get()) is not None:
            task()

    async def rounds(working: list[bool]) -> None:
        # made inside the event loop (its gRPC server takes the running one)
        svc = StageService(LoadedModel(StageRuntime(model), "m", "h", 256, ()))
        svc.rounds.before_forward = follow
        run_step = svc.runtime.run_step

        def counted(step):
            counts.append(torch.get_num_threads())
            return run_step(step)

        monkeypatch.setattr(svc.runtime, "run_step", counted)
        hidden = torch.randn(1, model.cfg.hidden_size)
        for k, on in enumerate(working):
            activity.set(0, on)
            rid = f"r{k}"
            await _open(svc, rid)
            svc._on_frame(_frame(rid, hidden))
            done = threading.Event()
            work = svc.rounds._collect()

            def one(work=work, done=done) -> None:
                svc.rounds.compute(work)
                done.set()

            tasks.put(one)
            assert done.wait(30)
            outputs.append(work[0].outputs[0])

    thread = threading.Thread(target=compute_thread)
    thread.start()
    try:
        asyncio.run(rounds([False, True, True, False, True]))
    finally:
        tasks.put(None)
        thread.join()
    assert counts == [3, 1, 1, 3, 1]
    assert torch.get_num_threads() == 1  # this thread's own count never moved
    assert len({out[0].tokens for out in outputs}) == 1


def test_no_switch_where_the_bits_would_change(llama_dir: Path, monkeypatch) -> None:
    from specpipe.common.model.loading import load_stage

    model = load_stage(llama_dir, None, torch.float32)
    assert cpu_threads.same_bits_at(model, 2, 1)
    assert torch.get_num_threads() == 1
    assert cpu_threads.stage_share(model, None, 2, 1) is None  # no draft on this host
    monkeypatch.setattr(cpu_threads, "same_bits_at", lambda *a: False)
    assert cpu_threads.stage_share(model, "/nonexistent", 2, 1) is None
