"""Which device each model service of `specpipe up` runs on (docs/architecture.md,
"8. Deployment").

A stage or the draft holds one device. `--device cuda` (no index) means one GPU per
service: the k-th service that holds a model (the stages in pipeline order, each
stage's replicas together, then the draft) goes on `cuda:(k mod N)` of the N visible
GPUs, so two stages on two GPUs run side by side instead of time-sliced on one; with
fewer GPUs than services the round-robin says which share (`shared`). `--devices
D,D,...` names every service's device explicitly, in the same order; any other
`--device` (cpu, cuda:N) puts every service there. Services added later (`add_stage`,
`add_draft`) continue the same sequence.

Pure: the caller counts the GPUs (no torch here), so a test can plan any machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def one_per_gpu(device: str) -> bool:
    """Whether `device` asks for one GPU per service (`cuda` without an index)."""
    return device == "cuda"


@dataclass(frozen=True)
class Placement:
    """The device of every model service, by ordinal (`device_of`) and for the
    services planned at start (`devices`, name -> device, in start order)."""

    device: str  # the deployment's --device (already resolved: cpu, cuda, cuda:N)
    listed: tuple[str, ...] = ()  # --devices: one per planned service, in order
    gpus: int = 0  # visible GPUs (only read for one_per_gpu)
    names: tuple[str, ...] = ()  # the planned services, in order

    def __post_init__(self) -> None:
        if self.listed and len(self.listed) != len(self.names):
            raise ValueError(
                f"--devices lists {len(self.listed)} devices for {len(self.names)} services "
                f"({', '.join(self.names)}): give one per stage process, then the draft's"
            )
        if not self.listed and one_per_gpu(self.device) and self.gpus < 1:
            raise ValueError("--device cuda: no GPU is visible here (use --device cpu)")

    def device_of(self, k: int) -> str:
        """The device of the k-th model service (0-based; beyond the planned ones the
        sequence goes on: the listed devices again, or the next GPU)."""
        if self.listed:
            return self.listed[k % len(self.listed)]
        if one_per_gpu(self.device):
            return f"cuda:{k % self.gpus}"
        return self.device

    @property
    def devices(self) -> dict[str, str]:
        """The planned services' devices, in start order."""
        return {name: self.device_of(k) for k, name in enumerate(self.names)}

    def sharing(self, device: str) -> int:
        """How many planned services hold `device` (at least 1: a service added later
        shares it with them)."""
        return max(1, sum(1 for d in self.devices.values() if d == device))

    @property
    def shared(self) -> dict[str, list[str]]:
        """Accelerators that more than one planned service holds (time-sliced), with
        those services. The host's memory and cores are not counted: every CPU service
        shares them by design."""
        by_device: dict[str, list[str]] = {}
        for name, device in self.devices.items():
            by_device.setdefault(device, []).append(name)
        return {d: ns for d, ns in by_device.items() if d != "cpu" and len(ns) > 1}

    def report(self) -> list[str]:
        """Where each service went, one line each, then one line per shared GPU."""
        lines = [f"{name}: {device}" for name, device in self.devices.items()]
        for device, names in self.shared.items():
            why = (
                f"{self.gpus} GPU(s) for {len(self.names)} services"
                if one_per_gpu(self.device) and not self.listed
                else "as asked"
            )
            lines.append(f"{device} is shared by {', '.join(names)} ({why}): time-sliced")
        return lines


def plan(
    names: Sequence[str], device: str, devices: Sequence[str] = (), gpus: int = 0
) -> Placement:
    """The placement of the model services `names` (in start order) for `--device
    device` or `--devices devices`, on a machine with `gpus` visible GPUs."""
    return Placement(device, tuple(devices), gpus, tuple(names))
