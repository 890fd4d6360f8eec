"""Typed errors of the client SDK: one class per gRPC status a caller may handle."""

from __future__ import annotations

import grpc

# Trailing metadata of an UNAVAILABLE the router answered itself after running the
# request and trying what it could (its replays, within its replay time): the router is
# there and has given up on the request, so the SDK does not resume it (it resumes
# streams whose router went away, and refusals of a router still starting or draining).
FINAL_METADATA = ("specpipe-final", "1")


class SpecPipeError(Exception):
    """A failed call; `code` is the gRPC status, `message` the server's explanation."""

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    @property
    def code_name(self) -> str:
        return self.code.name

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgument(SpecPipeError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(SpecPipeError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(SpecPipeError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(SpecPipeError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(SpecPipeError):
    """The deployment (or a stage of it) cannot serve now; retrying later may work."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(SpecPipeError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(SpecPipeError):
    code = grpc.StatusCode.CANCELLED


class InternalError(SpecPipeError):
    code = grpc.StatusCode.INTERNAL


class Unauthenticated(SpecPipeError):
    """The router has API keys and the call carried none, or a wrong one (`api_key=`)."""

    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        InternalError,
        Unauthenticated,
    )
}


def error_from_rpc(e: grpc.RpcError) -> SpecPipeError:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else None) or code.name.lower()
    cls = _BY_CODE.get(code, SpecPipeError)
    return cls(details, code)
