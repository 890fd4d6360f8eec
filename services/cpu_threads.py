"""How many torch threads each model process of `specpipe up` runs, and how its OpenMP
threads wait: the one place that decides (`services/launcher.py` applies it; `env_of`:
the stages' and the draft's environment, not the router's).

Each stage gets the cores a deployment of the same stages without a draft would give it
(`cpus // stage processes`: the stages of one host work at once, pipelined across
requests, and OpenMP threads of one parallel region that the kernel swaps out make the
whole region wait), and the draft gets every core. OpenMP threads wait passively
(`OMP_WAIT_POLICY=PASSIVE`: a thread with nothing to do sleeps at once instead of
spinning on its core), so a draft that idles costs the stages nothing. This makes point 7
of issue 34 hold by construction: when the router's tuner settles on no draft, the
deployment decodes as the same deployment without a draft does. Before, the cores were
split evenly over every model process, draft included (one thread each for one stage and
a draft on 2 cores), so "no draft" inside a deployment with a draft decoded on one
thread: about 300 ms per token against 180 ms without a draft.

Measured (benchmarks/README.md, "Session 45: defaults that never lose on real models";
1.5B/0.5B bf16, one stage, 2 shared cores): plain decoding costs the same CPU per token
in every arrangement, and with the stage on both cores the tuner's no-draft fallback
serves what a deployment without a draft does. The price: a stage on both cores outruns
the draft, so trees stay shorter (W=2 K=3 draft at 1.35-1.45 tokens per step against
2.67 with one core each) and the draft's settings cost more CPU per token; the tuner,
pricing by the wall clock, keeps the draft only where it still beats no draft. The split
would be better while the draft works and this while it idles; switching at run time
needs `torch.set_num_threads` on the stage's compute thread (OpenMP's thread count is
per calling thread): not done.

`--threads N` fixes N threads per process (`--draft-threads N` the draft's); an
`OMP_WAIT_POLICY` in the caller's environment wins over the passive default (empty: the
OpenMP runtime's own default).
"""

from __future__ import annotations

from collections.abc import Mapping

WAIT_POLICY = "OMP_WAIT_POLICY"
PASSIVE = "PASSIVE"


def model_threads(given: int | None, cpus: int, stages: int = 1) -> int:
    """Torch threads of each stage process: `given` (--threads), else the host's cores
    shared by its `stages` stage processes (what the same deployment without a draft
    gives them)."""
    return given or max(1, cpus // max(1, stages))


def draft_threads(given: int | None, threads: int | None, cpus: int) -> int:
    """Torch threads of the draft process: `given` (--draft-threads), else --threads,
    else every core (it waits passively while it idles)."""
    return given or threads or max(1, cpus)


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
