"""How many torch threads each model process of `specpipe up` runs, and how its OpenMP
threads wait: the one place that decides (`services/launcher.py` applies it; `env_of`:
the stages' and the draft's environment, not the router's).

Every model process (each stage, the draft) may use every core, and its OpenMP threads
wait passively (`OMP_WAIT_POLICY=PASSIVE`: a thread with nothing to do sleeps at once
instead of spinning on its core). Before, the cores were split evenly between the
processes (one thread each on a 2-core host with a draft), so when the router's tuner
settled on no draft the stage decoded on one thread beside an idle draft: about 300 ms
per token against 180 ms for the same stage deployed without a draft. With every core
to every process an idle draft costs the stage nothing, and where the draft works, the
stage's and the draft's forwards share the cores as the kernel schedules them; passive
waits keep a process between its parallel regions from burning the core the other one
needs (libgomp's default spins for a while first).

Measured (benchmarks/README.md, "Session 45: defaults that never lose on real models";
1.5B/0.5B bf16, 2 shared cores): plain decoding costs the same CPU per token in every
arrangement, and with the stage on both cores the tuner's no-draft fallback serves what
a deployment without a draft does. The price: a stage on both cores outruns the draft,
so trees stay shorter (W=2 K=3 draft at 1.35-1.45 tokens per step against 2.67 with one
core each) and the draft's settings cost more CPU per token; the tuner, pricing by the
wall clock, keeps the draft only where it still beats no draft. The split would be
better while the draft works and this while it idles; switching at run time needs
`torch.set_num_threads` on the stage's compute thread (OpenMP's thread count is per
calling thread): not done.

`--threads N` still fixes N threads per process (`--draft-threads N` the draft's); an
`OMP_WAIT_POLICY` in the caller's environment wins over the passive default (empty: the
OpenMP runtime's own default).
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


MODEL_KINDS = ("stage", "draft")  # the processes that run a model's forwards


def env_of(kind: str, env: Mapping[str, str]) -> dict[str, str]:
    """A child's environment: `model_env` for a model process (`MODEL_KINDS`), `env` as
    it is for the rest (the router runs no forwards: its own OpenMP, if any, keeps the
    runtime's default)."""
    return model_env(env) if kind in MODEL_KINDS else dict(env)


def model_env(env: Mapping[str, str]) -> dict[str, str]:
    """The model processes' environment: `env` with passive OpenMP waits unless it sets
    its own policy (an empty one is dropped: the runtime's default)."""
    out = dict(env)
    out.setdefault(WAIT_POLICY, PASSIVE)
    if not out[WAIT_POLICY]:
        del out[WAIT_POLICY]
    return out
