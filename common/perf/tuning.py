"""Width, layers per step and token source chosen for a deployment from what it serves:
the router's `auto` (docs/architecture.md, "3. The pipeline step", "Choosing W, K and the
source").

Every setting emits the same tokens (every mode is lossless), so trying one costs only
speed. The tuner gives `auto` requests each candidate setting in turn until it has seen
`calibration_tokens` tokens with it, then the setting with the least time per token.
Two prices (`price`):

- `wall` (the default): the time between tokens its finished requests saw, measured by
  the router. It holds whatever the deployment does: the draft working ahead of the
  step, verification round trips, late draft answers. Measurements fade, so a load that
  changes over time weighs on all settings.
- `model`: step cost(W, K, source) / tokens per step(W, K, source). Tokens per step is
  the lockstep accounting each request reports (independent of load); a steady step's
  cost comes from the cost curves the stages and the draft measured
  (`layers.step_seconds`: every stage K layers of W rows, the draft K forwards of W rows
  one after another, none for the n-gram source). Without cost curves every step is
  taken to cost the same, and the most tokens per step wins. On emulated devices
  (`benchmarks/bench_tuning.py`) this ranked settings against the wall clock where the
  draft is slow: the services overlap the draft's K forwards with the step, lockstep
  does not.

The candidates include not using the draft at all (`NO_DRAFT`: the request runs as `pp`,
plain decoding at S = 1), so with the wall price a draft that does not pay loses to no
draft, and layers per step fit the pipeline (`auto_layers`: at S = 1 one layer per step
verifies one token a step, as plain decoding does, so the candidates start at 2).
A candidate whose first measurements cost more than `ELIMINATE_RATIO` times the best's
is not calibrated further and only every `FAR_REFRESH`-th re-measure visits it:
exploring costs less.

Calibration does not try every candidate (37 at S = 1): it searches the grid of widths
and layers per step of each source from the middle (`_focus`): no draft and each
source at the middle width and K first, then the untried neighbours (one width or one
K away) of each source's best while that source is a contender, until the best of every
contending source has no untried neighbour (time per token is about unimodal in W and
K: wider and deeper trees gain hits until their rows cost more). Neighbours the cost
curves say cannot win (a step's cost over K tokens, its most, above the best measured
price) are skipped. Everything not tried is left to the re-measures.

Measurements fade (halved once a setting has `window_tokens`), and every
`explore_every`-th decision re-measures the setting seen least recently, so the choice
follows the traffic.

**Several requests at once.** Requests in flight together share every forward, so a
request's time between tokens measures the batch it ran in, not its own setting (a
no-draft request beside draft requests waits for their trees' draft forwards). Settings
are therefore measured in phases (`Phase`): while one is calibrated or re-measured and
requests of the model version are in flight (any regime, tuned or not: `Shared`'s
`Overlaps`), every tuned request of the version gets it, and a finished
request counts only when every request that ran beside it on this model version (tuned
or not, any regime: `common/perf/overlaps.py`) had the same setting; else it is discarded as `mixed`.
One phase per model version: its regimes' tuners (greedy, sampling) share it (`Shared`),
since tokens do not depend on the setting in any regime; a tuner that decides while
another's phase runs gives its setting (`_follow`) and measures it for itself, and the
phase's rules (its end, its bound, the bounded count) are those of the tuner that began
it (phases of their own would run side by side and mix each other's requests).
Their choices are shared too where they are equally good: a regime whose best is priced
within `TIE_RATIO` of the setting the version's last chosen request got (`Shared.choice`,
another regime's) takes that one, else two regimes settled on different settings would
mix each other's requests in their steady state.
A calibration phase lasts until its setting has its calibration tokens (or is no longer
a contender), a re-measure phase until one clean request of its setting finished; with
nothing in flight the next decision may begin another (nothing to mix with). A phase
also ends once it decided `PHASE_BOUND` times the most tokens in flight at its
decisions plus those it needs (its first requests overlap the previous phase's, its
last ones the next's: clean requests can be rare), and a candidate whose calibration
phases hit that bound `CALIBRATION_PHASES` times is calibrated no further. Where other
settings always run beside (requests that fix their own settings make the tuned ones
beside them mixed: they share the forwards just the same), calibration thus ends with
what was measured clean, and with nothing measured clean the choice is no draft: plain
decoding, what the deployment without its draft serves. Re-measure phases are spaced
to take about one decision in `explore_every` (`explore_every` times the last one's
decisions apart), and while requests are in flight they visit only settings measured
before (a setting the search never tried slows every request beside it for a whole
phase: those wait for a moment with nothing in flight). A clean request (of any
setting) clears the bounded phases' counts: what made clean requests rare (a request
with fixed settings, live for a while) has gone, and the candidates it cut short are
calibrated again, else one disturbance during calibration would leave them unmeasured
for good. At one client no request runs
beside another: every one counts and
the decisions are what they were without phases. The `model` price goes by tokens per
step, which the batch does not change: a mixed request counts there. Pure state: the
router feeds it decisions, which requests run together, and finished requests.

One module: the search, its phases and the re-measures decide together over one state
(what was measured, what is in flight, the phase that runs), and each rule reads the
others' (a phase ends where the search drops its setting; a re-measure waits for no
phase); which requests ran together is apart (`overlaps.py`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..spec.options import Growth, TokenSource
from .cost_model import DeploymentCosts
from .layers_per_step import step_seconds
from .overlaps import Overlaps

AUTO_WIDTHS = (2, 4, 8, 16)
AUTO_LAYERS = (1, 2, 3)
# At S = 1 a step with one layer verifies one token, as plain decoding (the no-draft
# candidate) does without the draft's cost: several layers per step (classic
# speculative decoding, up to K tokens a step) or none.
AUTO_LAYERS_ONE_STAGE = (2, 3, 4)
NO_DRAFT = "none"  # the candidate without a tree: the request runs as pp
ELIMINATE_RATIO = 1.5
FAR_REFRESH = 4  # every 4th re-measure may visit a candidate far behind the best
DEFAULT_CALIBRATION_TOKENS = 256
DEFAULT_EXPLORE_EVERY = 20
DEFAULT_WINDOW_TOKENS = 8192
PRICES = ("wall", "model")
# A phase ends once it decided this many times the most tokens in flight at its decisions
# plus those it needs, whether or not clean requests came.
PHASE_BOUND = 3
CALIBRATION_PHASES = 3  # a candidate's calibration gives up after this many bounded phases
CALIBRATING, RE_MEASURING = "calibrating", "re-measuring"
# Prices within this ratio of the best count as equally good: a regime takes its model
# version's choice (`Shared.choice`) over its own best then (requests of both regimes run
# together and would mix in their steady state).
TIE_RATIO = 1.1


@dataclass(frozen=True, order=True)
class Setting:
    """What shapes a specpipe request's tree."""

    width: int
    layers_per_step: int
    token_source: TokenSource | str  # a TokenSource, or NO_DRAFT

    @classmethod
    def no_draft(cls) -> Setting:
        """No tree and no draft: plain pipeline parallelism (`pp`). Its width is 0, as
        a pp request's stats report it."""
        return cls(0, 1, NO_DRAFT)

    @property
    def uses_tree(self) -> bool:
        return self.token_source != NO_DRAFT

    @property
    def uses_draft_model(self) -> bool:
        return self.uses_tree and TokenSource(self.token_source).uses_model

    def label(self) -> str:
        if not self.uses_tree:
            return "no draft (pp)"
        return f"W={self.width} K={self.layers_per_step} {self.token_source}"


