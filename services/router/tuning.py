"""The router's `auto` settings: width, layers per step and token source of specpipe
requests that leave them to the router (`common/perf/tuning.py` decides; not using the
draft, a `pp` request, is a candidate), and their growth (`common/perf/growth_choice.py`). One tuner per
model version and decoding regime, and one phase per model version that its tuners share
(`Shared`: every tuned request of the version gets the setting measured now, whatever its
regime, since tokens do not depend on it; each regime's tuner measures it); it goes by the time between tokens this router
measured per setting, or (`price="model"`) by the cost curves the stages and the draft
publish in Describe (`--measure-costs`). The choice and its reason are logged when they
change and shown in the router's Describe. Every request of a model version, tuned or
not, is tracked while it runs (`Overlaps`, in `Shared`; from its admission on, `started`): a
tuned request that ran beside one of another setting measured the batch, not its setting,
and the tuner discards it."""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass, replace

from specpipe.common.perf.cost_model import CostCurve, DeploymentCosts
from specpipe.common.perf.growth_choice import growth_for
from specpipe.common.perf.tuning import (
    DEFAULT_CALIBRATION_TOKENS,
    DEFAULT_EXPLORE_EVERY,
    DEFAULT_WINDOW_TOKENS,
    Decision,
    Measured,
    Setting,
    Shared,
    Tuner,
    TuningSpace,
)
from specpipe.common.spec.options import DecodeOptions, Mode
from specpipe.common.spec.stats import DecodeStats
from specpipe.v1 import generation_pb2 as gen

from ..config import SchedulingConfig
from ..control import cost_curve_from_proto
from .backends import Backends

log = logging.getLogger(__name__)


def costs_of(backends: Backends, version: str) -> DeploymentCosts | None:
    """Cost curves of one replica of every stage of `version` and of a draft; None when
    a stage has none (the draft without one counts as free)."""
    model = backends.versions.get(version)
    if model is None:
        return None
    by_range: dict[tuple[int, int], CostCurve] = {}
    context = 0
    for b in backends.stages:
        if b.desc is not None and b.version == version and b.healthy:
            curve = cost_curve_from_proto(b.desc.cost_curve)
            if curve is not None and b.layers not in by_range:
                by_range[b.layers], context = curve, b.desc.cost_curve.context
    if any(r not in by_range for r in model.ranges):
        return None
    drafts = [
        cost_curve_from_proto(b.desc.cost_curve)
        for b in backends.drafts
        if b.desc is not None and b.healthy
    ]
    draft = next((c for c in drafts if c is not None), None)
    return DeploymentCosts(context, [by_range[r] for r in model.ranges], draft)


def regime_of(opts: DecodeOptions) -> str:
    return "greedy" if opts.sampling.temperature == 0 else "sampling"


def running(mode: Mode, opts: DecodeOptions) -> Hashable:
    """What a request runs, as `Overlaps` tells settings apart: the tuner's setting for
    specpipe and pp requests (pp is its no-draft candidate), else the mode."""
    if mode == Mode.PP:
        return Setting.no_draft()
    if mode == Mode.SPECPIPE:
        return Setting(opts.width, opts.layers_per_step, opts.token_source)
    return str(mode)


@dataclass(frozen=True)
class Tuned:
    """A request's tuning decision (None: it fixed its settings, or its mode has none)
    and its place among the requests running, to report back when it ends."""

    key: tuple[str, str]
    decision: Decision | None
    expected_tokens: int
    ticket: int


