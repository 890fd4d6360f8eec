"""Device memory on the data plane (docs/architecture.md, "6. Control plane and data
plane", "Device memory on the data plane"): whether a transport carries its GPU's
memory as it is (one decision, services/transport/device_memory.py); a stage's outputs handed to a
transport that does untouched (no host copy), and staged through host memory on the
compute thread for one that does not; UCX's send and receive buffers on each side.

GPUs are faked on the CPU: `OnGpu` is host memory that says it is on cuda:0 and records
every copy out of it. The real UCX-CUDA hop runs in its own process where CUDA and ucxx
exist (skipped otherwise)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import textwrap
import threading
from typing import ClassVar

import numpy as np
import pytest
import torch
from specpipe.services.transport import device_memory as dm
from specpipe.services.transport import ucx
from specpipe.services.transport.auth import FrameAuth
from specpipe.services.transport.base import Transport
from specpipe.services.transport.codec import encode
from specpipe.services.transport.device_memory import DeviceMemory
from specpipe.services.transport.tcp import TcpTransport
from specpipe.v1 import dataplane_pb2 as pb

GPU = torch.device("cuda", 0)


class OnGpu(torch.Tensor):
    """Host memory posing as cuda:0's; `copies` records (operation, thread) of every
    copy to the host or to another device."""

    copies: ClassVar[list[tuple[str, str]]] = []

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return GPU

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("cpu", "to", "numpy"):
            cls.copies.append((name, threading.current_thread().name))
            if name == "cpu":  # a real host copy, no longer posing
                with torch._C.DisableTorchFunctionSubclass():
                    return args[0].clone()
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.fixture
def on_gpu():
    OnGpu.copies = []
    return lambda t: t.as_subclass(OnGpu)


@pytest.fixture
def fake_cuda(monkeypatch) -> list[str]:
    """What the stage and the batch packer ask of CUDA (streams, events, syncs), logged."""
    log: list[str] = []

    class Stream:
        def __init__(self, device=None) -> None:
            pass

        def synchronize(self) -> None:
            log.append("sync the compute stream")

    class Event:
        def record(self, stream) -> None:
            log.append("record")

        def synchronize(self) -> None:
            log.append("wait for the side stream")

    @contextlib.contextmanager
    def stream(s):
        log.append("side stream")
        yield

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    from specpipe.services.transport import batch

    monkeypatch.setattr(batch, "_side_streams", {})
    return log


@pytest.fixture
def ucx_facts(monkeypatch):
    """The facts the decision reads, set by the test: UCX's CUDA module, CUDA, and a UCX
    not started yet in this process (UCX_TLS from the environment)."""

    def facts(module: bool = True, cuda: bool = True, tls: str | None = None) -> None:
        monkeypatch.setattr(dm, "cuda_module_loads", lambda: module)
        monkeypatch.setattr(dm, "cuda_module_error", lambda: None if module else "no CUDA module")
        monkeypatch.setattr(dm, "cuda_available", lambda: cuda)
        monkeypatch.setattr(ucx, "_initialized", False)
        if tls is None:
            monkeypatch.delenv("UCX_TLS", raising=False)
        else:
            monkeypatch.setenv("UCX_TLS", tls)

    return facts


# -- the decision ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tls", "moves"),
    [
        ("tcp", False),
        ("rc,tcp", False),
        ("rc,cuda_ipc", False),  # GPU to GPU, but nothing tells device memory from host
        ("tcp,cuda_copy", True),
        ("rc, cuda_copy ,cuda_ipc", True),
        ("cuda,tcp", True),
        ("all", True),
        ("^cuda_ipc", True),  # everything but cuda_ipc: cuda_copy is on
        ("^cuda_copy,rc", False),
        ("^cuda", False),
        ("", False),
    ],
)
def test_which_ucx_tls_moves_cuda_memory(tls: str, moves: bool) -> None:
    assert dm.tls_moves_cuda(tls) is moves


def _decided(device: str, secure: bool = False) -> DeviceMemory:
    """What a UCX transport on `device` says (it asks the one decision)."""
    key = FrameAuth(b"k" * 32) if secure else None
    return ucx.UcxTransport(lambda f: None, device=device, auth=key).device_memory


def test_ucx_carries_a_gpus_memory_only_when_every_fact_allows(ucx_facts) -> None:
    ucx_facts()
    got = _decided("cuda:0")
    assert got.carried and f"UCX_TLS={dm.CUDA_TLS}" in got.why  # the default on a GPU
    assert not _decided("cpu").carried
    for facts, secure, why in [
        ({}, True, "--secure"),
        ({"module": False}, False, "no CUDA module"),
        ({"cuda": False}, False, "CUDA is not available"),
        ({"tls": "tcp"}, False, "UCX_TLS=tcp enables no cuda_copy"),
    ]:
        ucx_facts(**facts)
        got = _decided("cuda:1", secure)
        assert not got.carried and why in got.why, (facts, got)
        assert got.why.startswith("payloads are staged through host memory")


def test_a_started_ucx_decides_with_the_tls_it_started_with(ucx_facts, monkeypatch) -> None:
    """UCX reads UCX_TLS once per process: what the environment says later changes
    nothing, and the decision says so."""
    ucx_facts(tls="tcp,cuda_copy")
    monkeypatch.setattr(ucx, "_initialized", True)
    monkeypatch.setattr(ucx, "_tls", "tcp")
    assert not _decided("cuda:0").carried
    monkeypatch.setattr(ucx, "_tls", "tcp,cuda_copy,cuda_ipc")
    assert _decided("cuda:0").carried


def test_the_default_ucx_tls_follows_the_device(ucx_facts) -> None:
    ucx_facts()
    assert dm.default_tls("cpu") == dm.HOST_TLS == "tcp"
    assert dm.default_tls("cuda:1") == dm.CUDA_TLS
    assert ucx.current_tls("cuda:1") == dm.CUDA_TLS  # what UCX would start with here
    ucx_facts(module=False)
    assert dm.default_tls("cuda:1") == "tcp"


def test_each_transport_says_what_it_carries(ucx_facts) -> None:
    ucx_facts()
    key = FrameAuth(b"k" * 32)
    assert not TcpTransport(lambda f: None, device="cuda:0").device_memory.carried
    assert ucx.UcxTransport(lambda f: None, device="cuda:0").device_memory.carried
    assert not ucx.UcxTransport(lambda f: None, device="cuda:0", auth=key).device_memory.carried
    for t in (TcpTransport(lambda f: None), ucx.UcxTransport(lambda f: None)):
        assert t.host_payloads and not t.device_memory.carried  # on the CPU


def test_ucx_takes_its_gpu_as_current_when_it_carries_its_memory(ucx_facts, monkeypatch) -> None:
    """UCX's CUDA transports copy in the context current on the thread that progresses
    them: starting a transport that carries device memory makes its GPU current there."""
    current: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)

    class Listener:
        port = 4242

    class Ucxx:
        @staticmethod
        def create_listener(handler, port):
            return Listener()

    monkeypatch.setattr(ucx, "_ucxx", lambda device="cpu": Ucxx)
    cases = [
        ("cuda:1", "tcp,cuda_copy", [torch.device("cuda", 1)]),
        ("cuda:1", "tcp", []),
        ("cuda", "tcp,cuda_copy", []),  # no index: the current GPU is the one
    ]
    for device, tls, want in cases:
        ucx_facts(tls=tls)
        current.clear()
        tx = ucx.UcxTransport(lambda f: None, device=device)
        assert asyncio.run(tx.start()) == "ucx://127.0.0.1:4242"
        assert current == want, (device, tls)


# -- a stage's outputs on their way to the transport --------------------------------------


class MemoryTransport(Transport):
    """A transport that keeps what it is handed (each frame's payload as it arrived)
    and says whether it carries its device's memory."""

    scheme = "mem"

    def __init__(self, carried: bool) -> None:
        super().__init__(lambda f: None, device="cuda:0")
        self.carried = carried
        self.sent: list[tuple[pb.FrameHeader, torch.Tensor | None]] = []

    @property
    def device_memory(self) -> DeviceMemory:
        return DeviceMemory(self.carried, "as the test says")

    async def start(self, port: int = 0) -> str:
        return self.address

    async def send_frame(self, address, header, payload=None) -> None:
        self.sent.append((header, payload))

    async def close(self) -> None:
        pass


def _stage_round(llama_dir, transport: MemoryTransport, requests: list[str], on_gpu):
    """One compute round of a CPU stage (layers 0:2) whose forward outputs pose as on
    cuda:0, sending to `transport`: (the forward's outputs, the frames sent)."""
    from specpipe.common.runtime.loader import load_model
    from specpipe.common.runtime.ordering import Pending
    from specpipe.common.spec.messages import Activation
    from specpipe.services.compute_round import StageRequest, Work
    from specpipe.services.stage_service import StageService

    made: list[torch.Tensor] = []

    async def main():
        svc = StageService(load_model(llama_dir, (0, 2)), transport_kind="tcp")
        try:
            svc.transport = transport
            rt = svc.runtime
            forward = rt.run_step

            def forward_on_gpu(step):
                outs = forward(step)
                for o in outs:
                    o.hidden = on_gpu(o.hidden)
                    made.append(o.hidden)
                return outs

            rt.run_step = forward_on_gpu
            work = []
            for i, r in enumerate(requests):
                rt.open(r, 8)
                act = Activation(r, torch.tensor([0, 1]), committed=True,
                                 tokens=torch.tensor([5 + i, 9]))  # fmt: skip
                st = StageRequest(r, next_hop="mem://127.0.0.1:9", report_to="")
                work.append(Work(st, prunes=[], turns=[(0, Pending(act, 0))]))
            # off the event loop, as the compute thread runs it, then delivered
            await asyncio.get_running_loop().run_in_executor(None, svc.rounds.compute, work)
            await svc.rounds._delivered(work, None)
            assert all(w.error is None for w in work)
        finally:
            await svc.stop()

    asyncio.run(main())
    return made, transport.sent


def test_a_transport_that_carries_device_memory_gets_the_outputs_untouched(
    llama_dir, on_gpu, fake_cuda
) -> None:
    """One request: the payload the transport is handed is the forward's output itself
    (the same tensor, on the device; nothing copied to the host), and the compute stream
    was synchronized on the compute thread before it left."""
    made, sent = _stage_round(llama_dir, MemoryTransport(carried=True), ["r"], on_gpu)
    ((_, payload),) = sent
    assert payload is made[0] and payload.device == GPU
    assert OnGpu.copies == []
    assert fake_cuda == ["sync the compute stream"]


def test_a_batch_of_device_payloads_is_joined_on_the_device(llama_dir, on_gpu, fake_cuda) -> None:
    """Two requests to one hop: one batch frame, its payload concatenated on the device
    on a side stream that is waited for; still no host copy."""
    made, sent = _stage_round(llama_dir, MemoryTransport(carried=True), ["a", "b"], on_gpu)
    ((header, payload),) = sent
    assert header.kind == pb.PAYLOAD_KIND_BATCH and len(header.parts) == 2
    assert isinstance(payload, OnGpu) and OnGpu.copies == []
    torch.testing.assert_close(payload.as_subclass(torch.Tensor),
                               torch.cat([m.as_subclass(torch.Tensor) for m in made]))  # fmt: skip
    assert fake_cuda[-3:] == ["side stream", "record", "wait for the side stream"]


def test_a_host_only_transport_gets_host_copies_made_on_the_compute_thread(
    llama_dir, on_gpu, fake_cuda
) -> None:
    made, sent = _stage_round(llama_dir, MemoryTransport(carried=False), ["r"], on_gpu)
    ((_, payload),) = sent
    assert type(payload) is torch.Tensor and payload.device.type == "cpu"
    torch.testing.assert_close(payload, made[0].as_subclass(torch.Tensor))
    ((op, thread),) = OnGpu.copies
    assert op == "cpu" and thread != "MainThread"  # off the event loop (its thread)
    assert fake_cuda == []  # a host copy waits for the device by itself


# -- UCX's buffers -----------------------------------------------------------------------


class Endpoint:
    """A UCX endpoint that keeps what is sent, and delivers `incoming` messages."""

    closed = False

    def __init__(self, incoming: list[bytes] = ()) -> None:
        self.sent: list[object] = []
        self.incoming = list(incoming)

    async def send(self, buf) -> None:
        self.sent.append(buf)

    async def recv(self, buf) -> None:
        data = self.incoming.pop(0)
        if isinstance(buf, torch.Tensor):
            with torch._C.DisableTorchFunctionSubclass():
                buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        else:
            buf[:] = np.frombuffer(data, dtype=np.uint8)


def _frame(payload: torch.Tensor) -> tuple[pb.FrameHeader, torch.Tensor]:
    from specpipe.common.spec.messages import Activation

    act = Activation("r", torch.tensor([0, 1]), committed=True, hidden=payload)
    header, _ = encode(act, seq=0)
    return header, payload


@pytest.mark.parametrize("carried", [True, False])
def test_ucx_sends_device_payloads_from_the_device_or_from_a_host_copy(
    carried, ucx_facts, on_gpu
) -> None:
    ucx_facts(tls="tcp,cuda_copy" if carried else "tcp")
    tx = ucx.UcxTransport(lambda f: None, device="cuda:0")
    ep = Endpoint()

    async def endpoint(address):
        return ep, None, False

    tx._endpoint = endpoint
    hidden = on_gpu(torch.arange(8, dtype=torch.float32).reshape(2, 4))
    header, payload = _frame(hidden)
    asyncio.run(tx.send_frame("ucx://127.0.0.1:9", header, payload))
    pre, _, buf = ep.sent
    assert int(pre[1]) == 32
    if carried:  # the device buffer itself: UCX reads it
        assert isinstance(buf, OnGpu) and buf.data_ptr() == hidden.data_ptr()
        assert OnGpu.copies == []
    else:  # a host copy's bytes
        assert isinstance(buf, np.ndarray)
        assert [op for op, _ in OnGpu.copies] == ["cpu"]
    assert bytes(np.asarray(buf.as_subclass(torch.Tensor) if carried else buf)) == (
        torch.arange(8, dtype=torch.float32).numpy().tobytes()
    )


@pytest.mark.parametrize("carried", [True, False])
def test_ucx_receives_into_its_device_when_it_carries_device_memory(
    carried, ucx_facts, on_gpu, monkeypatch
) -> None:
    """A kept payload is received into a buffer on the transport's GPU (faked: the
    allocation asked for cuda:0 poses as one), so the stage gets it there; a host-only
    transport, or a dropped frame, receives into host memory."""
    ucx_facts(tls="tcp,cuda_copy" if carried else "tcp")
    asked: list[object] = []
    empty = torch.empty

    def device_empty(*shape, dtype=None, device=None):
        asked.append(device)
        t = empty(*shape, dtype=dtype)
        return on_gpu(t) if device is not None else t

    monkeypatch.setattr(torch, "empty", device_empty)
    rx = ucx.UcxTransport(lambda f: None, device="cuda:0")
    want = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    header, _ = _frame(want)
    hbytes = header.SerializeToString()
    ep = Endpoint([hbytes, want.numpy().tobytes()])
    pre = np.array([len(hbytes), 32], dtype=np.uint64)
    frame, keep = asyncio.run(rx._rest_of_frame(ep, pre, None))
    assert keep
    assert frame.payload.device.type == ("cuda" if carried else "cpu")
    assert asked == (["cuda:0"] if carried else [])
    torch.testing.assert_close(frame.payload.as_subclass(torch.Tensor), want)
    assert isinstance(rx._receive_buffer(32, keep=False), np.ndarray)  # dropped: host


def test_tcp_always_stages(on_gpu) -> None:
    tx = TcpTransport(lambda f: None, device="cuda:0")
    hidden = on_gpu(torch.ones(2, 4))
    staged = tx.staged(hidden)
    assert type(staged) is torch.Tensor and [op for op, _ in OnGpu.copies] == ["cpu"]
    host = torch.ones(3)
    assert tx.staged(host) is host


# -- the real thing ----------------------------------------------------------------------

REAL_HOP = textwrap.dedent(
    """
    import asyncio, sys, torch
    from specpipe.services.transport import Inbox, ucx
    from specpipe.services.transport.codec import encode
    from specpipe.common.spec.messages import Activation

    def no_host_copy(self, *a, **k):
        raise AssertionError("a payload was copied to the host")

    async def main():
        gpus = torch.cuda.device_count()
        inbox = Inbox()
        q = inbox.open("r")
        rx = ucx.UcxTransport(inbox, device=f"cuda:{min(1, gpus - 1)}")
        tx = ucx.UcxTransport(lambda f: None, device="cuda:0")
        for t in (rx, tx):
            assert t.device_memory.carried, t.device_memory.why
        address = await rx.start()
        hidden = torch.randn(5, 64, device="cuda:0", dtype=torch.float32)
        header, payload = encode(Activation("r", torch.arange(5), committed=True, hidden=hidden), 0)
        cpu = torch.Tensor.cpu
        torch.Tensor.cpu = no_host_copy
        try:
            torch.cuda.current_stream(hidden.device).synchronize()
            await tx.send_frame(address, header, payload)
            frame = await asyncio.wait_for(q.get(), 30)
        finally:
            torch.Tensor.cpu = cpu
        assert frame.payload.device == torch.device(rx.device), frame.payload.device
        assert torch.equal(frame.payload.to("cuda:0"), hidden)
        await tx.close(); await rx.close()
        print("OK", tx.device, "->", rx.device, ucx._tls)

    asyncio.run(main())
    """
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not ucx.available(), reason="needs ucxx")
def test_a_real_ucx_hop_keeps_hidden_states_on_the_gpus() -> None:
    """In a fresh process (UCX starts with the GPU default UCX_TLS): a frame from
    cuda:0 arrives in a buffer on the receiver's GPU (cuda:1 where there are two) with
    no host copy on either side."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "UCX_TLS"}
    proc = subprocess.run([sys.executable, "-c", REAL_HOP], capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


def test_the_base_transport_stages_by_default() -> None:
    assert dm.HOST_ONLY.carried is False
    assert MemoryTransport(carried=False).host_payloads
    assert not MemoryTransport(carried=True).host_payloads


# -- UCX's CUDA module: loaded, not only found ------------------------------------------


def test_the_cuda_module_counts_only_if_it_loads(monkeypatch, tmp_path) -> None:
    """A libuct_cuda that is on disk but does not load (built for another CUDA, or no
    driver) is reported with the loader's reason; one that loads counts."""
    import ctypes.util
    import shutil

    monkeypatch.setitem(sys.modules, "libucx", None)  # only UCX_MODULE_DIR is searched
    monkeypatch.setenv("UCX_MODULE_DIR", str(tmp_path))
    dm.cuda_module_error.cache_clear()
    try:
        assert dm.cuda_module_error() == "this UCX has no CUDA module (libuct_cuda)"
        dm.cuda_module_error.cache_clear()
        (tmp_path / "libuct_cuda.so.0").write_bytes(b"not an ELF file")
        why = dm.cuda_module_error()
        assert why is not None and why.startswith("UCX's CUDA module does not load")
        assert not dm.cuda_module_loads()
        memory = dm.ucx_device_memory("cuda:0", secure=False, tls=dm.CUDA_TLS)
        assert not memory.carried and "does not load" in memory.why
        libm = ctypes.util.find_library("m")
        real = next(
            (p for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64")
             if libm and os.path.exists(p := os.path.join(d, libm))),
            None,
        )  # fmt: skip
        if real is None:
            pytest.skip("no libm on disk to stand in for a loadable module")
        shutil.copy(real, tmp_path / "libuct_cuda.so.0")
        dm.cuda_module_error.cache_clear()
        assert dm.cuda_module_error() is None and dm.cuda_module_loads()
    finally:
        dm.cuda_module_error.cache_clear()
