"""Blocking client: `Client("host:port").generate(...)` or iterate `client.stream(...)`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
from specpipe.v1 import generation_pb2 as gen
from specpipe.v1 import generation_pb2_grpc

from .common import (
    CHANNEL_OPTIONS,
    Chunk,
    Collector,
    Completion,
    auth_metadata,
    build_request,
    tls_credentials,
)
from .errors import InternalError, error_from_rpc


class GenerationStream:
    """Iterate for chunks as they are verified; `cancel()` stops the request everywhere."""

    def __init__(self, call) -> None:
        self._call = call
        self._collector = Collector()
        self._cancelled = False

    @property
    def request_id(self) -> str:
        return self._collector.request_id

    def __iter__(self) -> Iterator[Chunk]:
        try:
            for resp in self._call:
                chunk = self._collector.add(resp)
                if chunk is not None:
                    yield chunk
        except grpc.RpcError as e:
            if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                return
            raise error_from_rpc(e) from None

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    def result(self) -> Completion:
        """Consume the rest of the stream; the completion with its stats."""
        for _ in self:
            pass
        if self._collector.completion is None:
            raise InternalError("the stream ended without a final message")
        return self._collector.completion


class Client:
    def __init__(
        self,
        address: str,
        timeout: float | None = None,
        api_key: str | None = None,
        tls: bool | str | Path = False,
    ) -> None:
        """`tls`: the router serves TLS; True trusts the system's roots, a path names the
        CA certificate to trust."""
        self.address = address
        self._metadata = auth_metadata(api_key)  # for a router started with --api-key
        self.timeout = timeout  # default deadline of every call, seconds
        creds = tls_credentials(tls)
        self._channel = (
            grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
            if creds is None
            else grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS)
        )
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def stream(
        self, prompt: str | None = None, *, timeout: float | None = None, **kwargs
    ) -> GenerationStream:
        """Start a request (keyword arguments as `build_request`)."""
        req = build_request(prompt, **kwargs)
        return GenerationStream(
            self._stub.Generate(req, timeout=self._deadline(timeout), metadata=self._metadata)
        )

    def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, **kwargs
    ) -> Completion:
        return self.stream(prompt, timeout=timeout, **kwargs).result()

    def tokenize(
        self, text: str, chat: bool = False, model: str = "", timeout: float | None = None
    ) -> list[int]:
        try:
            resp = self._stub.Tokenize(
                gen.TokenizeRequest(model=model, text=text, chat=chat),
                timeout=self._deadline(timeout),
                metadata=self._metadata,
            )
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        return list(resp.token_ids)

    def list_models(self, timeout: float | None = None) -> list[gen.ModelCard]:
        try:
            return list(
                self._stub.ListModels(
                    gen.ListModelsRequest(),
                    timeout=self._deadline(timeout),
                    metadata=self._metadata,
                ).models
            )
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    def describe(self, timeout: float | None = None) -> gen.RouterDescription:
        try:
            return self._stub.Describe(
                gen.DescribeRouterRequest(),
                timeout=self._deadline(timeout),
                metadata=self._metadata,
            )
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
