"""The router's control streams: one long-lived bidirectional gRPC call per replica
(`Stage.Control`, `Draft.Control`), instead of a unary call per feed, prune, proposal and
release (docs/architecture.md, "6. Control plane and data plane", says why). A stage
that takes control frames (`StageDescription.control_frames`) gets its feeds and prunes
as data-plane frames instead (`ControlFrames`: a step's control to 4 stages costs about
half its CPU on streams, both ends together); its stream then carries releases and stays
open while requests are attached, so a stage that dies still breaks it. A draft that
takes them (`DraftDescription.control_frames`: one started with a data plane) gets all
its calls as frames (`DraftStream`: the router's CPU per token 7-10% less than on the
stream, the draft's 4-9%), its stream open beside them for the same reason. A frame that
cannot be delivered is a broken stream.

One module: the stage's and the draft's streams share their life cycle (opened at the
first message, broken as a fault that replays the requests attached), the turn's
batching and the outcome of each item; the bytes of the frames are apart
(`control_wire.py`).

What the router's request drivers send a replica in one turn of the event loop leaves as
one message on its stream (the requests whose verifications came in one frame feed and
prune together), in the order they asked; the stream is opened at the first message and
again after it broke. A stage answers only refusals (by request id) and releases; the
draft answers every call by its call id. A stream that breaks (the replica died, the
connection was reset, the replica ended it) is a fault of every request on it: each
request attached to a stage's stream, and each draft call in flight, is told
UNAVAILABLE, which the driver replays (or, for the draft, goes on without it), exactly as
after a dead replica. A stage that does not know `Control` (an older version during a
rolling update) gets the batched unary calls instead (batched.py), from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import Message
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import draft_pb2, stage_pb2

from ..transport import Inbox, Transport, TransportError
from ..transport.codec import Frame
from ..transport.control_frames import CONTROL, bytes_frame, bytes_header, message_of
from .batched import CallBatcher, refusal, settle, stage_batchers
from .control_wire import DraftCallItem, draft_control_parts, stage_control_parts
from .in_place import InPlaceFuture
from .send_round import send_round

log = logging.getLogger(__name__)

# The most bytes of items one message carries: every replica reads at least 1 MiB more
# than its largest single item (services/control.py, `max_control_bytes`), so a turn of
# many requests' prefill chunks is split, never refused whole (which would break the
# stream and replay every request on it).
MESSAGE_BUDGET = 1 << 20

# (status code number, message): a request's item was refused, or its stream broke
OnFault = Callable[[int, str], None]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED


async def _messages(queue: asyncio.Queue) -> AsyncIterator:
    """A stream's outgoing messages, until None."""
    while (msg := await queue.get()) is not None:
        yield msg


@dataclass(frozen=True)
class ControlFrames:
    """The router's data plane, for control frames: the transport that sends them and
    the inbox that hands the replicas' answers to their streams."""

    transport: Transport
    inbox: Inbox