class RouterTuning:
    def __init__(
        self,
        calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS,
        explore_every: int = DEFAULT_EXPLORE_EVERY,
        window_tokens: int = DEFAULT_WINDOW_TOKENS,
        price: str = "wall",
    ) -> None:
        self.calibration_tokens = calibration_tokens
        self.explore_every = explore_every
        self.window_tokens = window_tokens
        self.price = price
        self._tuner()  # checks the values
        self.tuners: dict[tuple[str, str], Tuner] = {}
        self.versions: dict[str, Shared] = {}  # per model version: requests live, phase
        self._told: dict[tuple[str, str], Setting] = {}  # the last choice logged

    @classmethod
    def of(cls, scheduling: SchedulingConfig) -> RouterTuning:
        """--tune-calibration-tokens and --tune-price (unset: the defaults)."""
        given = {"calibration_tokens": scheduling.tune_calibration_tokens,
                 "price": scheduling.tune_price}  # fmt: skip
        return cls(**{k: v for k, v in given.items() if v is not None})

    def resolve(
        self,
        mode: Mode,
        opts: DecodeOptions,
        space: TuningSpace | None,
        backends: Backends,
        version: str,
    ) -> tuple[Mode, DecodeOptions, Tuned]:
        """The request's mode and options with what it leaves to the router filled in
        (`space` None: nothing): its growth from the published costs
        (`growth_choice.py`), its `auto` settings from the tuner (the no-draft candidate
        makes it a `pp` request); modes without a specpipe tree keep the defaults. Also
        what to report when it starts running (`started`, once admitted) and at its end
        (`finish`, whatever the request)."""
        decision = None
        if mode == Mode.SPECPIPE and space is not None:
            mode, opts, decision = self._resolve(mode, opts, space, backends, version)
        ticket = self._shared(version).overlaps.queue(running(mode, opts))
        return mode, opts, Tuned((version, regime_of(opts)), decision, opts.max_new_tokens, ticket)

    def started(self, tuned: Tuned | None) -> None:
        """The request `resolve` decided left admission and runs: from now on it shares
        the forwards of its model version's other running requests (one still queued
        runs none, so it marks none of them mixed)."""
        if tuned is not None and (shared := self.versions.get(tuned.key[0])) is not None:
            shared.overlaps.start(tuned.ticket)

    def _resolve(
        self,
        mode: Mode,
        opts: DecodeOptions,
        space: TuningSpace,
        backends: Backends,
        version: str,
    ) -> tuple[Mode, DecodeOptions, Decision | None]:
        costs = costs_of(backends, version) if space.growth is None or space.is_auto else None
        if not space.is_auto:
            return mode, self._grown(opts, space, costs), None
        key = (version, regime_of(opts))
        tuner = self.tuners.get(key)
        if tuner is None:
            tuner = self.tuners[key] = self._tuner(self._shared(version))
        tuner.costs = costs  # replicas come and go
        d = tuner.decide(space, opts.max_new_tokens)
        s = d.setting
        if not d.exploring and self._told.get(key) != s:
            self._told[key] = s
            log.info("auto settings for %s (%s): %s", version[:12], key[1], d.reason)
        elif d.exploring:
            log.debug("auto settings for %s (%s): %s", version[:12], key[1], d.reason)
        if not s.uses_tree:
            return Mode.PP, opts, d
        tuned = replace(
            opts, width=s.width, layers_per_step=s.layers_per_step, token_source=s.token_source
        )
        return mode, self._grown(tuned, space, costs), d

    @staticmethod
    def _grown(opts: DecodeOptions, space: TuningSpace, costs: DeploymentCosts | None):
        """`opts` with the growth the request asked for, else the deployment's."""
        if space.growth is not None:
            return opts
        growth = growth_for(costs, opts.layers_per_step, opts.width, opts.token_source.uses_model)
        return replace(opts, growth=growth)

    def _tuner(self, shared: Shared | None = None) -> Tuner:
        return Tuner(
            None,
            self.calibration_tokens,
            self.explore_every,
            self.window_tokens,
            self.price,
            shared=shared or Shared(),
        )

    def _shared(self, version: str) -> Shared:
        return self.versions.setdefault(version, Shared())

    def finish(self, tuned: Tuned | None, stats: DecodeStats | None, tbt_ms: float = 0.0) -> None:
        """A tuned request ended: `stats` None when it failed; `tbt_ms` its mean time
        between tokens. A request whose width the scheduler narrowed measured another
        setting than it was given, a replayed one paid for the replay: not counted; one
        that ran beside another setting is mixed (`Overlaps`)."""
        if tuned is None:
            return
        shared = self.versions.get(tuned.key[0])
        clean = shared is not None and shared.overlaps.end(tuned.ticket)
        tuner = self.tuners.get(tuned.key)
        if tuner is None or tuned.decision is None:
            return
        s = tuned.decision.setting
        if stats is None or stats.width != s.width or stats.replays:
            tuner.finish(s, tuned.expected_tokens)
            return
        wall = tbt_ms * max(stats.new_tokens - 1, 0) / 1e3
        tuner.finish(
            s, tuned.expected_tokens, stats.new_tokens, stats.decode_steps, stats.hits, wall, clean
        )

    def describe(self) -> list[gen.Tuning]:
        out = []
        for (version, regime), tuner in sorted(self.tuners.items()):
            arms = [_arm(tuner, s) for s in sorted(tuner.measured)]
            now = tuner.outlook()
            out.append(
                gen.Tuning(
                    weight_hash=version,
                    regime=regime,
                    chosen=_arm(tuner, now.setting) if now else None,
                    reason=now.reason if now else "",
                    arms=arms,
                    price=tuner.price,
                )
            )
        return out


def _arm(tuner: Tuner, s: Setting) -> gen.TuningArm:
    m = tuner.measured.get(s) or Measured()
    step = tuner.step_seconds(s)
    cost = tuner.modelled_per_token(s)
    wall = m.wall_per_token
    return gen.TuningArm(
        width=s.width,
        layers_per_step=s.layers_per_step,
        token_source=str(s.token_source),
        requests=round(m.requests),
        tokens=round(m.tokens),
        steps=round(m.steps),
        hit_rate=m.hit_rate,
        step_ms=step * 1e3 if step is not None else 0.0,
        ms_per_token=cost * 1e3 if cost is not None and step is not None else 0.0,
        wall_ms_per_token=wall * 1e3 if wall is not None else 0.0,
        mixed_requests=m.mixed,
    )
