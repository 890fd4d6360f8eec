"""What this machine's kernels were found to do, kept on disk between processes.

The batch-invariance check of a linear shape (`batch_invariant.linear_rows_invariant`)
runs the layer some 50-100 times: 3.3 CPU seconds for Qwen2.5-1.5B's five shapes (2.4
of them its 152k-row head), against 10 seconds to load the model, on every start of
every stage. Its answer depends only on the kernels torch picks for the shape on this
CPU, so it is kept per machine: a record keyed by torch's version, the CPU (its model
name, instruction-set flags and the capability torch dispatches to) and the shape.

`$SPECPIPE_KERNEL_CHECKS` names the file (empty: keep nothing on disk); by default it
sits in the per-user cache directory. A record that cannot be read is treated as empty
and one that cannot be written is skipped with a debug line: checking again is only
slower.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

KERNEL_CHECKS_ENV = "SPECPIPE_KERNEL_CHECKS"


def record_path() -> Path | None:
    """The record's file, None where the environment turns it off."""
    env = os.environ.get(KERNEL_CHECKS_ENV)
    if env is not None:
        return Path(env).expanduser() if env else None
    import platformdirs

    return Path(platformdirs.user_cache_dir("specpipe")) / "kernel-checks.json"


# Settings of the math libraries that can change which kernel a shape gets
KERNEL_ENV_PREFIXES = ("ONEDNN_", "DNNL_", "MKL_", "OMP_", "KMP_", "ATEN_", "TORCH_BLAS")


@functools.cache
def machine_key() -> str:
    """torch's version, the CPU's identity and the math libraries' settings from the
    environment: the kernels a shape gets depend on all of them."""
    model, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name":
                model = value.strip()
            elif name.strip() == "flags":
                flags = " ".join(sorted(value.split()))
            if model and flags:
                break
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    settings = sorted((k, v) for k, v in os.environ.items() if k.startswith(KERNEL_ENV_PREFIXES))
    digest = hashlib.sha256(f"{model}|{flags}|{settings}".encode()).hexdigest()[:16]
    return f"torch {torch.__version__}|{capability}|{digest}"


def _read(path: Path) -> dict[str, bool]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, bool)}


def recorded(check: str) -> bool | None:
    """The recorded answer of `check` on this machine, None if never recorded."""
    path = record_path()
    return None if path is None else _read(path).get(f"{machine_key()}|{check}")


def record(check: str, answer: bool) -> None:
    """Keep `answer` for `check` on this machine (atomically: concurrent writers each
    leave a whole file, the last one's)."""
    path = record_path()
    if path is None:
        return
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read(path)
        data[f"{machine_key()}|{check}"] = answer
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".kernel-checks-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        log.debug("kernel check %s not recorded in %s: %s", check, path, e)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
