"""asyncio client: `await AsyncClient(addr).generate(...)`, or `async for` over a stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Unpack

import grpc
from specpipe.common.spec.request_options import RequestOptions
from specpipe.v1 import generation_pb2 as gen

from .common import (
    Chunk,
    Collector,
    Completion,
    Resumer,
    RouterTargets,
    build_request,
)
from .errors import InternalError, error_from_rpc


class AsyncGenerationStream:
    """`async for` the chunks as they are verified; `cancel()` stops the request
    everywhere. A stream whose router dies is resumed on the client's next router
    address from the tokens received (`ResumePolicy`), as one uninterrupted stream."""

    def __init__(self, client: AsyncClient, request: gen.GenerateRequest, timeout) -> None:
        self._client = client
        self._resumer = Resumer(
            request, len(client.targets), client._current, client.resume, timeout
        )
        self._collector = Collector()
        self._cancelled = False
        self._call = client._generate(self._resumer.target, request, self._resumer.timeout())

    @property
    def request_id(self) -> str:
        return self._collector.request_id

    @property
    def resumes(self) -> int:
        """How often the stream was resumed on another router so far."""
        return self._collector.resumes

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        while True:
            try:
                async for resp in self._call:
                    chunk = self._collector.add(resp)
                    if chunk is not None:
                        yield chunk
                return
            except grpc.RpcError as e:
                if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                    return
                address = self._client.targets[self._resumer.target]
                await asyncio.sleep(self._resumer.next(e, self._collector, address))
                if self._cancelled:
                    return
                req = self._resumer.resumed_request(self._collector)
                self._call = self._client._generate(
                    self._resumer.target, req, self._resumer.timeout()
                )
            except asyncio.CancelledError:
                if self._cancelled:  # grpc.aio reports our own cancel() this way
                    return
                self._call.cancel()
                raise
            except BaseException:
                # The consumer went away (task cancelled): cancel the request server-side.
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


class AsyncClient(RouterTargets):
    """The asyncio client of one router, or of several (`RouterTargets`: a stream whose
    router dies is resumed on the next)."""

    API = grpc.aio

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for ch, _ in self._stubs.values():
            await ch.close()

    def stream(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> AsyncGenerationStream:
        """Start a request (the prompt and options as `build_request`'s)."""
        req = build_request(prompt, prompt_ids=prompt_ids, **options)
        return AsyncGenerationStream(self, req, self._deadline(timeout))

    async def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> Completion:
        return await self.stream(prompt, prompt_ids=prompt_ids, timeout=timeout, **options).result()

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
