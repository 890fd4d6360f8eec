"""Client SDK of the SpecPipe router (also importable as `specpipe.client`).

from specpipe.client import Client
with Client("127.0.0.1:50051", timeout=60) as c:
    for chunk in c.stream("Hello", max_new_tokens=32):
        print(chunk.text, end="", flush=True)
"""

from .aio import AsyncClient, AsyncGenerationStream
from .common import Chunk, Completion, build_request
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
    "SpecPipeError",
    "Unauthenticated",
    "Unavailable",
    "build_request",
    "error_from_rpc",
]
