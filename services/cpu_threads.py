"""How many torch threads each model process of `specpipe up` runs, when a stage changes
its count at run time, and how OpenMP threads wait: the one place that decides
(`services/launcher.py` applies it; `env_of`: the stages' and the draft's environment,
not the router's).

**The default: every core to every process.** Each stage gets the cores a deployment of
the same stages without a draft would give it (`cpus // stage processes`: the stages of
one host work at once, pipelined across requests, and OpenMP threads of one parallel
region that the kernel swaps out make the whole region wait), and the draft gets every
core: with one stage the stage and the draft mostly take turns (a verification waits for
the draft's tree and the draft for the verified token), so each gets the whole host in
its turn, and when the router's tuner chooses no draft the stage decodes as a deployment
without one (issue 34 point 7). On idle cores this was measured the fastest
(benchmarks/README.md, "Session 47: threads while the draft works": 117-123 ms per token
drafting, against 137-147 with the split below, and plain decoding as without a draft).

**Split while the draft works** (`--split-cores-while-drafting`, off by default): while
the draft holds requests (some live request uses the draft model) the draft runs on
`cpus // (stage processes + 1)` threads and the stages on the rest
(`threads_with_draft`); while it holds none the stages run on their full count again.
On a host busy with other work, where the two would otherwise contend for cores, this
was the better arrangement for drafting (session 45, and session 47 at load 4-7: 2.67
tokens per step against 1.00-1.45 with every core to each, at less CPU per token); on
idle cores it is slower (above), hence opt-in.

`torch.set_num_threads` sets the calling thread's OpenMP team (libgomp's nthreads ICV is
per thread), so the switch runs on the stage's compute thread before each forward
(`ThreadShare.follow`, called by `ComputeRounds`), from a flag the draft process keeps in a
small file of the deployment (`DraftActivity`: a slot per draft, refreshed while it holds
requests; the launcher makes the file and names it to both). The router opens a request on
the draft only when the request uses it, so the draft's open requests are exactly those
(the stage's Open and frames do not say it). It switches only where the
model's linear layers give the same bits at both counts (`same_bits_at`), so every output
stays what plain decoding gives. Separate hosts (Kubernetes) pass no file: nothing changes.

**Small models run one thread.** A forward whose weights per row are few
(`small_model`: under `SMALL_WEIGHTS`) costs more CPU on two threads than on one, every
parallel region's wake costing more than its tiny operations (session 46: the 0.4 M-weight
test Llama at 2.5-3x the CPU per forward), so such a process gets one thread.

OpenMP threads wait passively (`OMP_WAIT_POLICY=PASSIVE`: a thread with nothing to do
sleeps at once instead of spinning on its core), so an idle draft, and the stage's
threads parked while it runs fewer, cost the others nothing.

Measured: benchmarks/README.md, "Session 45: defaults that never lose on real models"
and "Session 47: threads while the draft works". `--threads N` fixes N threads per process
(no switching; `--draft-threads N` the draft's, the stage's share then the rest); an
`OMP_WAIT_POLICY` in the caller's environment wins over the passive default (empty: the
OpenMP runtime's own default).
"""

from __future__ import annotations

import logging
import mmap
import struct
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from .ratelog import RateLimitedLog

if TYPE_CHECKING:
    from specpipe.common.model.config import ModelConfig
    from torch import nn

log = logging.getLogger(__name__)

WAIT_POLICY = "OMP_WAIT_POLICY"
PASSIVE = "PASSIVE"
# Weights a forward reads per row (linear layers and head) under which a process runs one
# thread: measured break-even between the 0.4 M test Llama (2 threads: 2x the CPU per
# forward) and a 5.7 M one (1.04x); Qwen2.5-0.5B has 494 M (README, "Session 47").
SMALL_WEIGHTS = 4_000_000


def weights_per_row(cfg: ModelConfig) -> int:
    """The weights one row's forward multiplies through (every layer's projections and
    the head): what a thread's share of a forward grows with."""
    h, hd = cfg.hidden_size, cfg.head_dim
    layer = h * hd * 2 * (cfg.num_heads + cfg.num_kv_heads) + 3 * h * cfg.intermediate_size
    return cfg.num_layers * layer + cfg.vocab_size * h


def small_model(cfg: ModelConfig, stages: int = 1) -> bool:
    """Whether a process holding `1/stages` of `cfg`'s model runs one thread best."""
    return weights_per_row(cfg) // max(1, stages) < SMALL_WEIGHTS