class _Stream:
    """One replica's control stream: messages gathered per event-loop turn (`_collect`
    fills the next one), one call open at a time, its replies to `_on_reply`. With
    `carry_on(frames, address)` a subclass may send messages as control frames to the
    replica's data-plane `address` instead (`_send_frames`); their answers, frames of
    `reply_type`, come to `_on_reply` too."""

    reply_type: type[Message]

    def __init__(self, open_call: Callable[[AsyncIterator], object], label: str) -> None:
        self.open_call, self.label = open_call, label
        self._queue: asyncio.Queue | None = None  # the open call's outgoing messages
        self._reader: asyncio.Task | None = None
        self._flushing = False
        self.opened = 0  # calls opened so far (1 while it never broke)
        self.messages = 0  # messages sent so far (each one gRPC write)
        self._frames: ControlFrames | None = None
        self._address = ""  # the replica's data-plane address, with `_frames`
        self._token = ""  # names this stream's frames; the replica's answers come back with it
        self._sending: set[asyncio.Task] = set()
        self.frames = 0  # control frames sent so far

    # -- what subclasses provide -------------------------------------------------------
    def _collect(self) -> list:
        """The messages of this turn's items (none: nothing to send)."""
        raise NotImplementedError

    def _on_reply(self, reply) -> None:
        raise NotImplementedError

    def _on_break(self, code: int, message: str) -> None:
        raise NotImplementedError

    def _unimplemented(self) -> bool:
        """The replica has no Control: whether the subclass can do without it."""
        return False

    # -- control frames ----------------------------------------------------------------
    def carry_on(self, frames: ControlFrames | None, address: str) -> None:
        """Send what the subclass sends as frames to `address` (frames None or address
        empty: on the stream, a replica that takes no control frames). Frames stopped or
        sent elsewhere break the stream for what is in flight (`_on_break`): their
        answers would come from nowhere."""
        if self._frames is not None and address != self._address:
            # the replica's data plane went or moved (a describe refresh): answers to
            # what went as frames will not come, so that is a fault as a broken stream
            self._stop_frames()
            self._on_break(UNAVAILABLE, f"{self.label}: its data plane changed")
        if frames is None or not address:
            return
        if self._frames is None:
            self._token = f"control:{secrets.token_urlsafe(12)}"
            frames.inbox.route(self._token, self._on_reply_frame)
        self._frames, self._address = frames, address

    def _stop_frames(self) -> None:
        if self._frames is not None:
            self._frames.inbox.close(self._token)
        self._frames, self._address = None, ""

    def _send_frames(self, payloads: list[bytes]) -> None:
        """Send messages (their bytes: control_wire.py) as control frames, in order: each
        at once where the transport can (`post_bytes`), else it and every later one
        through a task, one after another, until none waits. A frame not delivered
        breaks the stream."""
        assert self._frames is not None
        transport, address = self._frames.transport, self._address
        reply_to = transport.address
        at = 0  # those before are sent, as bytes (no tensor: issue 34)
        while at < len(payloads) and not self._sending:
            data = payloads[at]
            header = bytes_header(CONTROL, self._token, len(data), "router", reply_to)
            if not transport.post_bytes(address, header, data):
                break
            at += 1
            self.frames += 1
        if at == len(payloads):
            return
        frames = [
            bytes_frame(CONTROL, self._token, data, "router", reply_to=reply_to)
            for data in payloads[at:]
        ]
        behind = list(self._sending)

        async def send() -> None:
            if behind:
                await asyncio.wait(behind)
            try:
                for header, payload in frames:
                    await transport.send_frame(address, header, payload)
                    self.frames += 1
            except TransportError as e:  # as a broken stream
                log.warning("%s: a control frame was not delivered (%s)", self.label, e)
                self._on_break(UNAVAILABLE, f"{self.label}: control frame not delivered: {e}")

        task = asyncio.ensure_future(send())
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    def _on_reply_frame(self, frame: Frame) -> None:
        try:
            reply = message_of(frame, self.reply_type)
        except ValueError as e:
            log.warning("%s: a bad control answer: %s", self.label, e)
            return
        self._on_reply(reply)

    # -- sending -----------------------------------------------------------------------
    def _schedule(self) -> None:
        if not self._flushing:
            self._flushing = True
            send_round().add(self._flush)  # every replica's in one callback

    def _flush(self) -> None:
        self._flushing = False
        for msg in self._collect():
            if self._queue is None:
                self._open()
            assert self._queue is not None
            self._queue.put_nowait(msg)
            self.messages += 1

    def _open(self) -> None:
        queue: asyncio.Queue = asyncio.Queue()
        self._queue = queue
        self.opened += 1
        self._reader = asyncio.ensure_future(self._read(queue))

    async def _read(self, queue: asyncio.Queue) -> None:
        error, code = "the replica ended it", UNAVAILABLE
        try:
            call = self.open_call(_messages(queue))
            async for reply in call:  # type: ignore[attr-defined]
                self._on_reply(reply)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            if e.code() == UNIMPLEMENTED and self._unimplemented():
                log.info("%s has no control stream: unary calls from now on", self.label)
            error = f"{e.code().name}: {e.details()}"
        except Exception as e:  # a broken stream whatever broke it
            error = repr(e)
        finally:
            if self._queue is queue:
                self._queue = None
            # the request iterator ends (unless the loop is gone: a stream opened while a
            # router that was never stopped shut down, its reader collected unfinished)
            with contextlib.suppress(RuntimeError):
                queue.put_nowait(None)
        log.warning("%s: control stream broke (%s)", self.label, error)
        self._on_break(code, f"{self.label}: control stream broke: {error}")

    async def close(self) -> None:
        """End the open call (router shutdown): nothing is failed."""
        self._stop_frames()
        if self.messages or self.frames:
            log.info("%s: %d control messages on %d stream(s), %d control frames", self.label,
                     self.messages, self.opened, self.frames)  # fmt: skip
        for task in list(self._sending):
            task.cancel()
        reader, self._reader = self._reader, None
        if self._queue is not None:
            self._queue.put_nowait(None)
            self._queue = None
        if reader is not None:
            reader.cancel()


