"""What a last stage's data-plane frame says about a request, checked before anything
of it reaches the controller: a verification, logits (a last stage that predates
verification), or the stage's report that it failed the request."""

from __future__ import annotations

import grpc
import torch
from specpipe.common.runtime.validation import check_payload
from specpipe.common.spec.controller import Controller
from specpipe.common.spec.messages import Activation, Verified

from ..control import verified_from_proto
from ..grpc_util import code_from_number
from ..transport import FrameError, decode
from ..transport.codec import Frame, Kind

LOGIT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def failure_of(frame: Frame) -> tuple[grpc.StatusCode, str] | None:
    """(status, message) of a frame in which a stage reports that it failed the request
    (UNAVAILABLE: it cannot reach its next hop); None for any other frame."""
    if frame.kind != Kind.PAYLOAD_KIND_ERROR:
        return None
    h = frame.header
    code = code_from_number(h.error_code or grpc.StatusCode.INTERNAL.value[0])
    return code, h.error or f"{h.sender} failed"


def logits_of(frame: Frame, vocab_size: int | None) -> Activation:
    """The rows of a logits frame, checked: [rows, vocab] floats, all finite
    (InvalidInput otherwise; FrameError for a frame of another kind)."""
    act = decode(frame) if frame.kind == Kind.PAYLOAD_KIND_LOGITS else None
    if act is None or act.logits is None:
        raise FrameError(
            f"the router takes verifications or logits, not frames of kind {frame.kind}"
        )
    x = act.logits
    vocab = vocab_size or (x.shape[-1] if x.ndim else 0)
    check_payload(x, len(act), vocab, LOGIT_DTYPES, "logits")
    return act


def verification_of(
    frame: Frame, controller: Controller, vocab_size: int | None
) -> Verified | None:
    """What a last stage's frame verified, checked against the request: a
    `Verification`, or logits walked by the controller. None: logits of no current root
    (stale). Raises FrameError / InvalidInput / ValueError for a malformed frame."""
    if frame.kind == Kind.PAYLOAD_KIND_VERIFIED:
        return verified_from_proto(
            frame.request_id,
            frame.header.verified,
            controller.tree_rows,
            vocab_size,
            controller.opts.logprobs is not None,
        )
    return controller.verification_of(logits_of(frame, vocab_size))
