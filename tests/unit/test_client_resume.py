"""The SDK's resume decisions without a server (services/client/common.py): which
failures are a router's death, where and when the next try goes, what it sends, and the
one clear error when no attempt is left; the HTTP body's resume field per choice."""

from __future__ import annotations

import grpc
import pytest
from specpipe.services.client.common import (
    Collector,
    ResumePolicy,
    Resumer,
    broken,
    build_request,
    targets_of,
)
from specpipe.services.client.errors import InvalidArgument, Unavailable
from specpipe.services.router.openai_compat import ApiError, CompletionRequest
from specpipe.v1 import generation_pb2 as gen


class RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def collector_with(tokens: list[int], prompt_logprobs: bool = False) -> Collector:
    c = Collector()
    c.add(gen.GenerateResponse(started=gen.Started(request_id="a")))
    delta = gen.TokenDelta(token_ids=tokens, index=0)
    if prompt_logprobs:
        delta.prompt_token_ids.extend([1, 2])
    c.add(gen.GenerateResponse(delta=delta))
    return c


def test_a_routers_death_is_told_apart_from_the_requests_own_errors() -> None:
    assert broken(RpcError(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
    assert broken(RpcError(grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2"))
    assert not broken(RpcError(grpc.StatusCode.INTERNAL, "the request failed: bug"))
    assert not broken(RpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad"))
    assert not broken(RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy"))


def test_targets_and_the_backoff() -> None:
    assert targets_of("a:1, b:2") == targets_of(["a:1", "b:2"]) == ["a:1", "b:2"]
    with pytest.raises(ValueError):
        targets_of("")
    p = ResumePolicy(attempts=5, backoff=0.1, max_backoff=0.3)
    assert [p.wait(i) for i in (1, 2, 3, 4)] == [0.1, 0.2, 0.3, 0.3]
    with pytest.raises(ValueError):
        ResumePolicy(attempts=-1)


def test_the_resumed_request_carries_the_tokens_received_on_the_next_address() -> None:
    req = build_request(prompt_ids=[5, 6], max_new_tokens=9, seed=3, prompt_logprobs=1)
    r = Resumer(req, targets=3, first=2, policy=ResumePolicy(attempts=2, backoff=0.0),
                timeout=None)  # fmt: skip
    c = collector_with([7, 8], prompt_logprobs=True)
    assert r.next(RpcError(grpc.StatusCode.UNAVAILABLE, "gone"), c, "c:3") == 0.0
    assert r.target == 0  # round robin from the failed address
    again = r.resumed_request(c)
    assert list(again.resume_token_ids) == [7, 8] and again.sampling.seed == 3
    assert not again.HasField("prompt_logprobs")  # they came already
    assert list(req.resume_token_ids) == [] and c.resumes == 1
    c.add(gen.GenerateResponse(delta=gen.TokenDelta(token_ids=[9], index=2)))
    assert list(r.resumed_request(c).resume_token_ids) == [7, 8, 9]


def test_no_attempt_left_is_one_clear_error_naming_every_try() -> None:
    r = Resumer(build_request(prompt_ids=[1]), targets=2, first=0,
                policy=ResumePolicy(attempts=1, backoff=0.0), timeout=None)  # fmt: skip
    c = collector_with([4])
    r.next(RpcError(grpc.StatusCode.UNAVAILABLE, "first down"), c, "a:1")
    with pytest.raises(Unavailable) as info:
        r.next(RpcError(grpc.StatusCode.UNAVAILABLE, "second down"), c, "b:2")
    message = info.value.message
    assert "after 1 tokens" in message and "every attempt failed; 1 resumes tried" in message
    assert "a:1" in message and "first down" in message and "b:2" in message


def test_the_requests_own_error_is_raised_at_once() -> None:
    r = Resumer(build_request(prompt_ids=[1]), targets=2, first=0, policy=ResumePolicy(),
                timeout=None)  # fmt: skip
    with pytest.raises(InvalidArgument):
        r.next(RpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad"), collector_with([]), "a:1")


def test_the_http_resume_field_is_one_list_per_choice() -> None:
    body = CompletionRequest(prompt="x", n=2, seed=4, resume_token_ids=[[1, 2], [3]])
    reqs = body.to_requests("x", 16, "pp")
    assert [list(r.resume_token_ids) for r in reqs] == [[1, 2], [3]]
    assert [r.sampling.seed for r in reqs] == [4, 5]
    for bad in ([[1]], [1, 2]):
        with pytest.raises(ApiError):
            CompletionRequest(prompt="x", n=2, resume_token_ids=bad).to_requests("x", 16, "pp")