class StageStream(_Stream):
    """A stage's control stream: feeds (stage 1), prunes and releases of every request;
    `attach` says whom to tell of a refusal or a break. With `carry_on(frames, address)`
    the feeds and prunes go as data-plane frames to the stage's `address`."""

    reply_type = stage_pb2.StageControlReply

    def __init__(self, stub, label: str) -> None:
        super().__init__(lambda requests: stub.Control(requests), label)
        self.stub = stub
        self._users: dict[str, OnFault] = {}  # wire id -> told of its refusal or a break
        self._feeds: list[stage_pb2.FeedRequest] = []
        self._prunes: list[pb.PruneRequest] = []
        self._releases: dict[str, list[asyncio.Future]] = {}  # to send: their waiters
        self._released: dict[str, list[asyncio.Future]] = {}  # sent: waiting for the answer
        self.unary: tuple[CallBatcher, CallBatcher] | None = None  # a stage without Control
        # The stage relays prunes (StageDescription.relay_prunes) and this router lets it
        # (not --no-relay-prunes): a path of such stages gets its prunes at stage 1 only.
        self.relays = False

    def attach(self, wire_id: str, on_fault: OnFault) -> None:
        self._users[wire_id] = on_fault
        if self._frames is not None and self._queue is None and self.unary is None:
            self._open()  # the stream's break tells of a lost stage

    def detach(self, wire_id: str) -> None:
        self._users.pop(wire_id, None)

    def feed(self, req: stage_pb2.FeedRequest, timeout: float) -> None:
        if self.unary is not None:
            self._unary(self.unary[0], req, timeout)
            return
        self._feeds.append(req)
        self._schedule()

    def prune(self, req: pb.PruneRequest, timeout: float) -> None:
        if self.unary is not None:
            self._unary(self.unary[1], req, timeout)
            return
        self._prunes.append(req)
        self._schedule()

    def release(self, wire_id: str) -> asyncio.Future:
        """Free the request on the stage; done when the stage answered (True: it holds no
        copy now) or the stream broke (False: the stage is gone, or frees the request
        when its lease expires; nobody confirmed it)."""
        done = asyncio.get_running_loop().create_future()
        if self.unary is not None:
            call = self.stub.Release(pb.RequestRef(request_id=wire_id), timeout=5.0)
            asyncio.ensure_future(call).add_done_callback(
                lambda f: settle(done, result=release_confirmed(f))
            )
            return done
        self._releases.setdefault(wire_id, []).append(done)
        self._schedule()
        return done

    def _unary(self, batcher: CallBatcher, req, timeout: float) -> None:
        user = self._users.get(req.request_id)

        def told(f: asyncio.Future) -> None:
            e = f.exception() if not f.cancelled() else None
            if isinstance(e, grpc.aio.AioRpcError) and user is not None:
                user(e.code().value[0], e.details() or "")
            elif e is not None and user is not None:
                user(UNAVAILABLE, f"{self.label}: {e!r}")

        asyncio.ensure_future(batcher.call(req, timeout)).add_done_callback(told)

    def _collect(self) -> list[stage_pb2.StageControl]:
        if not (self._feeds or self._prunes or self._releases):
            return []
        if self._frames is not None:
            if self._feeds or self._prunes:
                self._send_frames(stage_control_parts(self._feeds, self._prunes, MESSAGE_BUDGET))
            msgs = [stage_pb2.StageControl()] if self._releases else []
        else:
            msgs = _messages_of([*self._prunes, *self._feeds])  # prunes first; at least one
        if self._releases:
            msgs[-1].releases.extend(pb.RequestRef(request_id=r) for r in self._releases)
        for rid, waiters in self._releases.items():
            self._released.setdefault(rid, []).extend(waiters)
        self._feeds, self._prunes, self._releases = [], [], {}
        return msgs

    def _on_reply(self, reply: stage_pb2.StageControlReply) -> None:
        for r in reply.refusals:
            user = self._users.get(r.request_id)
            if user is not None:
                user(r.code, r.message)
        for rid in reply.released:
            for done in self._released.pop(rid, ()):
                settle(done, result=True)

    def _on_break(self, code: int, message: str) -> None:
        waiting, self._released = self._released, {}
        for waiters in waiting.values():
            for done in waiters:
                settle(done, result=False)
        for user in list(self._users.values()):
            user(code, message)

    def _unimplemented(self) -> bool:
        self.unary = stage_batchers(self.stub, self.label)
        self._stop_frames()
        return True


