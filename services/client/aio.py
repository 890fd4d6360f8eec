"""asyncio client: `await AsyncClient(addr).generate(...)`, or `async for` over a stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
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


class AsyncGenerationStream:
    def __init__(self, call) -> None:
        self._call = call
        self._collector = Collector()
        self._cancelled = False

    @property
    def request_id(self) -> str:
        return self._collector.request_id

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        try:
            async for resp in self._call:
                chunk = self._collector.add(resp)
                if chunk is not None:
                    yield chunk
        except grpc.RpcError as e:
            if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                return
            raise error_from_rpc(e) from None
        except asyncio.CancelledError:
            if self._cancelled:  # grpc.aio reports our own cancel() this way
                return
            self._call.cancel()
            raise
        except BaseException:
            # The consumer went away (task cancelled): cancel the request server-side too.
            self._call.cancel()
            raise

    def cancel(self) -> None:
        """Stop the request; the router frees its state on every stage and the draft."""
        self._cancelled = True
        self._call.cancel()

    async def result(self) -> Completion:
        async for _ in self:
            pass
        if self._collector.completion is None:
            raise InternalError("the stream ended without a final message")
        return self._collector.completion


class AsyncClient:
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
        self.timeout = timeout
        creds = tls_credentials(tls)
        self._channel = (
            grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            if creds is None
            else grpc.aio.secure_channel(address, creds, options=CHANNEL_OPTIONS)
        )
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def stream(
        self, prompt: str | None = None, *, timeout: float | None = None, **kwargs
    ) -> AsyncGenerationStream:
        req = build_request(prompt, **kwargs)
        return AsyncGenerationStream(
            self._stub.Generate(req, timeout=self._deadline(timeout), metadata=self._metadata)
        )

    async def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, **kwargs
    ) -> Completion:
        return await self.stream(prompt, timeout=timeout, **kwargs).result()

    async def tokenize(
        self, text: str, chat: bool = False, model: str = "", timeout: float | None = None
    ) -> list[int]:
        try:
            resp = await self._stub.Tokenize(
                gen.TokenizeRequest(model=model, text=text, chat=chat),
                timeout=self._deadline(timeout),
                metadata=self._metadata,
            )
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        return list(resp.token_ids)

    async def list_models(self, timeout: float | None = None) -> list[gen.ModelCard]:
        try:
            resp = await self._stub.ListModels(
                gen.ListModelsRequest(), timeout=self._deadline(timeout), metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        return list(resp.models)

    async def describe(self, timeout: float | None = None) -> gen.RouterDescription:
        try:
            return await self._stub.Describe(
                gen.DescribeRouterRequest(),
                timeout=self._deadline(timeout),
                metadata=self._metadata,
            )
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