def model_threads(given: int | None, cpus: int, stages: int = 1, small: bool = False) -> int:
    """Torch threads of each stage process: `given` (--threads), else one for a small
    model, else the host's cores shared by its `stages` stage processes (what the same
    deployment without a draft gives them)."""
    return given or (1 if small else max(1, cpus // max(1, stages)))


def draft_threads(
    given: int | None,
    threads: int | None,
    cpus: int,
    stages: int = 1,
    small: bool = False,
    split: bool = False,
) -> int:
    """Torch threads of the draft process: `given` (--draft-threads), else --threads,
    else one for a small model, else every core (it waits passively while it idles), or
    with `split` (--split-cores-while-drafting) its part of the split while it works,
    `cpus // (stages + 1)`."""
    fixed = given or threads
    if fixed:
        return fixed
    if small:
        return 1
    return max(1, cpus // (max(1, stages) + 1)) if split else max(1, cpus)


def threads_with_draft(stage_threads: int, draft: int, cpus: int, stages: int = 1) -> int:
    """A stage's threads while the draft works: the cores the draft's `draft` threads
    leave, shared by the `stages` stage processes; 0 where that is not fewer than its
    `stage_threads` (nothing to switch)."""
    share = max(1, (cpus - draft) // max(1, stages))
    return share if share < stage_threads else 0


# -- the draft's flag, shared through a file on one host ------------------------------------
SLOTS = 16  # drafts one file tells apart (the launcher gives each one its slot)
_SLOTS = struct.Struct(f"{SLOTS}q")
# A flag older than this is a draft that died holding requests: the stage takes every core.
STALE_NS = 2_000_000_000
PUBLISH_SECONDS = 0.05  # how often a draft looks at its requests


class DraftActivity:
    """A deployment's file of draft flags: slot k holds CLOCK_MONOTONIC (ns, one clock for
    every process of the host) of the last time draft k was seen holding requests, 0 while
    it holds none. Written by the drafts (`publish`), read by the stages (`working`)."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _SLOTS.size)

    @staticmethod
    def create(path: str | Path) -> Path:
        """A fresh file, every slot idle."""
        Path(path).write_bytes(bytes(_SLOTS.size))
        return Path(path)

    def working(self) -> bool:
        """Whether some draft holds requests now (about 1 us: read before every forward)."""
        newest = max(_SLOTS.unpack_from(self._map))
        return newest > 0 and time.monotonic_ns() - newest < STALE_NS

    def set(self, slot: int, holding: bool) -> None:
        struct.pack_into("q", self._map, 8 * (slot % SLOTS), time.monotonic_ns() if holding else 0)


def publish(path: str | Path, slot: int, held: Callable[[], int]) -> threading.Event:
    """In the draft: a thread that keeps slot `slot` of `path` saying whether `held()`
    (its open requests) is above 0, until the returned event is set (then idle)."""
    activity, stop = DraftActivity(path), threading.Event()

    def run() -> None:
        while not stop.wait(PUBLISH_SECONDS):
            activity.set(slot, held() > 0)
        activity.set(slot, False)

    threading.Thread(target=run, name="draft activity", daemon=True).start()
    return stop


class ThreadShare:
    """A stage's torch threads, set on its compute thread before each forward (`follow`):
    `with_draft` while a draft holds requests, else `threads`."""

    def __init__(self, activity: DraftActivity, threads: int, with_draft: int) -> None:
        self.activity, self.threads, self.with_draft = activity, threads, with_draft
        self.current = 0  # what this thread was set to (0: not yet)
        self.switches = 0  # count changes after the first
        self._log = RateLimitedLog(log, interval=60.0)  # a line per change a minute

    def follow(self) -> int:
        """The calling thread's count for the next forward, set where it changes."""
        want = self.with_draft if self.activity.working() else self.threads
        if want != self.current:
            import torch

            torch.set_num_threads(want)
            self.switches += self.current > 0
            said = "works" if want == self.with_draft else "idles"
            msg = "torch threads %d -> %d (the draft %s; %d switches so far)"
            got = torch.get_num_threads()
            self._log.log(logging.INFO, f"{self.current}>{want}", msg, self.current, got, said,
                          self.switches)  # fmt: skip
            self.current = want
        return want


def same_bits_at(model: nn.Module, a: int, b: int, rows: tuple[int, ...] = (1, 3, 8)) -> bool:
    """Whether every linear shape of `model` gives random rows the same bits at `a` and
    at `b` threads (a kernel may split a reduction by threads): switching between them
    must not change what a row computes. The calling thread's count is kept."""
    import torch

    before, seen = torch.get_num_threads(), set()
    gen = torch.Generator().manual_seed(0)
    try:
        for layer in model.modules():
            n_in, n_out = getattr(layer, "in_features", None), getattr(layer, "out_features", None)
            if n_in is None or (key := (type(layer), n_in, n_out)) in seen:
                continue
            if next(layer.children(), None) is not None:  # a wrapper: its inner one is checked
                continue
            seen.add(key)
            # plain (`nn.Linear`) or packed (`PackedLinear`'s buffer)
            tensors = (*layer.parameters(), *layer.buffers())
            weight = next(t for t in tensors if t.is_floating_point())
            for n in rows:
                x = torch.randn(n, n_in, generator=gen).to(weight.dtype).to(weight.device)
                outs = []
                for count in (a, b):
                    torch.set_num_threads(count)
                    with torch.inference_mode():
                        outs.append(layer(x))
                if not torch.equal(*outs):
                    log.info("%s %dx%d: other bits at %d and %d threads", type(layer).__name__,
                             n_in, n_out, a, b)  # fmt: skip
                    return False
    finally:
        torch.set_num_threads(before)
    return True


def stage_share(
    model: nn.Module, activity: str | Path | None, threads: int, with_draft: int
) -> Callable[[], object] | None:
    """What a stage's compute thread calls before each forward (`ThreadShare.follow`), or
    None: no draft on this host (`activity` None), nothing to switch, or a model whose
    bits would change with the count."""
    if not activity or not with_draft or with_draft >= threads:
        return None
    if not same_bits_at(model, threads, with_draft):
        log.warning("threads stay %d: this model's kernels round otherwise at %d", threads,
                    with_draft)  # fmt: skip
        return None
    log.info("torch threads: %d, %d while the draft works", threads, with_draft)
    return ThreadShare(DraftActivity(activity), threads, with_draft).follow


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
