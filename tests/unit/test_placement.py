"""`specpipe up --device cuda`: one GPU per stage and the draft (services/placement.py),
the `--device` each child is started with, its cache share, and what `up` prints. GPUs
are faked (`torch.cuda.device_count`); no process is started."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from specpipe.services.config import DeploymentConfig, DraftConfig, StageConfig
from specpipe.services.placement import plan

from specpipe.cli import build_parser, main

SERVICES = ["stage0", "stage1", "draft"]


@pytest.fixture
def gpus(monkeypatch):
    """A machine with `n` visible GPUs, as torch tells it (nothing runs on them)."""

    def visible(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return visible


def test_one_gpu_per_service_round_robin() -> None:
    p = plan(SERVICES, "cuda", gpus=4)
    assert p.devices == {"stage0": "cuda:0", "stage1": "cuda:1", "draft": "cuda:2"}
    assert p.shared == {}
    assert p.report() == ["stage0: cuda:0", "stage1: cuda:1", "draft: cuda:2"]
    assert p.device_of(3) == "cuda:3" and p.device_of(4) == "cuda:0"  # added later


def test_fewer_gpus_than_services_says_which_share() -> None:
    p = plan(SERVICES, "cuda", gpus=2)
    assert p.devices == {"stage0": "cuda:0", "stage1": "cuda:1", "draft": "cuda:0"}
    assert p.shared == {"cuda:0": ["stage0", "draft"]}
    assert p.sharing("cuda:0") == 2 and p.sharing("cuda:1") == 1
    assert p.report()[-1] == (
        "cuda:0 is shared by stage0, draft (2 GPU(s) for 3 services): time-sliced"
    )
    one = plan(SERVICES, "cuda", gpus=1)
    assert set(one.devices.values()) == {"cuda:0"}
    assert one.shared == {"cuda:0": SERVICES}


def test_replicas_of_a_stage_take_the_next_gpus() -> None:
    names = ["stage0", "stage0.1", "stage1", "stage1.1"]
    assert list(plan(names, "cuda", gpus=4).devices.values()) == [
        "cuda:0", "cuda:1", "cuda:2", "cuda:3",
    ]  # fmt: skip


def test_one_named_device_or_the_cpu_holds_every_service() -> None:
    p = plan(SERVICES, "cuda:1", gpus=0)
    assert set(p.devices.values()) == {"cuda:1"}
    assert p.report()[-1].startswith("cuda:1 is shared by stage0, stage1, draft (as asked)")
    cpu = plan(SERVICES, "cpu")
    assert set(cpu.devices.values()) == {"cpu"} and cpu.shared == {}
    assert cpu.sharing("cpu") == 3  # their KV caches share the host's memory


def test_an_explicit_list_names_every_service() -> None:
    p = plan(SERVICES, "cpu", devices=["cuda:1", "cuda:0", "cuda:1"])
    assert p.devices == {"stage0": "cuda:1", "stage1": "cuda:0", "draft": "cuda:1"}
    assert p.shared == {"cuda:1": ["stage0", "draft"]}
    with pytest.raises(ValueError, match="lists 2 devices for 3 services"):
        plan(SERVICES, "cpu", devices=["cuda:0", "cuda:1"])
    with pytest.raises(ValueError, match="no GPU is visible"):
        plan(SERVICES, "cuda", gpus=0)


def _children(llama_dir: Path, **kw) -> dict[str, StageConfig | DraftConfig]:
    """The configurations `specpipe up` would start its stages and draft with, read
    back from each child's command line."""
    from specpipe.services.launcher import ServicesDeployment

    config = DeploymentConfig(target=llama_dir, draft="oracle", stages=2, secure=False, **kw)
    dep = ServicesDeployment(config)
    try:
        parse = build_parser().parse_args
        out = {}
        for name, child in dep.build().items():
            kind = {"stage": StageConfig, "draft": DraftConfig}.get(child.kind)
            if kind is not None:
                out[name] = kind.from_args(parse(child.argv[child.argv.index(child.kind) :]))
                assert child.info["device"] == out[name].device
        return out
    finally:
        dep.stop()


