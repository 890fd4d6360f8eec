"""The one mapping from the runtimes' request errors to gRPC status codes, used by the
stage and the draft service."""

from __future__ import annotations

import grpc
from specpipe.common.runtime.errors import (
    AlreadyOpen,
    BadInput,
    CacheFull,
    DuplicatePrune,
    InvalidInput,
    NotOpen,
    NotOwner,
    Overloaded,
)

from .control import FrameError

CODES: dict[type[Exception], grpc.StatusCode] = {
    FrameError: grpc.StatusCode.INVALID_ARGUMENT,
    CacheFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NotOpen: grpc.StatusCode.NOT_FOUND,
    AlreadyOpen: grpc.StatusCode.ALREADY_EXISTS,
    BadInput: grpc.StatusCode.FAILED_PRECONDITION,
    DuplicatePrune: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    NotOwner: grpc.StatusCode.PERMISSION_DENIED,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def status_code(e: Exception) -> grpc.StatusCode:
    """The status a call that failed with `e` answers with: by the error's type, and
    FAILED_PRECONDITION for any other error (a value the runtime cannot use)."""
    for cls in type(e).__mro__:
        if cls in CODES:
            return CODES[cls]
    return grpc.StatusCode.FAILED_PRECONDITION
