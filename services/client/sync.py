"""Blocking client: `Client("host:port").generate(...)` or iterate `client.stream(...)`."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
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


class GenerationStream:
    """Iterate for chunks as they are verified; `cancel()` stops the request everywhere.
    When the stream breaks because its router died, the request is resumed on the
    client's next router address from the tokens received (`ResumePolicy`): the chunks
    go on as one uninterrupted, exact stream."""

    def __init__(self, client: Client, request: gen.GenerateRequest, timeout) -> None:
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

    def __iter__(self) -> Iterator[Chunk]:
        while True:
            try:
                for resp in self._call:
                    chunk = self._collector.add(resp)
                    if chunk is not None:
                        yield chunk
                return
            except grpc.RpcError as e:
                if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                    return
                address = self._client.targets[self._resumer.target]
                time.sleep(self._resumer.next(e, self._collector, address))
                if self._cancelled:
                    return
                req = self._resumer.resumed_request(self._collector)
                self._call = self._client._generate(
                    self._resumer.target, req, self._resumer.timeout()
                )

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


class Client(RouterTargets):
    """The blocking client of one router, or of several (`RouterTargets`: a stream whose
    router dies is resumed on the next)."""

    API = grpc

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for ch, _ in self._stubs.values():
            ch.close()

    def stream(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> GenerationStream:
        """Start a request (the prompt and options as `build_request`'s)."""
        return GenerationStream(
            self, build_request(prompt, prompt_ids=prompt_ids, **options), self._deadline(timeout)
        )

    def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> Completion:
        return self.stream(prompt, prompt_ids=prompt_ids, timeout=timeout, **options).result()

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