def _middle(values: Sequence[int]) -> int:
    return values[(len(values) - 1) // 2]


def _neighbours(s: Setting, widths: Sequence[int], layers: Sequence[int]) -> list[Setting]:
    """The settings one width or one K away from `s` (same source)."""
    out = []
    w, k = widths.index(s.width), layers.index(s.layers_per_step)
    for i in (w - 1, w + 1):
        if 0 <= i < len(widths):
            out.append(Setting(widths[i], s.layers_per_step, s.token_source))
    for i in (k - 1, k + 1):
        if 0 <= i < len(layers):
            out.append(Setting(s.width, layers[i], s.token_source))
    return out


def auto_layers(stages: int) -> tuple[int, ...]:
    """Layers per step worth trying with `stages` stages (0: not known)."""
    return AUTO_LAYERS_ONE_STAGE if stages == 1 else AUTO_LAYERS


@dataclass
class Measured:
    """What finished requests with one setting did (faded: see the module docstring)."""

    requests: float = 0.0
    tokens: float = 0.0
    steps: float = 0.0
    hits: float = 0.0
    wall_seconds: float = 0.0  # between first and last token, summed over requests
    intervals: float = 0.0  # tokens after the first, summed
    last_seen: int = -1  # the decision count when a request with it last finished
    mixed: int = 0  # requests discarded: another setting ran beside them (not faded)

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.tokens if self.tokens else 0.0

    @property
    def wall_per_token(self) -> float | None:
        return self.wall_seconds / self.intervals if self.intervals else None


@dataclass(frozen=True)
class TuningSpace:
    """A request's settings: a value where the request (or the router's default) fixed
    one, None where it is the tuner's to choose."""

    width: int | None
    layers_per_step: int | None
    token_source: TokenSource | None
    has_draft: bool
    widths: Sequence[int] = AUTO_WIDTHS
    layers: Sequence[int] | None = None  # None: `auto_layers(stages)`
    stages: int = 0  # the pipeline's (0: not known)
    # When a layer grows (None: the router's rule, `common/perf/growth_choice.py`)
    growth: Growth | None = Growth.VERIFIED

    @property
    def is_auto(self) -> bool:
        return None in (self.width, self.layers_per_step, self.token_source)

    def settings(self) -> list[Setting]:
        """The candidates, smallest first (ties go to the cheaper setting; no draft, the
        cheapest, first). Without a fixed source, not using the draft is one."""
        sources = (
            [self.token_source]
            if self.token_source is not None
            else [s for s in TokenSource if self.has_draft or not s.uses_model]
        )
        widths = [self.width] if self.width is not None else list(self.widths)
        layers = (
            [self.layers_per_step]
            if self.layers_per_step is not None
            else list(self.layers if self.layers is not None else auto_layers(self.stages))
        )
        trees = (Setting(w, k, s) for w, k, s in itertools.product(widths, layers, sources))
        fixed = [Setting.no_draft()] if self.token_source is None else []
        return fixed + sorted(trees)


@dataclass(frozen=True)
class Decision:
    setting: Setting
    reason: str
    exploring: bool
    phase: str = ""  # CALIBRATING, RE_MEASURING, or "" (the choice)


@dataclass
class Phase:
    """One setting measured alone: every request decided meanwhile gets it."""

    setting: Setting
    kind: str  # CALIBRATING or RE_MEASURING
    need: int  # tokens it measures (a re-measure: one request's)
    began: int  # the decision count at its first decision
    in_flight: int = 0  # the most tokens in flight at its decisions (before each)
    decided_tokens: int = 0
    decisions: int = 0
    clean: int = 0  # clean requests of its setting finished while it ran (its owner's)
    owner: Tuner | None = field(default=None, repr=False, compare=False)  # who began it

    def holds(self) -> bool:
        """Whether its bound (and for a re-measure, a clean request) has not ended it."""
        if self.kind == RE_MEASURING and self.clean:
            return False
        return self.decided_tokens < PHASE_BOUND * (self.in_flight + self.need)


@dataclass
class Shared:
    """What the tuners of one model version (one per regime) share: its requests live
    (`Overlaps`, tuned or not), the tokens its tuned requests asked for in flight, and the
    phase that runs (every tuned request of the version gets its setting)."""

    overlaps: Overlaps = field(default_factory=Overlaps)
    pending: int = 0
    phase: Phase | None = None
    choice: Setting | None = None  # the setting the version's last chosen request got
    chooser: Tuner | None = field(default=None, repr=False, compare=False)  # whose choice


@dataclass
class Tuner:
    """One deployment's (one model version, one decoding regime) settings and what each
    achieved."""

    costs: DeploymentCosts | None = None
    calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS
    explore_every: int = DEFAULT_EXPLORE_EVERY
    window_tokens: int = DEFAULT_WINDOW_TOKENS
    price: str = "wall"
    measured: dict[Setting, Measured] = field(default_factory=dict)
    pending: dict[Setting, int] = field(default_factory=dict)  # tokens asked, in flight
    decisions: int = 0
    space: TuningSpace | None = None  # the last request's candidates
    searched: set[Setting] = field(default_factory=set)  # ever in calibration's search
    bounded: dict[Setting, int] = field(default_factory=dict)  # calibration phases cut short
    last_re_measure: tuple[int, int] = (0, 1)  # its first decision, its decisions
    mixed: int = 0  # finished requests discarded as mixed
    shared: Shared = field(default_factory=Shared)  # with the version's other tuners

    @property
    def phase(self) -> Phase | None:
        """The setting measured now on this model version (None: the choices serve)."""
        return self.shared.phase

    @phase.setter
    def phase(self, p: Phase | None) -> None:
        self.shared.phase = p

    def _busy(self) -> bool:
        """Whether requests of this model version are in flight (any regime, tuned or
        not): a phase begun now would run beside them."""
        return self.shared.pending > 0 or bool(self.shared.overlaps.live)

    def __post_init__(self) -> None:
        if self.calibration_tokens < 1 or self.explore_every < 1 or self.window_tokens < 1:
            raise ValueError("calibration tokens, explore_every and the window must be >= 1")
        if self.price not in PRICES:
            raise ValueError(f"unknown price {self.price!r} (choose from {', '.join(PRICES)})")

    # -- prices --------------------------------------------------------------------------
    def step_seconds(self, s: Setting) -> float | None:
        """A steady step's cost from the cost curves (None without them)."""
        if self.costs is None:
            return None
        return step_seconds(self.costs, s.layers_per_step, max(s.width, 1), s.uses_draft_model)

    def modelled_per_token(self, s: Setting) -> float | None:
        """Step cost over tokens per step (steps per token without cost curves); None
        until a request with this setting finished."""
        m = self.measured.get(s)
        if m is None or m.tokens_per_step == 0:
            return None
        step = self.step_seconds(s)
        return (1.0 if step is None else step) / m.tokens_per_step

    def cost_per_token(self, s: Setting) -> float | None:
        """The price the choice goes by (see the module docstring)."""
        if self.price == "model":
            return self.modelled_per_token(s)
        m = self.measured.get(s)
        return m.wall_per_token if m is not None else None

    # -- decisions -----------------------------------------------------------------------
    def decide(self, space: TuningSpace, expected_tokens: int) -> Decision:
        """The setting for one request that will emit up to `expected_tokens` tokens;
        call `finish` with the same setting when it ends."""
        candidates = space.settings()
        self.decisions += 1
        p = self.phase
        if p is not None and not p.holds():  # its bound, or a re-measure's clean request
            if p.kind == CALIBRATING and p.owner is not None:
                p.owner.bounded[p.setting] = p.owner.bounded.get(p.setting, 0) + 1
            self.phase = None
        decision = self._follow(candidates) or self._calibrate(candidates)
        decision = decision or self._refresh(candidates) or self._best(candidates)
        self._enter(decision, expected_tokens)
        self.pending[decision.setting] = self.pending.get(decision.setting, 0) + expected_tokens
        self.shared.pending += expected_tokens
        self.space = space
        return decision

    def _enter(self, d: Decision, expected_tokens: int) -> None:
        """Go on with the phase `d` belongs to (its own, or another regime's it follows),
        or begin it (none for the choice: that ends only this tuner's phase)."""
        p = self.phase
        if not d.phase:
            if self.shared.choice != d.setting:  # its own best (a tie keeps the chooser)
                self.shared.choice, self.shared.chooser = d.setting, self
            if p is not None and p.owner is self:
                self.phase = None
            return
        mine = p is not None and (p.owner is self or self._busy())
        if p is None or p.setting != d.setting or p.kind != d.phase or not mine:
            need = expected_tokens
            if d.phase == CALIBRATING:
                need = max(need, self.calibration_tokens - round(self._tokens(d.setting)))
            p = self.phase = Phase(d.setting, d.phase, need, self.decisions, owner=self)
        p.in_flight = max(p.in_flight, self.shared.pending)
        p.decided_tokens += expected_tokens
        p.decisions += 1
        if p.kind == RE_MEASURING and p.owner is self:
            self.last_re_measure = (p.began, p.decisions)

    def _follow(self, candidates: list[Setting]) -> Decision | None:
        """Another regime's phase on this model version while requests are in flight:
        its setting (tokens do not depend on it, and this tuner measures it too), else
        they would mix."""
        p = self.phase
        if p is None or p.owner is self or not self._busy() or p.setting not in candidates:
            return None
        reason = f"{p.kind} {p.setting.label()} (another regime's phase on this model)"
        return Decision(p.setting, reason, exploring=True, phase=p.kind)

    def _tokens(self, s: Setting) -> float:
        m = self.measured.get(s)
        return m.tokens if m else 0.0

    def outlook(self) -> Decision | None:
        """What the next request like the last one would get (re-measures aside), from
        what is measured now: what Describe shows."""
        if self.space is None:
            return None
        candidates = self.space.settings()
        return self._calibrate(candidates) or self._best(candidates)

    def _contenders(self, candidates: list[Setting]) -> list[Setting]:
        """The candidates not yet measured or measured within `ELIMINATE_RATIO` of the
        best's cost."""
        costs = {s: c for s in candidates if (c := self.cost_per_token(s)) is not None}
        if not costs:
            return candidates
        bar = ELIMINATE_RATIO * min(costs.values())
        return [s for s in candidates if costs.get(s, 0.0) <= bar]

    def _focus(self, candidates: list[Setting]) -> list[Setting]:
        """The candidates calibration measures (see the module docstring): the seeds (no
        draft; each source at the middle width and K), those measured already, and the
        untried neighbours of each contending source's best (and of every one that was
        its best: the search does not drop a direction it opened), less those the cost
        curves rule out."""
        priced = {s: c for s in candidates if (c := self.cost_per_token(s)) is not None}
        bar = ELIMINATE_RATIO * min(priced.values()) if priced else None
        widths = sorted({s.width for s in candidates if s.uses_tree})
        layers = sorted({s.layers_per_step for s in candidates if s.uses_tree})
        by_source: dict[TokenSource | str, list[Setting]] = {}
        for s in candidates:
            by_source.setdefault(s.token_source, []).append(s)
        focus = self.searched | set(priced) | {s for s in candidates if s in self.measured}
        for source, members in by_source.items():
            if not members[0].uses_tree:
                focus.update(members)
                continue
            seed = Setting(_middle(widths), _middle(layers), source)
            focus.add(seed if seed in members else members[len(members) // 2])
            best = min((s for s in members if s in priced), key=priced.get, default=None)
            if best is None or bar is None or priced[best] > bar:
                continue
            for n in _neighbours(best, widths, layers):
                if n in members and n not in priced and not self._cannot_win(n, priced):
                    focus.add(n)
        self.searched |= focus
        return [s for s in candidates if s in focus]

    def _cannot_win(self, s: Setting, priced: dict[Setting, float]) -> bool:
        """Whether the cost curves put `s` above the best measured price even if every
        step emitted its most tokens (K)."""
        step = self.step_seconds(s)
        if step is None or not priced or not s.uses_tree:
            return False
        best = min(priced.values())
        if self.price == "model":
            return False  # its prices are these curves: a measurement decides
        return step / s.layers_per_step > best

    def _calibrate(self, candidates: list[Setting]) -> Decision | None:
        """The calibration phase's setting while it holds and requests are in flight;
        else (nothing in flight to mix with: a phase may change freely) the contender the
        search calibrates (`_focus`) with the fewest bounded phases and least measured,
        while any is short of calibration tokens (clean ones: see the module docstring)
        and has bounded phases left."""
        p = self.phase
        ours = p is not None and p.owner is self and p.kind == CALIBRATING and p.holds()
        going_on = p.setting if ours and self._busy() else None

        def left(s: Setting) -> bool:
            if self._tokens(s) >= self.calibration_tokens:
                return False
            return s == going_on or self.bounded.get(s, 0) < CALIBRATION_PHASES

        contenders = self._contenders(candidates)
        focus = self._focus(candidates)
        short = [s for s in contenders if s in focus and left(s)]
        if not short:
            return None
        if going_on in short:
            s = going_on
        else:
            s = min(short, key=lambda s: (self.bounded.get(s, 0), self._tokens(s)))
        return Decision(
            s,
            f"measuring {s.label()}: {self._tokens(s):.0f} of {self.calibration_tokens} "
            f"calibration tokens seen ({len(short)} of {len(candidates)} settings still short"
            f"{f', {self.mixed} requests mixed' if self.mixed else ''})",
            exploring=True,
            phase=CALIBRATING,
        )

    def _refresh(self, candidates: list[Setting]) -> Decision | None:
        """The re-measure phase's setting while it holds; else every `explore_every`-th
        decision (at least `explore_every` times the last re-measure's decisions after
        it began): the contender seen least recently; every `FAR_REFRESH`-th of those,
        the candidate seen least recently (one far behind may have caught up since).
        With requests in flight, only settings measured before."""
        p = self.phase
        if (
            p
            and p.owner is self
            and p.kind == RE_MEASURING
            and p.holds()
            and p.setting in candidates
        ):
            return Decision(p.setting, self._re_measuring(p.setting), True, RE_MEASURING)
        if len(candidates) < 2 or self.decisions % self.explore_every:
            return None
        began, decisions = self.last_re_measure
        if self.decisions - began < self.explore_every * decisions:
            return None
        if (self.decisions // self.explore_every) % FAR_REFRESH:
            candidates = self._contenders(candidates)
        if self._busy():  # a phase slows every request beside it: only
            # settings measured before (never measured ones wait for a quiet moment)
            candidates = [s for s in candidates if self.cost_per_token(s) is not None]
            if not candidates:
                return None

        def last_seen(s: Setting) -> int:
            m = self.measured.get(s)
            return m.last_seen if m else -1

        s = min(candidates, key=lambda s: (last_seen(s), s))
        return Decision(s, self._re_measuring(s), True, RE_MEASURING)

    @staticmethod
    def _re_measuring(s: Setting) -> str:
        return f"re-measuring {s.label()} (the one seen least recently)"

    def _best(self, candidates: list[Setting]) -> Decision:
        priced = sorted((c, s) for s in candidates if (c := self.cost_per_token(s)) is not None)
        if not priced:  # calibration measured nothing clean: no draft risks nothing
            s = Setting.no_draft() if Setting.no_draft() in candidates else candidates[0]
            return Decision(
                s,
                f"{s.label()}: nothing measured clean ({self.mixed} requests mixed: other "
                "settings always ran beside them)",
                exploring=False,
            )
        (cost, best), rest = priced[0], priced[1:]
        reason = f"{best.label()}: {self._price(best, cost)}"
        tie = self._tie(best, cost, candidates)
        if tie is not None:  # what the version's other requests run: as good as ours
            rest = [(cost, best)]
            (cost, best) = tie
            reason = f"{best.label()}: {self._price(best, cost)}, the model version's choice"
        if rest:
            cost2, second = rest[0]
            reason += f"; next best {second.label()}: {self._price(second, cost2)}"
        if self.costs is None and self.price == "model":
            reason += (
                "; no cost curves (start the stages and the draft with --measure-costs): "
                "every step taken as equal"
            )
        return Decision(best, reason, exploring=False)

    def _tie(
        self, best: Setting, cost: float, candidates: list[Setting]
    ) -> tuple[float, Setting] | None:
        """The model version's choice (another regime's, `Shared.choice`) with its price
        here, where it is not `best` but priced within `TIE_RATIO` of it: equally good,
        and requests of one setting do not mix (two regimes' different bests would, in
        their steady state)."""
        other = self.shared.choice
        if self.shared.chooser is self or other is None or other == best:
            return None  # its own last choice is no tie-break: the best measured wins
        if other not in candidates:
            return None
        c = self.cost_per_token(other)
        return (c, other) if c is not None and c <= TIE_RATIO * cost else None

    def _price(self, s: Setting, cost: float) -> str:
        m = self.measured[s]
        step = self.step_seconds(s)
        if self.price == "wall":
            return (
                f"{cost * 1e3:.2f} ms/token measured ({m.tokens_per_step:.2f} tokens/step, "
                f"hit rate {m.hit_rate:.2f})"
            )
        if step is None:
            return f"{cost:.2f} steps/token ({m.tokens_per_step:.2f} tokens/step)"
        return (
            f"{cost * 1e3:.2f} ms/token ({m.tokens_per_step:.2f} tokens/step, "
            f"step {step * 1e3:.2f} ms)"
        )

    # -- measurements --------------------------------------------------------------------
    def finish(
        self,
        setting: Setting,
        expected_tokens: int,
        tokens: int = 0,
        steps: int = 0,
        hits: int = 0,
        wall_seconds: float = 0.0,
        clean: bool = True,
    ) -> None:
        """A request with `setting` ended; `steps` 0: it failed or ran with another
        setting than asked (a narrower width), so it says nothing about this one.
        `wall_seconds`: from its first token to its last; `clean`: no request of another
        setting ran beside it (`overlaps.Overlaps`), else its time says little about its own
        setting (the `wall` price discards it)."""
        had = self.pending.get(setting, 0)
        self.shared.pending -= min(had, expected_tokens)
        left = had - expected_tokens
        if left > 0:
            self.pending[setting] = left
        else:
            self.pending.pop(setting, None)
        if steps <= 0 or tokens <= 0:
            return
        m = self.measured.setdefault(setting, Measured())
        if not clean and self.price == "wall":
            m.mixed += 1
            self.mixed += 1
            return
        if clean:  # whatever disturbed the bounded phases has gone: calibrate again
            self.bounded.clear()
        p = self.phase
        if p is not None and p.owner is self and p.setting == setting:
            p.clean += 1
        if m.tokens + tokens > self.window_tokens:  # fade: newer requests weigh more
            for name in ("requests", "tokens", "steps", "hits", "wall_seconds", "intervals"):
                setattr(m, name, getattr(m, name) / 2)
        m.requests += 1
        m.tokens += tokens
        m.steps += steps
        m.hits += hits
        if tokens > 1:
            m.wall_seconds += wall_seconds
            m.intervals += tokens - 1
        m.last_seen = self.decisions
