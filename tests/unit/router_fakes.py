"""In-process fakes of the stage and draft services for the router's request driver: no
processes, no sockets. The stage replicas are stubs with the stage service's call
signatures over one `FakePipeline`, which plays the last stage: it knows the tree rows
fed to stage 1 and verifies like the real verifier would for a target whose token at
every position is `text[position]` (greedy on a known text), sending each `Verification`
to the router's inbox as a data-plane frame. The draft proposes that same text, so every
mode's output is `text[len(prompt):]`, whatever the tree, replays and drops did.
A stub can be made to die (UNAVAILABLE) after a number of calls: its control stream
breaks there. Each item on a control stream counts as a call of its kind."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
from specpipe.common.spec.messages import Verified
from specpipe.services.control import verified_to_proto
from specpipe.services.router.backends import Backend, Backends
from specpipe.services.router.control_stream import control_stream
from specpipe.services.transport import Inbox
from specpipe.services.transport.codec import Frame, Kind
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import draft_pb2, stage_pb2

from .test_backends import add, backends

VOCAB = 97
TEXT = [(7 * (i % 11) + 3) % VOCAB for i in range(400)]  # repeats: n-grams hit


def unavailable(what: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), what
    )


@dataclass
class _Request:
    """The fake last stage's view of one request (one wire id)."""

    nodes: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # id: parent, token, pos
    root: int | None = None
    expect: tuple[int, int] | None = None  # the next root: the child of (node, token)


class FakePipeline:
    """The path's stages as one: tree rows fed to stage 1 in, verifications out."""

    def __init__(self, inbox: Inbox, text: list[int] = TEXT) -> None:
        self.inbox, self.text = inbox, text
        self.requests: dict[str, _Request] = {}
        self.verifications = 0

    def open(self, request: stage_pb2.OpenStageRequest) -> None:
        self.requests[request.request_id] = _Request()

    def feed(self, request: stage_pb2.FeedRequest) -> None:
        r = self.requests.get(request.request_id)
        rows = request.rows
        if r is None or rows.committed:
            return  # a prefill chunk: nothing comes back
        for node, parent, token, pos in zip(
            rows.node_ids, rows.parent_ids, request.token_ids, rows.positions, strict=True
        ):
            r.nodes[node] = (parent, token, pos)
            if parent == -1 or (r.expect is not None and r.expect == (parent, token)):
                r.root, r.expect = node, None  # a fresh root, or the hit being waited for
        # a pipeline takes a while (a draft answer on its control stream takes a few loop
        # turns: it comes before the verification, as a draft within its step does)
        asyncio.get_running_loop().call_later(0.002, self._verify, request.request_id)

    def _verify(self, wire_id: str) -> None:
        """Verify from the root while the drawn token is a fed child (as a real last
        stage walks down the tree as far as its rows are present)."""
        r = self.requests.get(wire_id)
        if r is None or r.root is None:
            return
        node, ids, tokens = r.root, [], []
        position = r.nodes[node][2]
        while True:
            pos = r.nodes[node][2]
            drawn = self.text[pos + 1]
            ids.append(node)
            tokens.append(drawn)
            child = next((n for n, (p, t, _) in r.nodes.items() if p == node and t == drawn), None)
            if child is None:
                break
            node = child
        r.root, r.expect = None, (ids[-1], tokens[-1])
        if child is not None:
            r.root, r.expect = child, None  # its logits come out next
        v = Verified(wire_id, tuple(ids), tuple(tokens), position)
        header = pb.FrameHeader(
            request_id=wire_id, kind=Kind.PAYLOAD_KIND_VERIFIED, sender="fake last stage",
            verified=verified_to_proto(v),
        )  # fmt: skip
        self.verifications += 1
        if self.inbox.admit(header):
            self.inbox(Frame(header))
        if r.root is not None:
            asyncio.get_running_loop().call_soon(self._verify, wire_id)


class FakeStreamCall:
    """A fake replica's side of a control stream: each message handled in order by
    `handle` (its answer sent, if any); an error it raises breaks the stream."""

    def __init__(self, requests, handle) -> None:
        self._replies: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.ensure_future(self._run(requests, handle))

    async def _run(self, requests, handle) -> None:
        try:
            async for msg in requests:
                reply = await handle(msg)
                if reply is not None:
                    self._replies.put_nowait(reply)
            self._replies.put_nowait(None)
        except Exception as e:
            self._replies.put_nowait(e)

    def __aiter__(self):
        return self

    async def __anext__(self):
        reply = await self._replies.get()
        if reply is None:
            raise StopAsyncIteration
        if isinstance(reply, BaseException):
            raise reply
        return reply


class _Stub:
    """Calls counted, and UNAVAILABLE from call `dies_after` on (None: never)."""

    def __init__(self, label: str, dies_after: int | None = None) -> None:
        self.label, self.dies_after = label, dies_after
        self.calls: list[str] = []
        self.opened: list[str] = []
        self.released: list[str] = []

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.dies_after is not None and len(self.calls) > self.dies_after:
            raise unavailable(f"{self.label} is dead")


