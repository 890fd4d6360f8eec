"""Which reads of device memory a block of code makes, found on a CPU (tests).

On an accelerator a read of device memory from the host (`.item()`, `.tolist()`,
`.cpu()`, a tensor's truth value, `nonzero`, a boolean-mask index) waits for the
device's queue: in the serving path it belongs only where an output is handed on. On a
CPU every tensor is host memory, so `DeviceReads` tells them apart by taint: the model's
parameters, the KV pool, what the code copies to the device (`.to(..., non_blocking=
True)`, `paged_batch.to_device`) or creates there (`device=`), and everything computed
from those, are device memory; reads of them are recorded under the current `phase`.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
         "nonzero", "argwhere", "equal", "allclose", "masked_select", "unique"}  # fmt: skip
_MARK = "_device_memory"


def _tensors(*trees) -> list[torch.Tensor]:
    return [x for x in tree_leaves(list(trees)) if isinstance(x, torch.Tensor)]


def _marked(t: torch.Tensor) -> bool:
    return getattr(t, _MARK, False)


def _mark(tensors: Iterable[torch.Tensor]) -> None:
    for t in tensors:
        with contextlib.suppress(AttributeError, RuntimeError):  # e.g. no __dict__
            setattr(t, _MARK, True)


class DeviceReads(TorchFunctionMode):
    """Records (phase, operation, where) of every read of device memory in its block."""

    def __init__(self, device_memory: Iterable[torch.Tensor]) -> None:
        super().__init__()
        _mark(device_memory)
        self.phase = ""
        self.reads: list[tuple[str, str, str]] = []

    def in_phase(self, phase: str) -> list[tuple[str, str, str]]:
        return [r for r in self.reads if r[0] == phase]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        inputs = _tensors(args, kwargs)
        tainted = any(_marked(t) for t in inputs)
        if self._reads(name, args, inputs):
            self.reads.append((self.phase, name, _where()))
        out = func(*args, **kwargs)
        made_there = (name == "to" and kwargs.get("non_blocking")) or "device" in kwargs
        if tainted or made_there:
            _mark(_tensors(out))
            if name.endswith("_") and args and isinstance(args[0], torch.Tensor):
                _mark([args[0]])  # written in place from device memory
        return out

    @staticmethod
    def _reads(name: str, args, inputs: list[torch.Tensor]) -> bool:
        if name in READS:
            return bool(args) and isinstance(args[0], torch.Tensor) and _marked(args[0])
        if name == "__getitem__":  # a boolean mask from the device: its count is read
            return any(_marked(t) and t.dtype == torch.bool for t in inputs[1:])
        return False


def _where() -> str:
    """The innermost frame of specpipe code that made the read."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/tests/" not in frame.filename and "torch" not in frame.filename:
            return f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno} {frame.name}"
    return "?"
