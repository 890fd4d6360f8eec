"""`--device` of the stage and draft services: validation (one-line error, exit 2) and,
where CUDA exists, the engine and a stage's outputs on a GPU (skipped on machines without
one). Whether the data plane carries GPU memory: tests/unit/test_transport_device.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from specpipe.services.modelinfo import resolve_device

from specpipe.cli import main

CUDA = torch.cuda.is_available()


def test_resolve_device_without_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == "cpu"
    assert resolve_device(" CPU ") == "cpu"
    for spec in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="needs CUDA"):
            resolve_device(spec)
    for spec in ("tpu", "gpu", "cuda:x", "cuda:", "", "mps"):
        with pytest.raises(ValueError, match="unknown device"):
            resolve_device(spec)


def test_resolve_device_with_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == "cuda"
    assert resolve_device("cuda") == "cuda"
    assert resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(ValueError, match="2 GPU"):
        resolve_device("cuda:2")


@pytest.mark.parametrize(
    "argv",
    [
        ["stage", "--insecure", "--layers", "0:2", "--device", "tpu"],
        ["draft", "--insecure", "--device", "cuda:x"],
        ["up", "--draft", "oracle", "--device", "nope"],
        ["generate", "--prompt-ids", "1,2", "--device", "gpu"],
        *(
            []
            if CUDA
            else [
                ["stage", "--insecure", "--device", "cuda"],
                ["draft", "--insecure", "--device", "cuda:0"],
                ["generate", "--prompt-ids", "1,2", "--device", "cuda"],
            ]
        ),
    ],
)
def test_bad_device_is_one_line_and_exit_2(argv, llama_dir, capsys) -> None:
    flag = "--target" if argv[0] in ("up", "generate") else "--model"
    code = main([*argv, flag, str(llama_dir)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("specpipe: error: --device:") and err.count("\n") == 1, err


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_stages_on_cuda_match_cpu(llama_dir) -> None:
    """Two stages with model and caches on the GPU: prefill, a tree layer, a prune
    (index_select on device K/V) and a late activation whose device hidden states a prune
    filters; the final hidden states are the CPU's."""
    from specpipe.common.model.loading import load_stage
    from specpipe.common.model.partition import LayerRange
    from specpipe.common.runtime.stage import StageRuntime
    from specpipe.common.spec.messages import Activation, Prune

    t = torch.tensor
    outs = {}
    for device in ("cpu", "cuda"):
        a, b = (
            StageRuntime(load_stage(llama_dir, LayerRange(x, y, 5), torch.float32, device))
            for x, y in ((0, 2), (2, 5))
        )
        for s in (a, b):
            s.open("r", 32)
        b.forward(a.forward(Activation("r", t([0, 1]), committed=True, tokens=t([5, 9]))))
        tree = Activation("r", t([2, 3, 3]), node_ids=t([0, 1, 2]), parent_ids=t([-1, 0, 0]),
                          tokens=t([13, 7, 8]))  # fmt: skip
        first = b.forward(a.forward(tree))
        late = a.forward(Activation("r", t([4, 4]), node_ids=t([3, 4]), parent_ids=t([1, 2]),
                                    tokens=t([11, 12])))  # fmt: skip
        assert late.hidden.device.type == torch.device(device).type
        for s in (a, b):
            s.prune("r", Prune(t([0]), t([1, 3]), horizon=4))
        second = b.forward(late)  # node 4 was pruned while in flight
        assert second.node_ids.tolist() == [3]
        outs[device] = (first.hidden.cpu(), second.hidden.cpu())
    for x, y in zip(outs["cpu"], outs["cuda"], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


ON_EVERY_DEVICE = pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA device"))],
)


@ON_EVERY_DEVICE
def test_a_stage_round_sends_outputs_from_host_memory_over_tcp(llama_dir, device) -> None:
    """The stage's compute round (`ComputeRounds.compute`: a list of work items in, the
    forward's seconds out) with the model on `device`: over TCP every output it makes
    ready to send is in host memory (copied on the compute thread, not on the event
    loop), and the hidden states are the runtime's."""
    from specpipe.common.model.loading import load_stage
    from specpipe.common.model.partition import LayerRange
    from specpipe.common.runtime.loader import load_model
    from specpipe.common.runtime.ordering import Pending
    from specpipe.common.runtime.stage import StageRuntime
    from specpipe.common.spec.messages import Activation
    from specpipe.services.compute_round import StageRequest, Work
    from specpipe.services.stage_service import StageService

    t = torch.tensor

    def prompt() -> Activation:
        return Activation("r", t([0, 1]), committed=True, tokens=t([5, 9]))

    async def main() -> None:  # gRPC's asyncio server needs a running loop
        svc = StageService(load_model(llama_dir, (0, 2), device=device), transport_kind="tcp")
        try:
            assert svc.transport.host_payloads
            rt = svc.runtime
            assert rt.model.device.type == device
            rt.open("r", 8)
            st = StageRequest("r", next_hop="tcp://127.0.0.1:9", report_to="")
            work = Work(st, prunes=[], turns=[(0, Pending(prompt(), 0))])
            seconds = svc.rounds.compute([work])
            assert work.error is None and seconds is not None and seconds >= 0.0
            (out,) = work.outputs
            assert out.hidden.device.type == "cpu"
            ref = StageRuntime(load_stage(llama_dir, LayerRange(0, 2, 5), torch.float32, "cpu"))
            ref.open("r", 8)
            # fp32 on a GPU reduces in other orders than the CPU (as in the test above)
            want = ref.forward(prompt()).hidden
            torch.testing.assert_close(out.hidden, want, rtol=1e-4, atol=1e-4)
        finally:
            await svc.stop()

    asyncio.run(main())
