"""Client SDK of the SpecPipe router (also importable as `specpipe.client`).

from specpipe.client import Client
with Client(["10.0.0.5:50051", "10.0.0.6:50051"], timeout=60) as c:
    for chunk in c.stream("Hello", max_new_tokens=32):
        print(chunk.text, end="", flush=True)

A stream whose router dies is resumed on the next address (or the same one, restarted)
from the tokens already received: the chunks go on as one exact stream (`ResumePolicy`).
"""

from .aio import AsyncClient, AsyncGenerationStream
from .common import Chunk, Completion, ResumePolicy, build_request
from .errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SpecPipeError,
    Unauthenticated,
    Unavailable,
    error_from_rpc,
)
from .sync import Client, GenerationStream

__all__ = [
    "AsyncClient",
    "AsyncGenerationStream",
    "Cancelled",
    "Chunk",
    "Client",
    "Completion",
    "DeadlineExceeded",
    "FailedPrecondition",
    "GenerationStream",
    "InternalError",
    "InvalidArgument",
    "NotFound",
    "ResourceExhausted",
    "ResumePolicy",
    "SpecPipeError",
    "Unauthenticated",
    "Unavailable",
    "build_request",
    "error_from_rpc",
]
