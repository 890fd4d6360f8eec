"""The router's view of the deployment: the live set of stage and draft replicas, their
health, identity and load, the model versions they make up, and the path (one replica
per stage, one draft) each new request runs on (docs/architecture.md, "1. Services").

Replicas come from a `Discovery` source (discovery.py) and change while the router runs.
A replica takes traffic only once its health said SERVING and it answered `Describe`
(layers, model, weight hash) since it was found, listed again or last failed a check;
one that drains (NOT_SERVING), is terminating, or leaves discovery takes no new requests
and keeps the ones it has; one that stops answering is reported down (`on_down`), and
the requests on it are replayed elsewhere. Each replica is checked on its own schedule,
so one that hangs delays no other's checks. A replica that has not answered a check for
`stall_seconds` (2 s by default; SIGSTOP, a frozen host) is *stalled*: it takes no new
requests, and every request waiting on it treats it as dead for its path (the request
driver replays it elsewhere, as on a kill) without waiting for the checks to time out.
A replica that this router's requests showed working within the last check interval (a
verification of a path it is on, an answer of the draft) counts as having answered, and
is checked only every `PROVEN_CHECKS` intervals while that goes on.
A replica that failed a check and holds no request gets a fresh channel, so one that
restarted is seen at the next check rather than after gRPC's reconnect backoff.

Among the eligible replicas of one layer range (and among drafts) a new request goes to
the one where its step is expected soonest (`Backends.pick`, the one place that choice
is made): where every candidate published the cost curve it measured at start
(`--measure-costs`, Describe's `cost_curve`), each is priced at its load, the rows in
flight there plus the new request's, so at equal load the faster kind wins, and a
faster replica takes more rows before a slower one is as quick (on accelerator-like,
flat curves: every request until its curve rises). Replicas priced within
`SPEED_TOLERANCE` of the best are equal (identical replicas measure a little
differently) and go by load: rows in flight, requests, free KV cache, then round robin.
Without curves, load alone decides. (Measured against the alternative of load first and
speed only to break exact ties, benchmarks/bench_mixed_replicas.py: that one lost the
fast replica whenever a closed-loop client's next request came before the last one's
release was done, and was no faster at 8 clients than load alone.)

A model version is the content hash of the target's weights (`weight_hash`). A version
is complete when its healthy stages chain from layer 0 to the last one. New requests go
to the newest complete version (ranked by when discovery first listed its stages), so a
new version's stages take new requests as soon as they make a complete path and the old
version's drain; a request stays on its version to the end, also when replayed. All
versions must keep the vocabulary of the first one this router served: a version with
another is refused (its replicas are listed with the reason, never used).

One module: health, identity, load and versions are facts of the same replica set, and
choosing a path reads them all at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from specpipe.common.perf.cost_model import CostCurve
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import draft_pb2, draft_pb2_grpc, stage_pb2, stage_pb2_grpc

from ..control import cost_curve_from_proto
from ..grpc_util import SERVING, channel, rpc_error_text
from .control_stream import ControlFrames, DraftStream, StageStream, control_stream
from .discovery import Discovery, Endpoint
from .prefix_affinity import PrefixIndex, PromptKeys, key_limit, prefer_prefix

log = logging.getLogger(__name__)

# A replica that has not answered a health check for this long is stalled (see above).
DEFAULT_STALL_SECONDS = 2.0
# Replicas whose expected step is within this share of the fastest count as equally fast
# (cost curves of identical replicas differ by measurement noise): load decides there.
SPEED_TOLERANCE = 0.1
# A replica whose requests show it working is checked only every this many intervals
# (`Backends._due`): its identity and load stay fresh, and a replica that stops
# working is checked again within an interval.
PROVEN_CHECKS = 4
# ... unless its KV cache is this short of room: its load then decides where new requests
# go and whether they fit, and a Describe is what tells it
SHORT_OF_ROOM = 0.2


class NoPath(RuntimeError):
    """No complete set of healthy replicas can serve a request right now."""


@dataclass(eq=False)
class Backend:
    kind: str  # "stage" or "draft"
    address: str
    channel: grpc.aio.Channel
    stub: object
    health: health_pb2_grpc.HealthStub
    endpoint: Endpoint
    desc: object | None = None
    healthy: bool = False  # described and SERVING
    error: str = "not contacted yet"
    slow_checks: int = 0
    # Load, written only by `Claim`: requests of this router with this replica on their
    # path, and their rows in flight here (path choice weighs both)
    active: int = 0
    rows: int = 0
    draining: bool = False  # reports NOT_SERVING: takes no new requests, finishes its own
    listed: bool = True  # in the discovery source's current set
    refused: str = ""  # why it may never serve here (incompatible); "" if none
    found_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None  # first time it could take a request
    first_request_at: float | None = None
    served: int = 0  # requests given to it so far (spreads equal loads round robin)
    answered_at: float | None = None  # the last time it answered a health check
    # the last time this router's own traffic showed it working (a verification of a
    # path it is on, the draft's answer): its checks can be sparser (`Backends._due`)
    progressed_at: float | None = None
    asked_since: float | None = None  # a check has been waiting for its answer since
    stalled: bool = False  # no answer for the stall limit (see the module docstring)
    # its control stream: a stage's feeds, prunes and releases, the draft's calls
    control: StageStream | DraftStream | None = field(default=None, repr=False)
    _curve: tuple[object, CostCurve | None] = field(default=(None, None), repr=False)
    # block keys of the prompts sent to it (prefix-aware routing, prefix_affinity.py)
    prefixes: PrefixIndex = field(default_factory=PrefixIndex, repr=False)

    @property
    def cost_curve(self) -> CostCurve | None:
        """The cost curve it published in its last Describe (None: not measured)."""
        d = self.desc
        if self._curve[0] is not d:
            msg = getattr(d, "cost_curve", None) if d is not None else None
            self._curve = (d, cost_curve_from_proto(msg))
        return self._curve[1]

    def expected_seconds(self, rows_per_request: float) -> float | None:
        """Its step's seconds by its cost curve if a request of `rows_per_request` rows
        joins: the rows in flight of this router's requests there, at least that many
        per request it holds (ours not yet counting rows, and others' as reported), plus
        the new one's. None without a curve."""
        curve = self.cost_curve
        if curve is None:
            return None
        reported = getattr(self.desc, "active_requests", 0)
        rows = max(self.rows, rows_per_request * max(self.active, reported))
        return curve(math.ceil(rows + rows_per_request))

    @property
    def layers(self) -> tuple[int, int]:
        assert self.kind == "stage" and self.desc is not None
        return (self.desc.layer_start, self.desc.layer_end)

    @property
    def version(self) -> str:
        return self.desc.weight_hash if self.desc is not None else ""

    @property
    def label(self) -> str:
        if self.kind == "stage" and self.desc is not None:
            a, b = self.layers
            return f"stage {a}:{b} at {self.address}"
        return f"{self.kind} at {self.address}"

    @property
    def eligible(self) -> bool:
        """May take a new request."""
        return (
            self.healthy
            and self.listed
            and not self.stalled
            and not self.draining
            and not self.refused
            and not self.endpoint.draining
        )

    @property
    def has_room(self) -> bool:
        """Its KV cache budget is not used up (as of its last Describe)."""
        d = self.desc
        limit = getattr(d, "cache_bytes_limit", 0) if d is not None else 0
        return not limit or d.cache_bytes_used < limit

    @property
    def free_share(self) -> float:
        """The free share of the KV cache budget, in tenths: budgets differ a little by
        the free memory each replica saw at start, and that must not decide ties."""
        d = self.desc
        limit = getattr(d, "cache_bytes_limit", 0) if d is not None else 0
        return math.floor(10 * (limit - d.cache_bytes_used) / limit) / 10 if limit else 1.0

    def load_key(self) -> tuple:
        """Less is better: rows in flight, requests, the most free KV cache; then the one
        given fewer requests so far."""
        reported = getattr(self.desc, "active_requests", 0) if self.desc is not None else 0
        return (self.rows, self.active, reported, -self.free_share, self.served)


@dataclass
class RequestPath:
    """One replica per stage (in layer order) and the draft, for one request."""

    stages: list[Backend]
    draft: Backend | None

    @property
    def backends(self) -> list[Backend]:
        return [*self.stages, *([self.draft] if self.draft else [])]

    @property
    def version(self) -> str:
        return self.stages[0].version


class Claim:
    """One request's load on the replicas of its path: it counts on each (`active`)
    and its rows in flight count on each stage (`rows`) from `Backends.acquire` until
    `release`; `leave` gives up one replica early (a lost draft). The only writer of
    `Backend.active` and `Backend.rows`, so a replica's load has one owner."""

    def __init__(self, path: RequestPath) -> None:
        self._held = path.backends
        self._stages = list(path.stages)
        self._rows = 0
        for b in self._held:
            b.active += 1

    def count_rows(self, rows: int) -> None:
        """The request now has `rows` tree rows in flight on its stages."""
        if rows != self._rows:
            for b in self._stages:
                b.rows += rows - self._rows
            self._rows = rows

    def leave(self, b: Backend) -> None:
        if b in self._held:
            self._held.remove(b)
            b.active -= 1
            if b in self._stages:
                self._stages.remove(b)
                b.rows -= self._rows

    def release(self) -> None:
        self.count_rows(0)
        for b in self._held:
            b.active -= 1
        self._held, self._stages = [], []


@dataclass
class ModelInfo:
    model_id: str
    weight_hash: str
    num_layers: int
    vocab_size: int
    max_positions: int
    eos_token_ids: tuple[int, ...]
    ranges: list[tuple[int, int]] = field(default_factory=list)
    draft_model: str = ""
    draft_vocab: int = 0
    rank: float = 0.0  # newer versions rank higher (discovery order)


def _chains(ranges: Iterable[tuple[int, int]], num_layers: int) -> list[list[tuple[int, int]]]:
    """Every way to cover layers [0, num_layers) with the given ranges, end to end."""
    starts: dict[int, list[tuple[int, int]]] = {}
    for r in sorted(set(ranges)):
        starts.setdefault(r[0], []).append(r)
    out: list[list[tuple[int, int]]] = []

    def walk(at: int, chain: list[tuple[int, int]]) -> None:
        if at == num_layers:
            out.append(list(chain))
            return
        for r in starts.get(at, []):
            if r[1] > at and len(out) < 64:
                chain.append(r)
                walk(r[1], chain)
                chain.pop()

    walk(0, [])
    return out


class Backends:
    def __init__(
        self,
        discovery: Discovery,
        on_down: Callable[[Backend, str], None],
        on_readiness: Callable[[bool], object],
        check_interval: float = 0.5,
        check_timeout: float = 2.0,
        transport_kind: str | None = None,
        make_channel: Callable[[str], grpc.aio.Channel] = channel,
        on_version: Callable[[ModelInfo], None] | None = None,
        stall_seconds: float = DEFAULT_STALL_SECONDS,
        control_frames: ControlFrames | None = None,
        relay_prunes: bool = True,
    ) -> None:
        """`control_frames`: the router's data plane, which carries feeds and prunes to
        the stages, and calls to the drafts, that take control frames (None: their
        control streams do). `relay_prunes`: send a request's prunes to its first stage
        only where every stage of its path relays them (False: to every stage)."""
        self.discovery = discovery
        self.control_frames = control_frames
        self.relay_prunes = relay_prunes
        self.stall_seconds = stall_seconds
        self._make_channel = make_channel  # mutual TLS with --secure
        self.on_down, self.on_readiness = on_down, on_readiness
        self.on_version = on_version
        self.check_interval, self.check_timeout = check_interval, check_timeout
        self.transport_kind = transport_kind
        self.by_key: dict[tuple[str, str], Backend] = {}
        self.versions: dict[str, ModelInfo] = {}  # complete versions now
        self.model: ModelInfo | None = None  # the newest complete version (or the last one)
        self.vocab_size: int | None = None  # fixed by the first version served
        self._ready = False
        self._seen_draft = False
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self._changed = asyncio.Event()
        self.published = 0  # sets the discovery source published (for tests and metrics)
        initial = discovery.initial()
        if initial is not None:
            self.update(initial)

    # -- the replicas ---------------------------------------------------------------------
    @property
    def all(self) -> list[Backend]:
        return list(self.by_key.values())

    @property
    def stages(self) -> list[Backend]:
        return [b for b in self.by_key.values() if b.kind == "stage"]

    @property
    def drafts(self) -> list[Backend]:
        return [b for b in self.by_key.values() if b.kind == "draft"]

    @property
    def has_draft(self) -> bool:
        """Whether the deployment has drafts: one was ever listed (while none is up, a
        request that wants one runs without it, as pp)."""
        if not self._seen_draft:
            self._seen_draft = any(b.listed for b in self.drafts)
        return self._seen_draft

    @property
    def ready(self) -> bool:
        """A complete path of some version exists."""
        return self._ready

    def _backend(self, ep: Endpoint) -> Backend:
        b = Backend(ep.kind, ep.address, None, None, None, ep)  # type: ignore[arg-type]
        self._connect(b)
        return b

    def _connect(self, b: Backend) -> None:
        """A (new) channel to `b`, and its stubs."""
        ch = self._make_channel(b.address)
        stub = (stage_pb2_grpc.StageStub if b.kind == "stage" else draft_pb2_grpc.DraftStub)(ch)
        b.channel, b.stub, b.health = ch, stub, health_pb2_grpc.HealthStub(ch)
        b.control = control_stream(b.kind, stub, f"{b.kind} at {b.address}")

    def _reconnect(self, b: Backend) -> None:
        """A fresh channel for a replica that failed a check and holds no request of
        ours (nothing uses the old one): a replica that restarted is reached at the next
        check, not after the old channel's reconnect backoff (up to 2 s)."""
        if b.active > 0 or b.channel is None:
            return
        old, old_control = b.channel, b.control
        self._connect(b)
        self._in_background(old.close())
        if old_control is not None:
            self._in_background(old_control.close())

    def _in_background(self, call) -> None:
        task = asyncio.ensure_future(call)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def stalled_for(self, b: Backend, now: float | None = None) -> float:
        """How long `b` has not answered a check that is waiting for its answer (0 when
        none is waiting): `stall_seconds` or more makes it stalled."""
        if b.asked_since is None or b.answered_at is None:
            return 0.0
        alive = max(b.answered_at, b.progressed_at or 0.0)
        return (time.monotonic() if now is None else now) - alive

    def _due(self, b: Backend, now: float) -> bool:
        """Whether `b`'s next health check is due now that its interval passed: not
        while its requests showed it working within the last interval and its last
        check is less than `PROVEN_CHECKS` intervals old (a Describe per replica every
        `check_interval` cost the router about a tenth of its CPU per step at one
        client, issue 34; identity and load are still refreshed every few intervals), and
        not while it is short of KV cache room (`SHORT_OF_ROOM`)."""
        p, answered = b.progressed_at, b.answered_at
        return (
            p is None
            or answered is None
            or not b.healthy
            or b.stalled
            or b.free_share <= SHORT_OF_ROOM
            or now - p >= self.check_interval
            or now - answered >= PROVEN_CHECKS * self.check_interval
        )

    def update(self, endpoints: frozenset[Endpoint]) -> None:
        """The discovery source's current set: new replicas are added (and described by
        the monitor before they take traffic); ones no longer listed take no new
        requests and go once their requests are done."""
        self.published += 1
        keys = set()
        for ep in endpoints:
            keys.add(ep.key)
            b = self.by_key.get(ep.key)
            if b is None:
                self.by_key[ep.key] = self._backend(ep)
                log.info(
                    "discovered %s %s%s", ep.kind, ep.address, f" ({ep.group})" if ep.group else ""
                )
            else:
                if not b.listed:
                    # It may have restarted meanwhile: no traffic before a check passes.
                    log.info("%s is listed again", b.label)
                    if b.healthy:
                        b.healthy, b.error = False, "listed again: not checked yet"
                    self._reconnect(b)
                b.endpoint, b.listed = ep, True
        for key, b in self.by_key.items():
            if key not in keys and b.listed:
                b.listed = False
                log.info("%s left discovery: no new requests", b.label)
        self._changed.set()
        self._recompute()

    # -- start-up ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._tasks:
            return

        async def follow() -> None:
            try:
                await self.discovery.run(self.update)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("discovery (%s) failed", self.discovery.describe())
                raise

        self._tasks = [
            asyncio.create_task(follow(), name="discovery"),
            asyncio.create_task(self._watch(), name="health-monitor"),
        ]

    async def connect(self, timeout: float) -> ModelInfo:
        """Follow discovery and wait until a complete path of some version exists, with
        a draft when the deployment lists any (later, a request that finds no draft up
        runs without one)."""
        await self.start()
        deadline = time.monotonic() + timeout

        def drafts_ok() -> bool:
            listed = [d for d in self.drafts if d.listed]
            return not listed or any(d.eligible for d in listed)

        while self.model is None or not self._ready or not drafts_ok():
            for t in self._tasks:
                if t.done() and t.exception() is not None:
                    raise NoPath(f"discovery failed: {t.exception()}")
            if time.monotonic() > deadline:
                raise NoPath(f"no complete path after {timeout:.0f} s: {self.why_no_path()}")
            await asyncio.sleep(0.05)
        return self.model

    def why_no_path(self) -> str:
        if not self.by_key:
            return f"{self.discovery.describe()} lists no stage"
        parts = []
        for b in self.all:
            state = b.refused or ("" if b.eligible else b.error or "draining")
            if state:
                parts.append(f"{b.label}: {state}")
        if not parts:
            ranges = sorted({b.layers for b in self.stages if b.desc is not None})
            parts.append(
                f"stage layer ranges {ranges} do not chain from the first layer to the last"
            )
        return "; ".join(parts)

    # -- identity ------------------------------------------------------------------------
    def _refusal(self, b: Backend) -> str:
        d = b.desc
        if b.kind == "stage":
            scheme = d.data_address.partition("://")[0]
            if self.transport_kind and scheme != self.transport_kind:
                return (
                    f"uses the {scheme} data plane, this router {self.transport_kind}: start "
                    "every service of a deployment with the same --transport"
                )
            if self.vocab_size is not None and d.vocab_size != self.vocab_size:
                return (
                    f"model {d.model_id} ({d.weight_hash}) has a vocabulary of {d.vocab_size} "
                    f"tokens, this router serves {self.vocab_size}: a new model version must "
                    "keep the vocabulary (deploy it with its own router)"
                )
            if not 0 <= d.layer_start < d.layer_end <= d.num_layers:
                return f"bad layer range {d.layer_start}:{d.layer_end} of {d.num_layers}"
        elif self.vocab_size is not None and d.vocab_size > self.vocab_size:
            return (
                f"draft vocabulary ({d.vocab_size}) is larger than the target's ({self.vocab_size})"
            )
        return ""

    def _recompute(self) -> None:
        """Complete versions, the current one, readiness."""
        by_version: dict[str, list[Backend]] = {}
        for b in self.stages:
            if b.eligible:
                by_version.setdefault(b.version, []).append(b)
        versions = {}
        for wh, stages in by_version.items():
            first = stages[0].desc
            chains = _chains((b.layers for b in stages), first.num_layers)
            if not chains:
                continue
            info = ModelInfo(
                model_id=first.model_id,
                weight_hash=wh,
                num_layers=first.num_layers,
                vocab_size=first.vocab_size,
                max_positions=first.max_position_embeddings,
                eos_token_ids=tuple(first.eos_token_ids),
                ranges=chains[0],
                rank=min(b.endpoint.order for b in stages),
            )
            drafts = [d for d in self.drafts if d.eligible and d.desc.vocab_size <= info.vocab_size]
            if drafts:
                groups = {b.endpoint.group for b in stages}
                same = [d for d in drafts if d.endpoint.group in groups] or drafts
                info.draft_model, info.draft_vocab = same[0].desc.model_id, same[0].desc.vocab_size
            versions[wh] = info
        self.versions = versions
        if versions:
            newest = max(versions.values(), key=lambda m: (m.rank, m.weight_hash))
            if self.vocab_size is None:
                self.vocab_size = newest.vocab_size
                for b in self.all:  # what was described before the vocabulary was known
                    if b.desc is not None and not b.refused:
                        b.refused = self._refusal(b)
                if any(b.refused for b in self.all):
                    self._recompute()
                    return
            previous = self.model
            self.model = newest
            if previous is None or previous.weight_hash != newest.weight_hash:
                log.info(
                    "new requests go to model %s version %s (%d stages)",
                    newest.model_id, newest.weight_hash, len(newest.ranges),
                )  # fmt: skip
                if self.on_version is not None:
                    self.on_version(newest)
        self._set_ready(bool(versions))

    # -- paths ---------------------------------------------------------------------------
    def path(
        self,
        version: str | None = None,
        need_draft: bool = True,
        exclude: Iterable[Backend] = (),
        prompt: Sequence[int] = (),
        cache_salt: bytes = b"",
    ) -> RequestPath:
        """An eligible replica of every stage of `version` (None: the newest complete
        version that has room), each the one `pick` chooses, and a draft when `need_draft`
        and one is up (else None: the request goes on without). NoPath says why there is
        none. With `prompt`, a replica that was sent a longer prefix of it is preferred,
        load permitting (`prefix_affinity.prefer_prefix`), and remembers this one; `cache_salt`:
        the prompt's prefix-cache salt (its keys are those the replicas compute)."""
        excluded = set(exclude)
        keys = PromptKeys(prompt, cache_salt)
        if version is not None:
            candidates = [version]
        else:
            candidates = [
                m.weight_hash for m in sorted(self.versions.values(), key=lambda m: -m.rank)
            ]
            if not candidates:
                known = sorted({b.version for b in self.stages if b.desc is not None})
                reasons = [self._missing(v, excluded) for v in known if not self.refused(v)]
                raise NoPath("; ".join(reasons) or self.why_no_path())
        reasons = []
        for wh in candidates:
            try:
                stages = self._stages_of(wh, excluded, keys)
            except NoPath as e:
                reasons.append(str(e))
                continue
            if keys:
                for b in stages:
                    b.prefixes.add(keys.of(b.desc), key_limit(b.desc))
            draft = self._draft_for(stages, excluded) if need_draft else None
            return RequestPath(stages, draft)
        raise NoPath("; ".join(reasons))

    def pick(self, replicas: list[Backend], rows_per_request: float | None = None) -> Backend:
        """The replica of `replicas` (one layer range, or drafts) a new request goes to:
        the least loaded among those expected fastest (module docstring)."""
        if rows_per_request is None:
            rows_per_request = self.rows_per_request()
        expected = [b.expected_seconds(rows_per_request) for b in replicas]
        if len(replicas) > 1 and None not in expected:
            fastest = min(expected)
            replicas = [
                b
                for b, sec in zip(replicas, expected, strict=True)
                if sec <= fastest * (1 + SPEED_TOLERANCE)
            ]
        return min(replicas, key=Backend.load_key)

    def rows_per_request(self) -> float:
        """Rows in flight per request of this router on its stages now (1 when none)."""
        active = [b for b in self.stages if b.active > 0]
        requests = sum(b.active for b in active)
        return max(1.0, sum(b.rows for b in active) / requests) if requests else 1.0

    def _stages_of(
        self, version: str, excluded: set[Backend], keys: PromptKeys | None = None
    ) -> list[Backend]:
        usable: dict[tuple[int, int], list[Backend]] = {}
        num_layers = 0
        for b in self.stages:
            if b.eligible and b.version == version and b.has_room and b not in excluded:
                usable.setdefault(b.layers, []).append(b)
                num_layers = b.desc.num_layers
        best: list[Backend] | None = None
        best_key = None
        per_request = self.rows_per_request()
        for chain in _chains(usable, num_layers) if usable else []:
            chosen = [
                prefer_prefix(usable[r], lambda reps: self.pick(reps, per_request), keys)
                for r in chain
            ]
            key = (max(b.load_key() for b in chosen), len(chain))
            if best_key is None or key < best_key:
                best, best_key = chosen, key
        if best is None:
            raise NoPath(self._missing(version, excluded))
        return best

    def refused(self, version: str) -> bool:
        """Whether every replica of `version` is refused (never used here)."""
        return all(b.refused for b in self.stages if b.version == version)

    def _missing(self, version: str, excluded: set[Backend]) -> str:
        """Why `version` has no path: the layer ranges no usable replica serves."""
        replicas = [b for b in self.stages if b.version == version]
        if not replicas:
            return "no stage serves it"

        def why(b: Backend) -> str:
            if b in excluded:
                return "failed for this request"
            if not b.eligible:
                return b.refused or b.error or "draining"
            return "" if b.has_room else "its KV cache is full"

        out = []
        for rng in sorted({b.layers for b in replicas}):
            reps = [b for b in replicas if b.layers == rng]
            reasons = [(b, why(b)) for b in reps]
            if all(r for _, r in reasons):
                down = "; ".join(f"{b.label}: {r}" for b, r in reasons)
                out.append(f"no healthy replica of layers {rng[0]}:{rng[1]} ({down})")
        if not out:
            ranges = sorted({b.layers for b in replicas})
            out.append(f"stage layer ranges {ranges} do not chain from the first layer to the last")
        return "; ".join(out)

    def _draft_for(self, stages: list[Backend], excluded: set[Backend]) -> Backend | None:
        vocab = stages[0].desc.vocab_size
        drafts = [
            d for d in self.drafts
            if d.eligible and d not in excluded and d.desc.vocab_size <= vocab
        ]  # fmt: skip
        if not drafts:
            return None
        groups = {b.endpoint.group for b in stages}
        same = [d for d in drafts if d.endpoint.group in groups] or drafts
        return self.pick(same)

    def acquire(self, path: RequestPath) -> Claim:
        """Count a request on the replicas of `path` until its claim is released."""
        now = time.monotonic()
        for b in path.backends:
            b.served += 1
            if b.first_request_at is None:
                b.first_request_at = now
        return Claim(path)

    def suspect(self, b: Backend, error: str) -> None:
        """A request could not reach `b`: no new requests until its health says otherwise."""
        if b.healthy:
            b.healthy, b.error = False, error
            log.warning("%s failed a request: %s", b.label, error)
            self._recompute()

    # -- health ----------------------------------------------------------------------------
    def _set_ready(self, ready: bool) -> None:
        if ready != self._ready:
            self._ready = ready
            log.info("router %s", "ready" if ready else "NOT ready (no complete path)")
            result = self.on_readiness(ready)
            if asyncio.iscoroutine(result):
                task = asyncio.ensure_future(result)
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def _watch(self) -> None:
        """Check every replica, each on its own (a check that hangs delays no other),
        every `check_interval`; mark stalls; forget replicas gone from discovery."""
        checks: dict[Backend, asyncio.Task] = {}
        next_check: dict[Backend, float] = {}
        try:
            while True:
                now = time.monotonic()
                for b in self.all:
                    t = checks.get(b)
                    if (t is None or t.done()) and now >= next_check.get(b, 0.0):
                        if self._due(b, now):
                            checks[b] = asyncio.create_task(self._check(b))
                        next_check[b] = now + self.check_interval
                self.mark_stalls(now)
                for key, b in list(self.by_key.items()):
                    if not b.listed and b.active <= 0:
                        del self.by_key[key]
                        log.info("%s removed", b.label)
                        t = checks.pop(b, None)
                        if t is not None:
                            t.cancel()
                        next_check.pop(b, None)
                        self._in_background(b.channel.close())
                self._recompute()
                self._changed.clear()
                tick = min(self.check_interval, max(self.stall_seconds / 4, 0.01))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), tick)
                if self._changed.is_set():  # new replicas: check them now
                    next_check.clear()
        finally:
            for t in checks.values():
                t.cancel()

    def mark_stalls(self, now: float) -> None:
        """Replicas that have not answered for `stall_seconds` take no new requests (the
        drivers of requests on them replay those, see driver.py); one that answers again
        is checked like any other."""
        for b in self.all:
            stalled = self.stalled_for(b, now) >= self.stall_seconds
            if stalled and not b.stalled:
                b.stalled = True
                b.error = f"stalled: no answer for {self.stalled_for(b, now):.1f} s"
                log.warning("%s is stalled: no answer to a health check for %.1f s",
                            b.label, self.stalled_for(b, now))  # fmt: skip
            elif b.stalled and not stalled:
                b.stalled = False
                if b.error.startswith("stalled"):
                    b.error = ""
                log.info("%s answers again", b.label)

    async def _check(self, b: Backend) -> None:
        if b.asked_since is None:
            b.asked_since = time.monotonic()
        try:  # identity (a restarted replica may hold other weights), load and health
            desc = await b.stub.Describe(pb.DescribeRequest(), timeout=self.check_timeout)
            status = desc.health_status or await self._health(b)  # 0: an older version
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                b.slow_checks += 1
                if b.slow_checks < 3:
                    return  # busy, not necessarily dead (stalled, if it goes on)
            err = rpc_error_text(e)
            was_up = b.healthy or b.draining
            b.healthy, b.draining, b.error = False, False, err
            if was_up:
                log.warning("%s is down: %s", b.label, err)
                self._recompute()
            if was_up or b.active:  # requests still on it are replayed elsewhere
                self.on_down(b, err)
            self._reconnect(b)
            return
        b.answered_at, b.asked_since = time.monotonic(), None
        if b.stalled:
            self.mark_stalls(b.answered_at)
        b.slow_checks = 0
        if status != SERVING:
            # Draining (shutting down): no new requests go there, but it still serves the
            # ones it has, so they are not failed; if it dies, the next check says so.
            was_healthy = b.healthy
            b.healthy, b.draining = False, True
            b.error = "reports NOT_SERVING (shutting down or not loaded)"
            if was_healthy:
                log.warning("%s reports NOT_SERVING (draining?)", b.label)
                self._recompute()
            return
        if b.kind == "stage" and not desc.ready:
            b.healthy, b.error = False, "no model loaded yet"
            return
        before = b.desc
        b.desc = desc
        if b.control is not None:
            b.control.carry_on(self.control_frames, self._frames_address(desc))
            if isinstance(b.control, StageStream):
                b.control.relays = self.relay_prunes and desc.relay_prunes
        identity = ("weight_hash", "layer_start", "layer_end", "num_layers", "vocab_size")
        if before is None or any(
            getattr(before, f, None) != getattr(desc, f, None) for f in identity
        ):
            b.refused = self._refusal(b)
            if b.refused:
                log.error("%s refused: %s", b.label, b.refused)
            elif before is not None:
                log.warning("%s changed identity (restarted with other weights?)", b.label)
        if not b.healthy:
            b.healthy, b.draining, b.error = True, False, ""
            if b.ready_at is None:
                b.ready_at = time.monotonic()
            log.info("%s is up: %s %s", b.label, desc.model_id, desc.weight_hash)
            self._recompute()

    def _frames_address(self, desc: stage_pb2.StageDescription | draft_pb2.DraftDescription) -> str:
        """Where a replica takes control frames from this router: its data-plane address
        if it takes them on this router's transport; "" (its control stream) if not."""
        if self.control_frames is None or not desc.control_frames:
            return ""
        if desc.data_address.partition("://")[0] != self.control_frames.transport.scheme:
            return ""  # a draft of another --transport: its stream carries its calls
        return desc.data_address

    async def _health(self, b: Backend) -> int:
        """What `b`'s gRPC health service answers for the whole server."""
        req = health_pb2.HealthCheckRequest(service="")
        return (await b.health.Check(req, timeout=self.check_timeout)).status

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for b in self.all:
            if b.control is not None:
                await b.control.close()
            await b.channel.close()
        if self._background:
            await asyncio.wait(self._background, timeout=5.0)
