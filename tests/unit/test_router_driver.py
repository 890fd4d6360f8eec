"""The router's request driver against in-process fake stages and drafts
(router_fakes.py): opening a path, steps, a replay after a lost replica, a lost draft,
release; the needs-a-draft rule at the open and at a replay; the late-draft hold."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from specpipe.common.spec.controller import make_controller, needs_draft
from specpipe.common.spec.messages import Candidates, Verified
from specpipe.common.spec.options import DecodeOptions, Mode, TokenSource
from specpipe.services.router.calls import DriverError
from specpipe.services.router.driver import DriverSettings, RequestDriver
from specpipe.services.router.events import Proposal
from specpipe.services.router.late_draft import LateDraftHold
from specpipe.services.router.path_session import first_path
from specpipe.services.transport.codec import Frame, Kind
from specpipe.v1 import dataplane_pb2 as pb

from .router_fakes import TEXT, VOCAB, Deployment, deployment

PROMPT = TEXT[:12]
NEW = 24
EXPECTED = TEXT[len(PROMPT) : len(PROMPT) + NEW]  # the fake target's greedy continuation


def options(source: str | None = None, **kw) -> DecodeOptions:
    given = {"token_source": source} if source else {}
    return DecodeOptions(max_new_tokens=NEW, prefill_chunk=4, width=4, **given, **kw)


def run_request(
    dep: Deployment,
    mode: Mode,
    opts: DecodeOptions,
    prepare: Callable[[RequestDriver], None] = lambda d: None,
    each: Callable[[RequestDriver, list[int]], None] = lambda d, out: None,
    settings: DriverSettings | None = None,
) -> tuple[RequestDriver, list[int]]:
    """Run one request to its end (`prepare` the driver before, look at it after each
    batch of tokens with `each`), then release it."""

    async def main() -> tuple[RequestDriver, list[int]]:
        path = first_path(dep.backends, mode, opts, PROMPT)
        controller = make_controller(mode, "r", PROMPT, opts, len(path.stages))
        given = settings or DriverSettings(replay_timeout=0.0, stall_timeout=30.0)
        driver = RequestDriver(controller, dep.backends, path, "tcp://router:1", dep.inbox,
                               settings=given, vocab_size=VOCAB)  # fmt: skip
        prepare(driver)
        out: list[int] = []
        try:
            async for tokens in driver.run():
                out += tokens
                each(driver, out)
        finally:
            await driver.release()
        return driver, out

    return asyncio.run(asyncio.wait_for(main(), 60))


def assert_released(dep: Deployment, driver: RequestDriver) -> None:
    """Nothing of the request is left: no load counted, no frames taken, every replica
    that opened it was asked to release it."""
    for b in [*dep.stages, *dep.drafts]:
        assert (b.active, b.rows) == (0, 0), b.label
        assert set(b.stub.opened) <= set(b.stub.released), b.label
    assert not driver.holding
    assert not dep.inbox.admit(pb.FrameHeader(request_id=driver.wire_id))


MODES = [
    (Mode.PP, None),
    (Mode.AUTOREGRESSIVE, None),
    (Mode.SPECPIPE, "draft"),
    (Mode.SPECPIPE, "ngram"),
    (Mode.SPECPIPE, "hybrid"),
    (Mode.SPECINFER, "draft"),
]


@pytest.mark.parametrize(("mode", "source"), MODES)
def test_a_request_opens_steps_and_releases_its_path(mode: Mode, source: str | None) -> None:
    dep = deployment()

    def each(driver: RequestDriver, out: list[int]) -> None:
        # The request's load counts on the replicas of its path, and only there.
        on_path = set(driver.path.backends)
        for b in [*dep.stages, *dep.drafts]:
            assert b.active == (1 if b in on_path else 0), b.label

    driver, out = run_request(dep, mode, options(source), each=each)
    assert out == EXPECTED
    assert driver.stats.new_tokens == NEW and driver.stats.replays == 0
    assert [s.stub.opened for s in dep.stages] == [["r"], ["r"]]
    uses_model = source is not None and TokenSource(source).uses_model
    assert dep.drafts[0].stub.opened == (["r"] if uses_model else [])
    if mode == Mode.SPECPIPE:  # the tree grew and some of it was verified at once
        assert driver.stats.hits > 0
    # its verifications showed the path's stages working, the draft's answers the draft
    # (their health checks can wait: backends._due)
    assert all(s.progressed_at is not None for s in dep.stages)
    assert (dep.drafts[0].progressed_at is not None) == uses_model
    assert_released(dep, driver)


@pytest.mark.parametrize(("mode", "source"), [(Mode.PP, None), (Mode.SPECPIPE, "draft")])
def test_a_lost_stage_replays_the_request_on_another_replica(mode, source) -> None:
    dep = deployment(ranges=((0, 4),), replicas=2)
    stale = []

    def prepare(driver: RequestDriver) -> None:
        driver.path.stages[0].stub.dies_after = 4  # Open and three feeds, then it is gone

    def each(driver: RequestDriver, out: list[int]) -> None:
        if driver.wire_id != "r" and not stale:  # replayed: a late frame of the old path
            header = pb.FrameHeader(request_id="r", kind=Kind.PAYLOAD_KIND_VERIFIED,
                                    verified=pb.Verification(node_ids=[0], token_ids=[1]))  # fmt: skip
            stale.append(header)
            driver.events.put_nowait(Frame(header))

    driver, out = run_request(dep, mode, options(source), prepare, each)
    assert out == EXPECTED  # the continuation the request would have had
    assert stale, "the request was never replayed"
    dead, alive = (s for s in sorted(dep.stages, key=lambda s: s.stub.dies_after is None))
    assert not dead.healthy and alive.healthy  # the lost replica takes no new requests
    assert dead.stub.opened == ["r"] and alive.stub.opened == ["r~1"]
    assert driver.wire_id == "r~1" and len(driver.replay_seconds) == 1
    assert driver.stats.replays == 1
    assert_released(dep, driver)


@pytest.mark.parametrize(("mode", "source"), [(Mode.PP, None), (Mode.SPECPIPE, "draft")])
@pytest.mark.parametrize("lost", [False, True], ids=["steady", "replayed"])
def test_tokens_handed_on_where_verified_are_the_request_s_tokens(mode, source, lost) -> None:
    """With `on_tokens` (the gRPC front end's writer), the tokens go there in order, from
    the callbacks that verified them or from the driver's task, and `run` yields none;
    a replay on another path changes nothing of what the client gets."""
    dep = deployment(ranges=((0, 4),), replicas=2)
    handed: list[list[int]] = []

    def prepare(driver: RequestDriver) -> None:
        driver.on_tokens = handed.append
        if lost:
            driver.path.stages[0].stub.dies_after = 4

    driver, out = run_request(dep, mode, options(source), prepare)
    assert out == [] and [t for batch in handed for t in batch] == EXPECTED
    assert driver.stats.replays == (1 if lost else 0)
    assert_released(dep, driver)


def test_a_failure_handing_tokens_on_fails_the_request() -> None:
    dep = deployment()

    def prepare(driver: RequestDriver) -> None:
        def on_tokens(tokens: list[int]) -> None:
            raise ValueError("the client's message could not be made")

        driver.on_tokens = on_tokens

    with pytest.raises(ValueError, match="could not be made"):
        run_request(dep, Mode.SPECPIPE, options("draft"), prepare)


def test_a_replayed_ngram_request_takes_no_draft() -> None:
    """The n-gram source needs no draft replica, at the open and at a replay: the old
    driver took one at the replay (never opened there), and the next lease renewal, which
    the draft answered "unknown", made it mark the healthy draft suspect."""
    dep = deployment(ranges=((0, 4),), replicas=2)
    draft = dep.drafts[0]
    replayed, drafts_held = [], []

    def prepare(driver: RequestDriver) -> None:
        driver.path.stages[0].stub.dies_after = 3

    def each(driver: RequestDriver, out: list[int]) -> None:
        drafts_held.append((driver.path.draft, draft.active))
        if driver.wire_id != "r" and not replayed:
            replayed.append(driver.wire_id)
            # What the lease keep-alive (keepalive.py) does for a replica that does not know a wire id
            # the driver says is on it: the draft never opened this request.
            if draft in driver.path.backends:
                driver.backend_down(draft, "it no longer holds this request")

    driver, out = run_request(dep, Mode.SPECPIPE, options("ngram"), prepare, each)
    assert out == EXPECTED and replayed == ["r~1"]
    assert draft.healthy and draft.stub.opened == [] and driver.stats.draft_drops == 0
    assert set(drafts_held) == {(None, 0)}  # never on the path, never counted there
    assert_released(dep, driver)


def test_the_needs_a_draft_rule_is_one_rule() -> None:
    """`needs_draft` decides the first path's draft, the controller's use of one, and
    the replay's (above)."""
    dep = deployment()
    for mode, source, needed in [
        (Mode.SPECPIPE, "draft", True),
        (Mode.SPECPIPE, "hybrid", True),
        (Mode.SPECINFER, "draft", True),
        (Mode.SPECPIPE, "ngram", False),
        (Mode.PP, None, False),
        (Mode.AUTOREGRESSIVE, None, False),
    ]:
        opts = options(source)
        assert needs_draft(mode, opts) is needed
        path = first_path(dep.backends, mode, opts, PROMPT)
        assert (path.draft is not None) is needed, (mode, source)
        controller = make_controller(mode, "r", PROMPT, opts, 2)
        assert controller.uses_draft is needed


def test_a_failing_draft_is_dropped_and_the_request_goes_on() -> None:
    dep = deployment(dies_after={"d0": 4})
    draft = dep.drafts[0]
    driver, out = run_request(dep, Mode.SPECPIPE, options("draft"))
    assert out == EXPECTED
    assert driver.stats.draft_drops == 1 and driver.stats.replays == 0
    assert not draft.healthy and driver.path.draft is None
    assert draft.stub.released == ["r"]
    assert_released(dep, driver)


def test_a_draft_call_past_its_deadline_drops_the_draft_and_the_request_goes_on() -> None:
    """The lane's deadline sweep (draft_lane.py) gives up a proposal the draft does not
    answer in time: the request, which holds its verifications for the late draft
    meanwhile, goes on without the draft, losslessly."""
    dep = deployment()
    stub = dep.drafts[0].stub
    propose, proposals, dropped = stub.Propose, [], []

    async def slow_propose(request, timeout):
        proposals.append(request.request_id)
        if len(proposals) == 3:
            await asyncio.sleep(1.2)  # past the call's deadline (rpc_timeout)
        return await propose(request, timeout)

    stub.Propose = slow_propose  # type: ignore[method-assign]

    def prepare(driver: RequestDriver) -> None:
        drop = driver.session.drop_draft
        driver.session.drop_draft = lambda message: (dropped.append(message), drop(message))  # type: ignore[method-assign]

    settings = DriverSettings(
        replay_timeout=0.0, stall_timeout=30.0, rpc_timeout=0.4, late_draft_wait=30.0
    )
    driver, out = run_request(dep, Mode.SPECPIPE, options("draft"), prepare, settings=settings)
    assert out == EXPECTED
    assert driver.stats.draft_drops == 1 and driver.stats.replays == 0
    assert len(proposals) == 3  # nothing went to the draft after the call it left unanswered
    (message,) = dropped
    assert "no answer from draft at d0" in message
    assert driver.path.draft is None and stub.released == ["r"]
    assert_released(dep, driver)


def test_events_wait_while_a_replay_is_under_way() -> None:
    """Events come while the driver awaits a replay (the old path's release): they are
    queued and handled after it, one at a time, never beside it (the old path's are then
    ignored)."""
    dep = deployment(ranges=((0, 4),), replicas=2)
    replaying, handled, queued = [False], [], []

    def prepare(driver: RequestDriver) -> None:
        driver.path.stages[0].stub.dies_after = 4
        ctrl = driver.controller
        for name in ("on_verified", "on_candidates"):
            real = getattr(ctrl, name)

            def watched(*args, real=real, name=name):
                handled.append((name, replaying[0]))
                return real(*args)

            setattr(ctrl, name, watched)
        session = driver.session
        leave = session.leave_for_replay

        async def leave_slowly(failed, message):
            replaying[0] = True
            try:
                # a draft answer and a verification of the path being left come meanwhile
                cand = Candidates(np.array([0]), np.array([1]), np.array([0.5], np.float32))
                session.post(Proposal(session.attempt, 0, cand))
                header = pb.FrameHeader(request_id=session.wire_id,
                                        kind=Kind.PAYLOAD_KIND_VERIFIED,
                                        verified=pb.Verification(node_ids=[0], token_ids=[1]))  # fmt: skip
                session.post(Frame(header))
                queued.append(len(driver.events))
                await asyncio.sleep(0.05)
                return await leave(failed, message)
            finally:
                replaying[0] = False

        session.leave_for_replay = leave_slowly  # type: ignore[method-assign]

    driver, out = run_request(dep, Mode.SPECPIPE, options("draft"), prepare)
    assert out == EXPECTED and driver.stats.replays == 1
    assert queued == [2]
    assert handled and not any(during for _, during in handled)
    assert_released(dep, driver)


def test_a_failure_from_outside_fails_the_request() -> None:
    """Router shutdown: `fail` is an event like any other; the path is released."""
    dep = deployment()

    def each(driver: RequestDriver, out: list[int]) -> None:
        driver.fail(grpc.StatusCode.UNAVAILABLE, "the router shut down")

    with pytest.raises(DriverError) as info:
        run_request(dep, Mode.PP, options(), each=each)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    for b in dep.stages:
        assert (b.active, b.rows) == (0, 0) and b.stub.released == ["r"]


# -- the late-draft hold (pure) ----------------------------------------------------------
class _Controller:
    """What the hold asks of a controller: whether the draft is late, and verifications."""

    def __init__(self) -> None:
        self.late = True
        self.verified: list[int] = []

    def draft_is_late_for(self, v: Verified) -> bool:
        return self.late

    def on_verified(self, v: Verified) -> list:
        self.verified.append(v.position)
        return [SimpleNamespace(position=v.position)]


def _v(position: int) -> Verified:
    return Verified("r", (0,), (1,), position)


def test_without_a_wait_nothing_is_held() -> None:
    ctrl = _Controller()
    hold = LateDraftHold(ctrl, wait=0.0)  # type: ignore[arg-type]
    assert len(hold.verified(_v(5), now=0.0)) == 1 and ctrl.verified == [5]
    assert hold.until is None


def test_a_late_draft_holds_verifications_until_it_answers() -> None:
    ctrl = _Controller()
    hold = LateDraftHold(ctrl, wait=0.5)  # type: ignore[arg-type]
    assert hold.verified(_v(5), now=10.0) == [] and hold.until == 10.5
    assert hold.verified(_v(6), now=10.1) == []  # queues behind the held one
    assert hold.settle(now=10.2) == [] and ctrl.verified == []  # still late
    ctrl.late = False  # the draft answered (or was dropped)
    assert [c.position for c in hold.settle(now=10.3)] == [5, 6]
    assert ctrl.verified == [5, 6] and hold.until is None


def test_a_held_verification_goes_on_when_the_wait_is_over() -> None:
    ctrl = _Controller()
    hold = LateDraftHold(ctrl, wait=0.5)  # type: ignore[arg-type]
    hold.verified(_v(5), now=10.0)
    assert hold.settle(now=10.4) == []
    assert len(hold.settle(now=10.5)) == 1 and ctrl.verified == [5]
    hold.verified(_v(6), now=11.0)
    assert len(hold.settle(now=11.0, expired=True)) == 1  # the driver's timer fired
    hold.verified(_v(7), now=12.0)
    hold.drop()  # a replay: the old path's verifications are of no use
    assert hold.until is None and hold.settle(now=20.0) == [] and ctrl.verified == [5, 6]


def test_a_claim_is_the_one_count_of_a_requests_load() -> None:
    dep = deployment()
    path = first_path(dep.backends, Mode.SPECPIPE, options("draft"), PROMPT)
    claim = dep.backends.acquire(path)
    claim.count_rows(6)
    assert [(b.active, b.rows) for b in path.stages] == [(1, 6), (1, 6)]
    assert (path.draft.active, path.draft.rows) == (1, 0)  # drafts hold no tree rows
    claim.count_rows(2)
    claim.leave(path.draft)  # a lost draft
    claim.leave(path.draft)  # once only
    assert [(b.active, b.rows) for b in path.stages] == [(1, 2), (1, 2)]
    assert path.draft.active == 0
    claim.release()
    assert all((b.active, b.rows) == (0, 0) for b in path.backends)


def test_the_inbox_routes_a_requests_frames_into_its_owners_events() -> None:
    """Frames reach the driver's own queue beside its other events; a frame of more
    rows than the request can have becomes an error frame there; a closed id's frames
    are dropped."""
    dep = deployment()
    events: list = []
    dep.inbox.route("r", events.append, max_rows=2)
    ok = pb.FrameHeader(request_id="r", kind=Kind.PAYLOAD_KIND_VERIFIED)
    assert dep.inbox.admit(ok)
    dep.inbox(Frame(ok))
    big = pb.FrameHeader(request_id="r", rows=pb.Rows(positions=[1, 2, 3]))
    assert not dep.inbox.admit(big)
    assert [e.kind for e in events] == [Kind.PAYLOAD_KIND_VERIFIED, Kind.PAYLOAD_KIND_ERROR]
    dep.inbox.close("r")
    assert not dep.inbox.admit(ok)
    dep.inbox(Frame(ok))
    assert len(events) == 2 and dep.inbox.dropped == 2


def _fail_after(driver: RequestDriver, when: Callable[[list], bool]) -> None:
    """A failure (router shutdown) posted in the same loop turn as the first verification
    handled at once whose commands satisfy `when`: it is queued behind what that
    verification gave."""
    real = driver.controller.on_verified

    def verified(*args, **kwargs):
        cmds = real(*args, **kwargs)
        if driver.events.parked and when(cmds) and not getattr(driver, "_failing", False):
            driver._failing = True  # type: ignore[attr-defined]
            asyncio.get_running_loop().call_soon(
                driver.fail, grpc.StatusCode.UNAVAILABLE, "shut down"
            )
        return cmds

    driver.controller.on_verified = verified  # type: ignore[method-assign]


def test_a_failure_queued_behind_the_end_does_not_fail_a_finished_request() -> None:
    """The verification that ends the request, handled at once, and a failure in the
    same turn: the request ends with its tokens (the failure came after the end)."""
    from specpipe.common.spec.commands import Finish

    def prepare(driver: RequestDriver) -> None:
        _fail_after(driver, lambda cmds: any(isinstance(c, Finish) for c in cmds))

    _, out = run_request(deployment(), Mode.PP, options(), prepare)
    assert out == EXPECTED


def test_tokens_handled_at_once_reach_the_client_before_a_later_failure() -> None:
    """A verification handled at once emits a token, then a failure comes in the same
    turn: the client gets the token before the request fails."""
    from specpipe.common.spec.commands import Emit

    got: list[int] = []

    def prepare(driver: RequestDriver) -> None:
        _fail_after(driver, lambda cmds: any(isinstance(c, Emit) for c in cmds))

    with pytest.raises(DriverError):
        run_request(
            deployment(),
            Mode.PP,
            options(),
            prepare,
            each=lambda d, out: got.extend(out[len(got) :]),
        )
    assert got and got == EXPECTED[: len(got)]
