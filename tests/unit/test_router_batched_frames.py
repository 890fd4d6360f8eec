"""Many requests' verifications in one batch frame (issue 34, point 3): the router
handles them in one pass where the frame is read, and each request gets exactly what it
got when its verifications came one at a time, also when one of them fails or ends
among the others; what the pass gives to send leaves as one message per replica."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from specpipe.common.spec.controller import make_controller
from specpipe.common.spec.options import DecodeOptions, Mode
from specpipe.services.router.calls import DriverError
from specpipe.services.router.driver import DriverSettings, RequestDriver
from specpipe.services.router.path_session import first_path
from specpipe.services.transport import make_transport
from specpipe.services.transport.batch import pack
from specpipe.services.transport.codec import Frame, error_header
from specpipe.v1 import dataplane_pb2 as pb

from .router_fakes import TEXT, VOCAB, Deployment, deployment

PROMPT = TEXT[:12]
NEW = {"r0": 9, "r1": 30, "r2": 17, "r3": 30}  # r0 and r2 end among the others
MODE, OPTS = Mode.SPECPIPE, dict(prefill_chunk=4, width=4, token_source="ngram")


class OneFramePerTurn:
    """Stands in for the fake last stage's sends: the verifications of one event-loop
    turn leave as one batch frame, read by a real transport into the router's inbox;
    `fail` names a request whose `at`-th verification becomes a failure report."""

    def __init__(self, dep: Deployment, fail: str | None = None, at: int = 3) -> None:
        self.inbox, self.fail, self.at = dep.inbox, fail, at
        self.reader = make_transport("tcp", dep.inbox, admit=dep.inbox.admit)
        self.parts: list[pb.FrameHeader] = []
        self.seen: dict[str, int] = {}
        self.batches: list[int] = []  # parts of each batch frame delivered
        dep.pipeline.inbox = self  # type: ignore[assignment]

    def admit(self, header: pb.FrameHeader) -> bool:
        return self.inbox.admit(header)

    def __call__(self, frame: Frame) -> None:
        h = frame.header
        n = self.seen[h.request_id] = self.seen.get(h.request_id, 0) + 1
        if h.request_id.startswith(self.fail or "-") and n == self.at:
            h = error_header(h.request_id, "the last stage failed it", "fake last stage")
            h.error_code = grpc.StatusCode.INTERNAL.value[0]
        if not self.parts:
            asyncio.get_running_loop().call_soon(self._send)
        self.parts.append(h)

    def _send(self) -> None:
        parts, self.parts = self.parts, []
        outer, payload = pack([(h, None) for h in parts], "fake last stage")
        self.batches.append(len(parts))
        self.reader._deliver(Frame(outer, payload), self.reader._admitted(outer))


def run_requests(dep: Deployment, names: list[str]) -> dict[str, list[int] | DriverError]:
    """The requests side by side on one deployment: each one's tokens, or its error."""

    async def one(name: str) -> list[int] | DriverError:
        opts = DecodeOptions(max_new_tokens=NEW[name], **OPTS)
        path = first_path(dep.backends, MODE, opts, PROMPT)
        controller = make_controller(MODE, name, PROMPT, opts, len(path.stages))
        settings = DriverSettings(replay_timeout=0.0, stall_timeout=30.0)
        driver = RequestDriver(controller, dep.backends, path, "tcp://router:1", dep.inbox,
                               settings=settings, vocab_size=VOCAB)  # fmt: skip
        out: list[int] = []
        try:
            async for tokens in driver.run():
                out += tokens
        except DriverError as e:
            return e
        finally:
            await driver.release()
        return out

    async def main() -> list[list[int] | DriverError]:
        return await asyncio.gather(*(one(n) for n in names))

    return dict(zip(names, asyncio.run(asyncio.wait_for(main(), 60)), strict=True))


def alone(name: str) -> list[int] | DriverError:
    """What the request gets with its verifications one frame each, on its own."""
    return run_requests(deployment(), [name])[name]


@pytest.mark.parametrize("fail", [None, "r1"])
def test_a_frame_of_many_verifications_gives_each_request_what_it_got_alone(fail) -> None:
    dep = deployment()
    frames = OneFramePerTurn(dep, fail=fail)
    got = run_requests(dep, list(NEW))
    assert max(frames.batches) > 1  # verifications did come several to a frame
    for name, n in NEW.items():
        if name == fail:
            error = got[name]
            assert isinstance(error, DriverError)
            assert error.code == grpc.StatusCode.INTERNAL
            assert "the last stage failed it" in error.message
            continue
        assert got[name] == alone(name) == TEXT[len(PROMPT) : len(PROMPT) + n], name
    # the pass's feeds leave together: fewer messages to stage 1 than feeds in them
    stage1 = dep.stages[0].control
    feeds = dep.stages[0].stub.calls.count("Feed")
    assert stage1.messages < feeds
    for b in [*dep.stages, *dep.drafts]:
        assert (b.active, b.rows) == (0, 0), b.label