class DraftStream(_Stream):
    """The draft's control stream: `call` sends one call and returns what it answers (a
    `ProposeResponse`, or None), raising its refusal as the unary call would. With
    `carry_on(frames, address)` the calls go as control frames to the draft's `address`
    and come back to the router's inbox; the stream is then open while the draft is used,
    so that a lost draft still breaks it (and fails the calls in flight)."""

    reply_type = draft_pb2.DraftControlReply

    def __init__(self, stub, label: str) -> None:
        super().__init__(lambda requests: stub.Control(requests), label)
        self.stub = stub
        self._ids = itertools.count(1)
        self._calls: list[DraftCallItem] = []
        self._waiting: dict[int, asyncio.Future] = {}
        self.unary = False  # a draft without Control: each call its unary RPC

    def call(self, timeout: float = 60.0, **item) -> asyncio.Future:
        """One call: `propose=`, `prefill=`, `prune=` or `release=` its request
        (`timeout`: a unary call's, to a draft without the stream)."""
        if self.unary:
            ((kind, msg),) = item.items()
            rpc = getattr(self.stub, kind.capitalize())
            return asyncio.ensure_future(rpc(msg, timeout=timeout))
        done = InPlaceFuture()  # answered where its reply is read (in_place.py)
        call_id = next(self._ids)
        ((kind, request),) = item.items()
        self._calls.append(DraftCallItem(call_id, kind, request))
        self._waiting[call_id] = done
        done.then(lambda _: self._waiting.pop(call_id, None))
        self._schedule()
        return done

    def _collect(self) -> list[draft_pb2.DraftControl]:
        calls = [c for c in self._calls if c.call_id in self._waiting]  # not given up
        self._calls = []
        if not calls:
            return []
        if self._frames is None:
            messages = [c.message() for c in calls]
            return [draft_pb2.DraftControl(calls=part) for part in _packed(messages)]
        if self._queue is None:
            self._open()  # beside the frames: the stream's break tells of a lost draft
        self._send_frames(draft_control_parts(calls, MESSAGE_BUDGET))
        return []

    def _on_reply(self, reply: draft_pb2.DraftControlReply) -> None:
        for a in reply.answers:
            done = self._waiting.get(a.call_id)
            if done is None:
                continue
            if a.code:
                settle(done, refusal(a.code, a.message))
            else:
                settle(done, None, a.proposal if a.HasField("proposal") else None)

    def _on_break(self, code: int, message: str) -> None:
        waiting, self._waiting = self._waiting, {}
        self._calls = []
        for done in waiting.values():
            settle(done, refusal(code, message))

    def _unimplemented(self) -> bool:
        self.unary = True
        self._stop_frames()
        return True


def _messages_of(items: list) -> list[stage_pb2.StageControl]:
    """Feeds and prunes in messages of at most MESSAGE_BUDGET bytes, in the items' order
    (the prunes first: `control_wire.stage_control_parts`)."""
    msgs = []
    for part in _packed(items):
        msg = stage_pb2.StageControl()
        for item in part:
            (msg.feeds if isinstance(item, stage_pb2.FeedRequest) else msg.prunes).append(item)
        msgs.append(msg)
    return msgs


def _packed(items: list) -> list[list]:
    """`items` in order, in parts of at most MESSAGE_BUDGET bytes (an item larger than
    that alone); at least one part."""
    parts: list[list] = [[]]
    size = 0
    for item in items:
        n = item.ByteSize()
        if parts[-1] and size + n > MESSAGE_BUDGET:
            parts.append([])
            size = 0
        parts[-1].append(item)
        size += n
    return parts


def release_confirmed(call: asyncio.Future) -> bool:
    """A finished Release call says the replica holds no copy of the request: it released
    one, or had none (NOT_FOUND)."""
    if call.cancelled():
        return False
    e = call.exception()
    return e is None or (
        isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.NOT_FOUND
    )


def control_stream(kind: str, stub, label: str) -> StageStream | DraftStream:
    """A replica's control stream (opened when first used)."""
    return StageStream(stub, label) if kind == "stage" else DraftStream(stub, label)
