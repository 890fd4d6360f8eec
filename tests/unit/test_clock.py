"""Timers of device work wait for the device at both ends (common/perf/clock.py)."""

from __future__ import annotations

import torch
from specpipe.common.perf import clock
from specpipe.common.perf.clock import device_timer


def test_cuda_timer_synchronizes_before_and_after(monkeypatch) -> None:
    events: list[str] = []
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda device=None: events.append(f"sync {device}")
    )
    with device_timer("cuda:1") as elapsed:
        events.append("work")
    assert events == ["sync cuda:1", "work", "sync cuda:1"]
    assert elapsed.seconds >= 0.0


def test_cpu_timer_never_touches_cuda(monkeypatch) -> None:
    def fail(device=None) -> None:
        raise AssertionError("synchronized a CUDA device for CPU work")

    monkeypatch.setattr(torch.cuda, "synchronize", fail)
    with device_timer(torch.device("cpu")) as elapsed:
        sum(range(1000))
    assert elapsed.seconds > 0.0
    clock.synchronize("meta")  # other devices: nothing to wait for


def test_stage_cost_measurement_times_the_device(monkeypatch, llama_dir) -> None:
    """--measure-costs and the auto settings time forwards with the device timer."""
    from specpipe.common.model.loading import load_stage
    from specpipe.common.model.partition import LayerRange
    from specpipe.common.perf import cost_model
    from specpipe.common.runtime.stage import StageRuntime

    devices = []

    def timer(device):
        devices.append(torch.device(device))
        return device_timer(device)

    monkeypatch.setattr(cost_model, "device_timer", timer)
    rt = StageRuntime(load_stage(llama_dir, LayerRange(0, 2, 5), torch.float64, "cpu"))
    curve = cost_model.measure_runtime(rt, rows=(1, 4), context=8, repeats=1)
    assert devices and all(d.type == "cpu" for d in devices)
    assert len(curve.seconds) == 2