class FakeStage(_Stub):
    """A stage replica's stub; stage 1's feeds go to the pipeline."""

    def __init__(self, label: str, pipeline: FakePipeline, dies_after: int | None = None):
        super().__init__(label, dies_after)
        self.pipeline = pipeline

    async def Open(self, request, timeout: float):
        self._call("Open")
        self.opened.append(request.request_id)
        if request.HasField("verify"):  # the last stage
            self.pipeline.open(request)
        return stage_pb2.OpenStageResponse(cached_tokens=0)

    async def Feed(self, request, timeout: float):
        self._call("Feed")
        self.pipeline.feed(request)
        return stage_pb2.FeedResponse()

    async def Prune(self, request, timeout: float):
        self._call("Prune")
        return pb.PruneResponse()

    async def FeedMany(self, request, timeout: float):
        self._call("FeedMany")
        for feed in request.feeds:
            self.pipeline.feed(feed)
        return stage_pb2.FeedManyResponse(outcomes=[pb.CallOutcome()] * len(request.feeds))

    async def PruneMany(self, request, timeout: float):
        self._call("PruneMany")
        return pb.PruneManyResponse(outcomes=[pb.CallOutcome()] * len(request.prunes))

    async def Release(self, request, timeout: float):
        self.released.append(request.request_id)
        return pb.ReleaseResponse()

    def Control(self, requests) -> FakeStreamCall:
        async def handle(msg):
            refusals = []
            for item, call in [*((f, self.Feed) for f in msg.feeds),
                               *((p, self.Prune) for p in msg.prunes)]:  # fmt: skip
                try:
                    await call(item, 0)
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.UNAVAILABLE:
                        raise  # the stage is gone: its stream breaks
                    refusals.append(stage_pb2.ControlRefusal(
                        request_id=item.request_id, code=e.code().value[0], message=e.details()
                    ))  # fmt: skip
            for ref in msg.releases:
                await self.Release(ref, 0)
            released = [ref.request_id for ref in msg.releases]
            if refusals or released:
                return stage_pb2.StageControlReply(refusals=refusals, released=released)
            return None

        return FakeStreamCall(requests, handle)


class FakeDraft(_Stub):
    """A draft replica's stub that proposes the text's next token for every row."""

    def __init__(self, label: str, text: list[int] = TEXT, dies_after: int | None = None):
        super().__init__(label, dies_after)
        self.text = text

    async def Open(self, request, timeout: float):
        self._call("Open")
        self.opened.append(request.request_id)
        return draft_pb2.OpenDraftResponse()

    async def Prefill(self, request, timeout: float):
        self._call("Prefill")
        return draft_pb2.PrefillDraftResponse()

    async def Prune(self, request, timeout: float):
        self._call("Prune")
        return pb.PruneResponse()

    async def Propose(self, request, timeout: float):
        self._call("Propose")
        rows = request.rows
        return draft_pb2.ProposeResponse(
            parent_ids=list(rows.node_ids),
            token_ids=[self.text[p + 1] for p in rows.positions],
            probs=[0.9] * len(rows.node_ids),
        )

    async def Release(self, request, timeout: float):
        self.released.append(request.request_id)
        return pb.ReleaseResponse()

    def Control(self, requests) -> FakeStreamCall:
        calls = {"propose": self.Propose, "prefill": self.Prefill, "prune": self.Prune,
                 "release": self.Release}  # fmt: skip

        async def handle(msg):
            answers = []
            for c in msg.calls:
                kind = c.WhichOneof("call")
                try:
                    out = await calls[kind](getattr(c, kind), 0)
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.UNAVAILABLE:
                        raise  # the draft is gone: its stream breaks
                    answers.append(draft_pb2.DraftAnswer(
                        call_id=c.call_id, code=e.code().value[0], message=e.details()
                    ))  # fmt: skip
                    continue
                answer = draft_pb2.DraftAnswer(call_id=c.call_id)
                if kind == "propose":
                    answer.proposal.CopyFrom(out)
                answers.append(answer)
            return draft_pb2.DraftControlReply(answers=answers)

        return FakeStreamCall(requests, handle)


@dataclass
class Deployment:
    backends: Backends
    inbox: Inbox
    pipeline: FakePipeline
    stages: list[Backend]
    drafts: list[Backend]


def deployment(
    ranges=((0, 2), (2, 4)),
    replicas: int = 1,
    drafts: int = 1,
    dies_after: dict[str, int] | None = None,
) -> Deployment:
    """Stage replicas s<range>.<i> of each layer range and drafts d<i>, healthy, with fake
    stubs over one pipeline (`dies_after`: calls after which a replica, by name, dies)."""
    dies_after = dies_after or {}
    inbox = Inbox()
    pipeline = FakePipeline(inbox)
    bs = backends()
    stages = []
    for a, b in ranges:
        for i in range(replicas):
            name = f"s{a}-{b}.{i}"
            s = add(bs, "stage", name, (a, b))
            s.stub = FakeStage(name, pipeline, dies_after.get(name))
            s.control = control_stream("stage", s.stub, name)
            stages.append(s)
    ds = []
    for i in range(drafts):
        d = add(bs, "draft", f"d{i}")
        d.stub = FakeDraft(f"d{i}", dies_after=dies_after.get(f"d{i}"))
        d.control = control_stream("draft", d.stub, f"d{i}")
        ds.append(d)
    return Deployment(bs, inbox, pipeline, stages, ds)
