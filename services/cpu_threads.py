"""How many torch threads each model process of `specpipe up` runs, and how its OpenMP
threads wait: the one place that decides (`services/launcher.py` applies it).

Every model process (each stage, the draft) may use every core, and its OpenMP threads
wait passively (`OMP_WAIT_POLICY=PASSIVE`: a thread with nothing to do sleeps at once
instead of spinning on its core). Before, the cores were split evenly between the
processes (one thread each on a 2-core host with a draft), so when the router's tuner
settled on no draft the stage decoded on one thread beside an idle draft: about 300 ms
per token against 180 ms for the same stage deployed without a draft (benchmarks/
README.md, "Session 45: defaults that never lose on real models"). With every core to
every process an idle draft costs the stage nothing, and where the draft works, the
stage's and the draft's forwards share the cores as the kernel schedules them; passive
waits keep a process between its parallel regions from burning the core the other one
needs (libgomp's default spins for a while first). Measured there, on 2 cores:
the tuner's choices, time per token and CPU seconds per token against the split.

`--threads N` still fixes N threads per process; an `OMP_WAIT_POLICY` in the caller's
environment wins over the passive default (empty: the OpenMP runtime's own default).
"""

from __future__ import annotations

from collections.abc import Mapping

WAIT_POLICY = "OMP_WAIT_POLICY"
PASSIVE = "PASSIVE"


def model_threads(given: int | None, cpus: int) -> int:
    """Torch threads of each stage and draft process: `given` (--threads), else every
    core."""
    return given or max(1, cpus)


def draft_threads(given: int | None, stage_threads: int) -> int:
    """Torch threads of the draft process: `given` (--draft-threads), else the stages'."""
    return given or stage_threads


def model_env(env: Mapping[str, str]) -> dict[str, str]:
    """The model processes' environment: `env` with passive OpenMP waits unless it sets
    its own policy (an empty one is dropped: the runtime's default)."""
    out = dict(env)
    out.setdefault(WAIT_POLICY, PASSIVE)
    if not out[WAIT_POLICY]:
        del out[WAIT_POLICY]
    return out
