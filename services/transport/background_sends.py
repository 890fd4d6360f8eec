"""Frames a replica sends from the event loop without waiting for them: answers to
control frames (control_frames.py) and a stage's failure reports. A frame that cannot
be delivered is logged (rate-limited) and dropped: whoever waits for it learns of the
loss on its own (the router from its control stream, which a lost replica breaks)."""

from __future__ import annotations

import asyncio
import logging

import torch
from specpipe.v1 import dataplane_pb2 as pb

from ..ratelog import RateLimitedLog
from .base import Transport, TransportError

rlog = RateLimitedLog(logging.getLogger(__name__))


class BackgroundSends:
    """One replica's frames in flight: each send that must wait a task, kept until it
    ends."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._tasks: set[asyncio.Task] = set()

    def send(
        self,
        address: str,
        header: pb.FrameHeader,
        payload: torch.Tensor | None,
        what: str,
        who: str,
    ) -> None:
        """Send a frame to `address` (`what` it does and `who` sends it: for the log): at
        once where the transport can without passing an earlier one (`post_frame`), else
        through a task."""
        if not self._tasks and self.transport.post_frame(address, header, payload):
            return

        async def send() -> None:
            try:
                await self.transport.send_frame(address, header, payload)
            except TransportError as e:
                rlog.warning(what, "%s: cannot %s: %s", who, what, e)

        task = asyncio.ensure_future(send())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