def test_up_starts_each_stage_on_its_own_gpu(llama_dir: Path, gpus) -> None:
    """Two GPUs, two stages and a draft: stage i on cuda:i, the draft on cuda:0 beside
    stage 0 (before, every child got `--device cuda`: all three on GPU 0). A service
    alone on its GPU gets the whole cache fraction of it; two on one split it."""
    gpus(2)
    got = _children(llama_dir, device="cuda")
    assert {n: c.device for n, c in got.items()} == {
        "stage0": "cuda:0", "stage1": "cuda:1", "draft": "cuda:0",
    }  # fmt: skip
    assert got["stage1"].cache_fraction == pytest.approx(0.8)
    assert got["stage0"].cache_fraction == got["draft"].cache_fraction == pytest.approx(0.4)
    gpus(3)
    got = _children(llama_dir, device="cuda", stage_replicas=(2, 1))
    assert [c.device for c in got.values()] == ["cuda:0", "cuda:1", "cuda:2", "cuda:0"]


def test_up_takes_a_list_of_devices_and_cpu_as_before(llama_dir: Path, gpus) -> None:
    gpus(2)
    got = _children(llama_dir, devices=("cuda:1", "cuda:1", "cuda:0"))
    assert [c.device for c in got.values()] == ["cuda:1", "cuda:1", "cuda:0"]
    got = _children(llama_dir)
    assert {c.device for c in got.values()} == {"cpu"}
    assert [c.cache_fraction for c in got.values()] == [round(0.8 / 3, 4)] * 3


def test_up_prints_where_each_service_went(llama_dir: Path, gpus, monkeypatch, capsys) -> None:
    """Each service's device, the GPUs they share, and how hidden states will cross
    between the GPUs (staged through host memory over TCP, with a hint)."""
    from specpipe.services import launcher
    from specpipe.services.transport import device_memory

    monkeypatch.setattr(device_memory, "cuda_module_loads", lambda: True)
    monkeypatch.delenv("UCX_TLS", raising=False)

    def start(self) -> str:  # stop before any process starts
        self.stop()
        raise launcher.LaunchError("not starting in a test")

    monkeypatch.setattr(launcher.ServicesDeployment, "start", start)
    gpus(2)
    argv = ["up", "--target", str(llama_dir), "--draft", "oracle", "--insecure"]
    assert main([*argv, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    for line in ("stage0: cuda:0", "stage1: cuda:1", "draft: cuda:0",
                 "cuda:0 is shared by stage0, draft (2 GPU(s) for 3 services)",
                 "data plane tcp: payloads are staged through host memory (--transport ucx "
                 "--insecure keeps them on the GPUs)"):  # fmt: skip
        assert f"  {line}" in err, err
    assert main([*argv, "--devices", "cuda:1,cuda:0,cuda:1", "--transport", "ucx"]) == 2
    err = capsys.readouterr().err
    assert "  stage0: cuda:1\n  stage1: cuda:0\n  draft: cuda:1\n" in err, err
    assert "  data plane ucx: cuda:1 buffers go as they are (UCX_TLS=tcp,cuda_copy,cuda_ipc)" in err
    assert main([*argv[:-1], "--device", "cuda", "--transport", "ucx"]) == 2  # secure
    err = capsys.readouterr().err
    assert "data plane ucx: payloads are staged through host memory: --secure frames" in err
    assert main(["up", "--target", str(llama_dir), "--insecure"]) == 2
    assert "  data plane tcp: host memory\n" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (["--devices", "cuda:0,cuda:1"], "--devices lists 2 devices for 3 services"),
        (["--devices", "cuda:0,cuda:7,cuda:1"], "--device: device 'cuda:7': this machine has 2"),
        (["--devices", "cuda:0,gpu,cpu"], "--device: unknown device 'gpu'"),
    ],
)
def test_a_bad_device_list_is_one_line_and_exit_2(llama_dir, gpus, capsys, extra, why) -> None:
    gpus(2)
    argv = ["up", "--target", str(llama_dir), "--draft", "oracle", "--insecure", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specpipe: error: {why}") and err.count("\n") == 1, err


def test_device_and_devices_exclude_each_other(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["up", "--target", "t", "--device", "cuda", "--devices", "cpu"])
    assert e.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
