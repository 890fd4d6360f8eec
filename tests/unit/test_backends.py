"""The router's replica set without a deployment: model versions, paths (one replica per
stage of one version, least loaded, with room), drafts, and what is refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from specpipe.services.control import cost_curve_from_proto
from specpipe.services.router.backends import Backend, Backends, NoPath
from specpipe.services.router.discovery import Endpoint, StaticDiscovery
from specpipe.v1 import dataplane_pb2 as pb


def backends() -> Backends:
    # No initial endpoints: no gRPC channel (it would need an event loop).
    return Backends(StaticDiscovery([]), on_down=lambda b, e: None,
                    on_readiness=lambda ready: None, transport_kind="tcp")  # fmt: skip


def add(bs: Backends, kind, address, layers=(0, 4), version="v1", *, vocab=97, group="",
        order=0.0, limit=0, used=0, num_layers=4, curve=None) -> Backend:  # fmt: skip
    desc = SimpleNamespace(
        model_id=f"model-{version}", weight_hash=version, layer_start=layers[0],
        layer_end=layers[1], num_layers=num_layers, vocab_size=vocab,
        max_position_embeddings=256, eos_token_ids=[96], data_address="tcp://h:1",
        cache_bytes_used=used, cache_bytes_limit=limit, active_requests=0, ready=True,
        cost_curve=curve,
    )  # fmt: skip
    ep = Endpoint(kind, address, group, order=order)
    b = Backend(kind, address, None, None, None, ep, desc=desc, healthy=True, error="")
    bs.by_key[ep.key] = b
    b.refused = bs._refusal(b)
    bs._recompute()
    return b


def test_new_requests_take_the_newest_complete_version_replays_keep_theirs() -> None:
    bs = backends()
    a0, a1 = add(bs, "stage", "a0", (0, 2), "v1"), add(bs, "stage", "a1", (2, 4), "v1")
    assert bs.ready and bs.model.weight_hash == "v1" and bs.model.ranges == [(0, 2), (2, 4)]
    b0 = add(bs, "stage", "b0", (0, 3), "v2", order=5.0)
    assert bs.model.weight_hash == "v1"  # v2 is not complete yet
    b1 = add(bs, "stage", "b1", (3, 4), "v2", order=5.0)
    assert bs.model.weight_hash == "v2"
    assert bs.path(need_draft=False).stages == [b0, b1]
    assert bs.path("v1", need_draft=False).stages == [a0, a1]  # a replay stays on v1
    b1.healthy = False
    bs._recompute()
    assert bs.model.weight_hash == "v1" and bs.path(need_draft=False).stages == [a0, a1]
    with pytest.raises(NoPath, match=r"no healthy replica of layers 3:4"):
        bs.path("v2", need_draft=False)


def test_least_loaded_replica_with_room_round_robin_on_ties() -> None:
    bs = backends()
    s0 = add(bs, "stage", "s0", (0, 4))
    s1 = add(bs, "stage", "s1", (0, 4))
    full = add(bs, "stage", "s2", (0, 4), limit=100, used=100)
    picks = []
    for _ in range(4):
        path = bs.path(need_draft=False)
        bs.acquire(path).release()
        picks.append(path.stages[0])
    assert picks == [s0, s1, s0, s1] and full not in picks  # its KV cache is full
    s0.rows = 10
    assert bs.path(need_draft=False).stages == [s1]
    s1.active, s1.rows = 3, 10
    assert bs.path(need_draft=False).stages == [s0]
    assert bs.path(need_draft=False, exclude=[s0]).stages == [s1]


def test_replicas_with_slightly_different_cache_budgets_share_the_requests() -> None:
    """A replica started later saw less free memory, so its budget is a little smaller:
    it must still take its share (a budget is only a tiebreaker in tenths free)."""
    bs = backends()
    old = add(bs, "stage", "old", (0, 4), limit=1000, used=0)
    new = add(bs, "stage", "new", (0, 4), limit=900, used=0)
    picks = []
    for _ in range(4):
        path = bs.path(need_draft=False)
        bs.acquire(path).release()
        picks.append(path.stages[0])
    assert picks.count(new) == 2 and picks.count(old) == 2
    old.desc.cache_bytes_used = 500  # half full: the emptier one first
    assert bs.path(need_draft=False).stages == [new]


def test_replicas_that_drain_or_leave_discovery_take_no_new_requests() -> None:
    bs = backends()
    s0, s1 = add(bs, "stage", "s0"), add(bs, "stage", "s1")
    s0.draining = True
    assert bs.path(need_draft=False).stages == [s1]
    s1.listed = False
    with pytest.raises(NoPath):
        bs.path(need_draft=False)
    s1.listed, s1.endpoint = True, Endpoint("stage", "s1", draining=True)  # terminating
    with pytest.raises(NoPath):
        bs.path(need_draft=False)


def test_drafts_of_the_same_group_first_and_none_is_no_error() -> None:
    bs = backends()
    add(bs, "stage", "s", group="v2")
    assert bs.path().draft is None and not bs.has_draft
    other = add(bs, "draft", "d1", group="v1")
    mine = add(bs, "draft", "d2", group="v2")
    assert bs.path().draft is mine and bs.has_draft
    mine.healthy = False
    assert bs.path().draft is other
    assert bs.path(need_draft=False).draft is None


def test_other_vocabularies_are_refused_with_the_reason() -> None:
    bs = backends()
    add(bs, "stage", "s")
    wrong = add(bs, "stage", "w", version="v9", vocab=113, order=9.0)
    assert "vocabulary of 113 tokens, this router serves 97" in wrong.refused
    assert bs.model.weight_hash == "v1"  # never the current version, however new
    big = add(bs, "draft", "d", vocab=200)
    assert "draft vocabulary (200) is larger" in big.refused
    assert bs.path().draft is None
    other_plane = add(bs, "stage", "u", version="v1")
    other_plane.desc.data_address = "ucx://h:1"
    assert "ucx data plane" in bs._refusal(other_plane)


def test_a_replica_listed_again_takes_no_request_before_a_check_passes() -> None:
    """A replica that left discovery while it still held requests (so it was kept) and
    is listed again may have restarted meanwhile (issue 22, N14: requests refused after
    a restarted stage was ready): no path uses it until a health check and Describe
    pass again."""
    bs = backends()
    s = add(bs, "stage", "s")
    s.active = 1  # a request still on it: kept while it is unlisted
    bs.update(frozenset())
    assert not s.listed and bs.by_key
    with pytest.raises(NoPath):
        bs.path(need_draft=False)
    bs.update(frozenset([s.endpoint]))
    assert s.listed and not s.eligible
    with pytest.raises(NoPath, match="not checked yet"):
        bs.path(need_draft=False)


def test_a_replica_that_answers_no_check_for_the_stall_limit_is_stalled() -> None:
    """No answer for `stall_seconds` while a check waits: no new requests (and the
    drivers of requests on it replay them, see test_services_stalls.py); answering
    again ends it. A replica that is not being asked is never stalled."""
    bs = backends()
    bs.stall_seconds = 2.0
    s0, s1 = add(bs, "stage", "s0"), add(bs, "stage", "s1")
    s0.answered_at = s1.answered_at = 100.0
    assert bs.stalled_for(s0, 150.0) == 0.0  # nothing asked of it: not stalled
    s0.asked_since = s1.asked_since = 100.2
    s1.answered_at = 101.0
    assert bs.stalled_for(s0, 101.9) == pytest.approx(1.9)
    bs.mark_stalls(102.1)
    bs._recompute()
    assert s0.stalled and not s1.stalled and "stalled" in s0.error
    assert bs.path(need_draft=False).stages == [s1]
    s0.asked_since, s0.answered_at = None, 102.2  # it answered
    bs.mark_stalls(102.3)
    assert not s0.stalled and s0.eligible


def test_a_replica_its_requests_show_working_is_checked_less_often() -> None:
    """Progress (a verification of a path it is on, the draft's answer) within the last
    interval stands for a check, up to PROVEN_CHECKS intervals since the last answer;
    a replica that stops progressing, fails, or stalls is checked at every interval,
    and progress counts as an answer for the stall limit."""
    from specpipe.services.router.backends import PROVEN_CHECKS

    bs = backends()
    bs.check_interval, bs.stall_seconds = 0.5, 2.0
    s0 = add(bs, "stage", "s0")
    s0.answered_at = 100.0
    assert bs._due(s0, 100.5)  # no progress seen: checked every interval
    s0.progressed_at = 100.4
    assert not bs._due(s0, 100.5)
    assert bs._due(s0, 100.9)  # no progress within the last interval
    s0.progressed_at = 100.0 + PROVEN_CHECKS * 0.5 - 0.1
    assert bs._due(s0, 100.0 + PROVEN_CHECKS * 0.5)  # identity and load refreshed
    s0.progressed_at = 100.7
    s0.healthy = False
    assert bs._due(s0, 100.8)
    s0.healthy, s0.stalled = True, True
    assert bs._due(s0, 100.8)
    s0.stalled, s0.asked_since = False, 100.6
    assert bs.stalled_for(s0, 102.5) == pytest.approx(1.8)  # from its last progress
    s0.asked_since = None
    assert not bs._due(s0, 100.8)
    s0.desc.cache_bytes_limit, s0.desc.cache_bytes_used = 100, 85
    assert bs._due(s0, 100.8)  # short of room: its load is read at every interval


def test_the_command_line_default_stall_limit_is_the_routers() -> None:
    from specpipe.services.router.backends import DEFAULT_STALL_SECONDS

    from specpipe.cli import build_parser

    args = build_parser().parse_args(["router", "--stages", "h:1"])
    assert args.replica_stall_seconds == DEFAULT_STALL_SECONDS == 2.0


def test_an_idle_replica_that_fails_a_check_gets_a_fresh_channel() -> None:
    """gRPC backs a broken channel's reconnects off up to 2 s: a replica that restarted
    would stay unseen that long after it is ready. A replica that failed a check and
    holds no request is checked next on a new channel; one that holds requests keeps
    its channel (their calls use it)."""
    import asyncio
    import socket

    from specpipe.services.grpc_util import channel

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nobody listens there
    made: list = []

    def make(address: str):
        made.append(channel(address))
        return made[-1]

    async def main() -> None:
        bs = Backends(StaticDiscovery([f"127.0.0.1:{port}"]), on_down=lambda b, e: None,
                      on_readiness=lambda ready: None, make_channel=make, check_timeout=5.0)  # fmt: skip
        (b,) = bs.all
        await bs._check(b)
        assert not b.healthy and len(made) == 2 and b.channel is made[1]
        b.active = 1
        await bs._check(b)
        assert len(made) == 2
        await bs.close()

    asyncio.run(main())


@pytest.mark.parametrize("said", [True, False], ids=["in Describe", "older replica"])
def test_a_check_is_one_describe_and_asks_the_health_service_only_if_it_must(said) -> None:
    """A replica's Describe repeats its health status: a check is that one call. An
    older version's says nothing (0), and the health service is asked as before; either
    way NOT_SERVING is draining (no new requests, its own kept)."""
    import asyncio

    from grpc_health.v1 import health_pb2
    from specpipe.v1 import stage_pb2

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, 2
    asked: list[str] = []

    class Stub:
        status = serving

        async def Describe(self, request, timeout: float):
            asked.append("Describe")
            return stage_pb2.StageDescription(
                model_id="m", weight_hash="v1", layer_end=4, num_layers=4, vocab_size=97,
                ready=True, data_address="tcp://h:1", health_status=self.status if said else 0,
            )  # fmt: skip

        async def Check(self, request, timeout: float):
            asked.append("Check")
            return health_pb2.HealthCheckResponse(status=self.status)

    async def main() -> None:
        bs = backends()
        b = add(bs, "stage", "s0:1")
        b.stub = b.health = stub = Stub()
        await bs._check(b)
        assert b.healthy and asked == (["Describe"] if said else ["Describe", "Check"])
        stub.status = not_serving
        await bs._check(b)
        assert b.draining and not b.healthy and "NOT_SERVING" in b.error

    asyncio.run(main())


# -- speed: the cost curves replicas publish in Describe (--measure-costs) ------------------
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def curve(per_row: float = 0.0, fixed: float = 0.0) -> pb.CostCurve:
    """A published cost curve: `fixed` + `per_row` seconds per row (CPU-like when
    per_row dominates, accelerator-like when flat)."""
    return pb.CostCurve(rows=ROWS, seconds=[fixed + per_row * n for n in ROWS], context=128)


def publish(b: Backend, msg: pb.CostCurve) -> None:
    """`b` answers a Describe with another cost curve (a new description, as each check
    gets)."""
    b.desc = SimpleNamespace(**{**vars(b.desc), "cost_curve": msg})


def test_at_equal_load_the_faster_replica_takes_the_request() -> None:
    bs = backends()
    slow = add(bs, "stage", "slow", curve=curve(fixed=0.025))
    fast = add(bs, "stage", "fast", curve=curve(fixed=0.010))
    for rows in (0, 8, 40):  # idle, and equally busy
        slow.rows = fast.rows = rows
        slow.active = fast.active = 1 if rows else 0
        assert bs.path(need_draft=False).stages == [fast]
    # Flat (accelerator-like) costs: the fast one is quicker however many rows it has,
    # until its curve rises past the slow one's.
    slow.rows, slow.active, fast.rows, fast.active = 0, 0, 64, 8
    assert bs.path(need_draft=False).stages == [fast]
    publish(fast, pb.CostCurve(rows=[1, 64, 128], seconds=[0.01, 0.01, 0.2]))
    assert bs.path(need_draft=False).stages == [slow]
    # Both idle by this router's counts, but the fast one just finished a request: its
    # last Describe (up to a check interval old) still says one request and some KV
    # cache in use, and a closed-loop client's next request comes before the old one's
    # release is done. Still the fast one: one request more costs it nothing here.
    slow.rows = slow.active = 0
    fast.rows, fast.active = 0, 1
    fast.desc = SimpleNamespace(**{**vars(fast.desc), "active_requests": 1,
                                   "cache_bytes_used": 10, "cache_bytes_limit": 1000})  # fmt: skip
    assert bs.path(need_draft=False).stages == [fast]
    # The draft replicas too.
    add(bs, "draft", "d-slow", curve=curve(fixed=0.004))
    d_fast = add(bs, "draft", "d-fast", curve=curve(fixed=0.001))
    assert bs.path().draft is d_fast


def test_a_faster_replica_takes_more_rows_before_a_slower_one_is_as_quick() -> None:
    """CPU-like costs (seconds grow with the rows): a replica 2.5x as fast is chosen
    while its step with the new request is still the quicker one, although it holds
    more requests (load alone would send this one to the idle replica)."""
    bs = backends()
    fast = add(bs, "stage", "fast", curve=curve(per_row=0.001))
    slow = add(bs, "stage", "slow", curve=curve(per_row=0.0025))
    fast.active, fast.rows = 1, 8  # 8 rows a request: the new one makes 16 there
    assert bs.path(need_draft=False).stages == [fast]  # 16 ms there, 20 ms on the slow one
    fast.active, fast.rows = 2, 16
    assert bs.path(need_draft=False).stages == [slow]  # 24 ms there: now the slow one
    # A request opened there but not counting rows yet counts as a typical one.
    fast.active, fast.rows = 2, 8
    assert bs.path(need_draft=False).stages == [slow]


def test_replicas_of_one_speed_share_by_load_and_without_curves_load_decides() -> None:
    """Identical replicas measure a little differently: within the tolerance they are
    equally fast and take turns (round robin at equal load), as replicas without
    published curves do; one replica without a curve makes the set go by load."""
    bs = backends()
    a = add(bs, "stage", "a", curve=curve(fixed=0.0100))
    b = add(bs, "stage", "b", curve=curve(fixed=0.0105))
    picks = []
    for _ in range(4):
        path = bs.path(need_draft=False)
        bs.acquire(path).release()
        picks.append(path.stages[0])
    assert picks.count(a) == 2 and picks.count(b) == 2
    publish(b, curve(fixed=0.05))
    a.rows, a.active = 8, 1
    assert bs.path(need_draft=False).stages == [a]  # 5x as fast: busy, still first
    unmeasured = add(bs, "stage", "c")
    assert unmeasured.cost_curve is None
    assert bs.path(need_draft=False).stages != [a]  # load alone: an idle one
    assert cost_curve_from_proto(a.desc.cost_curve)(1) == a.cost_curve(1)


def simulate_stream(bs: Backends, replicas, costs, *, requests=400, gap=0.12, steps=20, rows=8):
    """A stream of requests, one every `gap` seconds of a virtual clock, each `steps`
    steps of `rows` rows; a replica's step takes its true cost at the rows it holds
    (batched), shared by its requests. Returns the requests each replica served and the
    mean seconds a request took."""
    true = {b: cost_curve_from_proto(c) for b, c in zip(replicas, costs, strict=True)}
    served = dict.fromkeys(replicas, 0)
    now, running, took = 0.0, [], []
    arrivals = [i * gap for i in range(requests)]

    def step(b: Backend) -> float:
        return true[b](b.rows)

    while arrivals or running:
        done = min(running, key=lambda r: r[1] * step(r[0]), default=None)
        until_done = done[1] * step(done[0]) if done else float("inf")
        until_arrival = arrivals[0] - now if arrivals else float("inf")
        dt = min(until_done, until_arrival)
        for r in running:
            r[1] -= dt / step(r[0])
        now += dt
        if until_arrival <= until_done:
            arrivals.pop(0)
            path = bs.path(need_draft=False)
            claim = bs.acquire(path)
            claim.count_rows(rows)
            (b,) = path.stages
            served[b] += 1
            running.append([b, float(steps), now, claim])
        else:
            running.remove(done)
            done[3].release()
            took.append(now - done[2])
    return [served[b] for b in replicas], sum(took) / len(took)


def test_a_faster_replica_takes_proportionally_more_of_a_stream_of_requests() -> None:
    """A mixed replica set (one 2.5x as fast), a stream that keeps both busy: the fast
    one serves at least 2.5x the requests of the slow one (which still serves some),
    and requests finish sooner on average than when load alone decides (the same
    replicas publishing no curves)."""
    costs = [curve(per_row=0.001), curve(per_row=0.0025)]
    bs = backends()
    replicas = [add(bs, "stage", n, curve=c) for n, c in zip(("fast", "slow"), costs, strict=True)]
    (fast, slow), mean = simulate_stream(bs, replicas, costs)
    assert fast >= 2.5 * slow and slow > 0
    blind = backends()
    replicas = [add(blind, "stage", n) for n in ("fast", "slow")]
    _, mean_by_load = simulate_stream(blind, replicas, costs)
    assert mean < mean_by_load
