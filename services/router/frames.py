"""What a last stage's data-plane frame says about a request, checked before anything
of it reaches the controller: a verification, or the stage's report that it failed the
request."""

from __future__ import annotations

import grpc
from specpipe.common.spec.controller import Controller
from specpipe.common.spec.messages import Verified

from ..control import verified_from_proto
from ..grpc_util import code_from_number
from ..transport import FrameError
from ..transport.codec import Frame, Kind


def failure_of(frame: Frame) -> tuple[grpc.StatusCode, str] | None:
    """(status, message) of a frame in which a stage reports that it failed the request
    (UNAVAILABLE: it cannot reach its next hop); None for any other frame."""
    if frame.kind != Kind.PAYLOAD_KIND_ERROR:
        return None
    h = frame.header
    code = code_from_number(h.error_code or grpc.StatusCode.INTERNAL.value[0])
    return code, h.error or f"{h.sender} failed"


def verification_of(frame: Frame, controller: Controller, vocab_size: int | None) -> Verified:
    """What a last stage's frame verified, checked against the request. Raises
    FrameError for a frame of another kind, InvalidInput / ValueError for a malformed
    `Verification`."""
    if frame.kind != Kind.PAYLOAD_KIND_VERIFIED:
        raise FrameError(f"the router takes verifications, not frames of kind {frame.kind}")
    return verified_from_proto(
        frame.request_id,
        frame.header.verified,
        controller.tree_rows,
        vocab_size,
        controller.opts.logprobs is not None,
    )
