"""Client-facing behaviour of a running deployment: streaming order, text, model
listing, bad input, concurrent clients, cancellation and deadlines freeing state,
health and reflection, and the `specpipe client` command."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specpipe.client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)

from .conftest import reference, reference_stats, wait_idle

PROMPT = [3, 14, 15, 92, 65]
ENTRY = "import sys; from specpipe.cli import main; sys.exit(main(sys.argv[1:]))"


def test_stream_order_and_final_message(tcp_deployment) -> None:
    with Client(tcp_deployment.router_address, timeout=60) as client:
        stream = client.stream(
            prompt_ids=PROMPT, mode="specinfer", max_new_tokens=30, ignore_eos=True
        )
        chunks = list(stream)
        done = stream.result()
    assert stream.request_id
    index = 0
    for chunk in chunks:
        assert chunk.index == index and chunk.token_ids
        index += len(chunk.token_ids)
    assert [t for c in chunks for t in c.token_ids] == done.token_ids
    assert len(done.token_ids) == done.completion_tokens == 30
    assert done.prompt_tokens == len(PROMPT)
    assert done.stats["mode"] == "specinfer" and done.stats["decode_steps"] > 0
    assert done.stats["mean_time_between_tokens_ms"] > 0
    # SpecInfer's step count does not depend on timing: the engine's, exactly.
    engine = reference_stats(
        tcp_deployment.target, tcp_deployment.draft, 2, PROMPT, "specinfer", 30
    )
    assert done.stats["decode_steps"] == engine.decode_steps
    assert done.stats["steady_tokens_per_step"] == round(engine.steady_tokens_per_step, 6)
    assert done.stats["steady_tokens_per_step"] > 1  # several tokens per pass
    assert done.stats["regrowths"] == 0  # specpipe only


def test_text_prompt_tokenize_and_text_deltas(tcp_deployment) -> None:
    with Client(tcp_deployment.router_address, timeout=60) as client:
        ids = client.tokenize("Hello, pipeline!")
        assert len(ids) == len("Hello, pipeline!")
        by_text = client.stream("Hello, pipeline!", max_new_tokens=20, ignore_eos=True)
        text = "".join(c.text for c in by_text)
        done = by_text.result()
        by_ids = client.generate(prompt_ids=ids, max_new_tokens=20, ignore_eos=True)
    assert done.token_ids == by_ids.token_ids
    from specpipe.common.text import TextCodec

    assert text == done.text == TextCodec.from_dir(tcp_deployment.target).decode(done.token_ids)


def test_list_models(tcp_deployment) -> None:
    with Client(tcp_deployment.router_address, timeout=10) as client:
        (card,) = client.list_models()
    assert card.id == tcp_deployment.target.name
    assert card.vocab_size == 97 and card.max_context == 256 and card.num_layers == 5
    assert card.stages == 2 and card.has_tokenizer and len(card.weight_hash) == 16
    assert set(card.modes) == {"specpipe", "pp", "specinfer", "autoregressive"}


BAD_REQUESTS = [
    (dict(prompt_ids=[]), InvalidArgument, "prompt is empty"),
    (dict(prompt=""), InvalidArgument, "prompt is empty"),
    (dict(prompt_ids=[1] * 256), InvalidArgument, "context holds 256"),
    (dict(max_new_tokens=0), InvalidArgument, "max_new_tokens must be positive"),
    (dict(max_new_tokens=-3), InvalidArgument, "max_new_tokens must be positive"),
    (dict(max_new_tokens=10**12), InvalidArgument, "too large"),
    (dict(max_new_tokens=252), InvalidArgument, "leaves room for 251"),
    (dict(temperature=-0.5), InvalidArgument, "temperature must be >= 0"),
    (dict(temperature=float("nan")), InvalidArgument, "temperature must be >= 0"),
    (dict(top_p=0.0), InvalidArgument, "top_p must be in (0, 1]"),
    (dict(top_p=1.5), InvalidArgument, "top_p must be in (0, 1]"),
    (dict(top_k=-1), InvalidArgument, "top_k"),
    (dict(seed=-1), InvalidArgument, "seed"),
    (dict(mode="beam"), InvalidArgument, "unknown mode 'beam'"),
    (dict(prompt_ids=[5, 97]), InvalidArgument, "outside the vocabulary"),
    (dict(prompt_ids=[-1]), InvalidArgument, "outside the vocabulary"),
    (dict(model="gpt-17"), NotFound, "model 'gpt-17' is not served here"),
    (dict(width=-1), InvalidArgument, "width must be in"),
    (dict(depth=10**6), InvalidArgument, "depth must be in"),
    (dict(stop_token_ids=[1000]), InvalidArgument, "stop token ids"),
    (dict(prompt_ids=[1, 2], chat=True), InvalidArgument, "chat needs a text prompt"),
]


def test_bad_requests_get_clear_statuses_and_the_deployment_keeps_serving(tcp_deployment) -> None:
    with Client(tcp_deployment.router_address, timeout=30) as client:
        for kwargs, error, fragment in BAD_REQUESTS:
            args = {"prompt_ids": PROMPT, "max_new_tokens": 4, **kwargs}
            if "prompt" in kwargs:
                args.pop("prompt_ids")
            with pytest.raises(error) as info:
                client.generate(**args)
            assert fragment in info.value.message, (kwargs, info.value.message)
        with pytest.raises(InvalidArgument):
            client.tokenize("")
        ok = client.generate(prompt_ids=PROMPT, max_new_tokens=5, ignore_eos=True)
        assert len(ok.token_ids) == 5


def test_concurrent_clients_get_independent_correct_outputs(tcp_deployment) -> None:
    dep = tcp_deployment
    jobs = [
        ([7, 8, 9], "specpipe", 0.0, 0),
        ([40, 41], "pp", 0.0, 0),
        ([12, 60, 3, 3], "specinfer", 0.7, 3),
        ([90], "specpipe", 1.0, 9),
        ([7, 8, 9], "autoregressive", 0.0, 0),
    ]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        prompt, mode, temp, seed = jobs[i]
        try:
            with Client(dep.router_address, timeout=60) as client:
                results[i] = client.generate(
                    prompt_ids=prompt,
                    mode=mode,
                    max_new_tokens=20,
                    temperature=temp,
                    seed=seed,
                    ignore_eos=True,
                ).token_ids
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, (prompt, mode, temp, seed) in enumerate(jobs):
        assert results[i] == reference(dep.target, dep.draft, 2, prompt, mode, 20, temp, seed), (
            jobs[i]
        )


def test_cancel_frees_state_on_router_draft_and_every_stage(tcp_deployment) -> None:
    with Client(tcp_deployment.router_address, timeout=60) as client:
        stream = client.stream(prompt_ids=PROMPT, max_new_tokens=240, ignore_eos=True)
        seen = 0
        for chunk in stream:
            seen += len(chunk.token_ids)
            if seen >= 3:
                stream.cancel()
        assert 3 <= seen < 240
    counts = wait_idle(tcp_deployment)
    assert not any(counts.values()), counts


def test_async_client_streams_and_cancels(tcp_deployment) -> None:
    async def main() -> list[int]:
        async with AsyncClient(tcp_deployment.router_address, timeout=60) as client:
            done = await client.generate(
                prompt_ids=PROMPT, mode="pp", max_new_tokens=8, ignore_eos=True
            )
            stream = client.stream(prompt_ids=PROMPT, max_new_tokens=240, ignore_eos=True)
            got = 0
            async for chunk in stream:
                got += len(chunk.token_ids)
                if got >= 2:
                    stream.cancel()
            return done.token_ids

    tokens = asyncio.run(main())
    assert tokens == reference(tcp_deployment.target, None, 2, PROMPT, "pp", 8)
    counts = wait_idle(tcp_deployment)
    assert not any(counts.values()), counts


def test_deadline_fails_fast_and_frees_state(tcp_deployment) -> None:
    with Client(tcp_deployment.router_address) as client, pytest.raises(DeadlineExceeded):
        client.generate(prompt_ids=PROMPT, max_new_tokens=240, ignore_eos=True, timeout=0.3)
    counts = wait_idle(tcp_deployment)
    assert not any(counts.values()), counts


def test_health_and_reflection_on_every_service(tcp_deployment) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    expected = {
        "router": "specpipe.v1.Generation",
        "draft": "specpipe.v1.Draft",
        "stage0": "specpipe.v1.Stage",
    }
    for name, service in expected.items():
        with grpc.insecure_channel(tcp_deployment.children[name].info["grpc"]) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for svc in ("", service):
                resp = health.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            req = reflection_pb2.ServerReflectionRequest(list_services="")
            (resp,) = list(refl.ServerReflectionInfo(iter([req]), timeout=5))
            names = {s.name for s in resp.list_services_response.service}
            assert {service, "grpc.health.v1.Health"} <= names


def test_stages_and_draft_run_on_the_device_they_were_given(tcp_deployment) -> None:
    import torch
    from specpipe.services.modelinfo import resolve_device
    from specpipe.v1 import dataplane_pb2

    from .conftest import service_stub

    want = torch.device(resolve_device("auto")).type  # the fixture's --device auto
    for name in ("stage0", "stage1", "draft"):
        argv = tcp_deployment.children[name].argv
        # `up` resolves "auto" and places each service (one GPU each where there are GPUs)
        assert torch.device(argv[argv.index("--device") + 1]).type == want
        kind = "draft" if name == "draft" else "stage"
        ch, stub = service_stub(tcp_deployment.children[name].info["grpc"], kind)
        with ch:
            desc = stub.Describe(dataplane_pb2.DescribeRequest(), timeout=5)
        assert torch.device(desc.device).type == want, (name, desc.device)
        assert desc.free_memory_bytes > 0


def test_draft_mode_without_a_draft_is_a_failed_precondition() -> None:
    from specpipe.services.client.errors import error_from_rpc

    class Fake(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.FAILED_PRECONDITION

        def details(self):
            return "needs a draft"

    err = error_from_rpc(Fake())
    assert isinstance(err, FailedPrecondition) and str(err) == "FAILED_PRECONDITION: needs a draft"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", ENTRY, *args], capture_output=True, text=True, timeout=120
    )


def test_client_cli_json_and_errors(tcp_deployment) -> None:
    addr = tcp_deployment.router_address
    out = _cli("client", "generate", "--router", addr, "--prompt-ids", "3,14,15", "--mode", "specinfer",
               "--max-new-tokens", "12", "--ignore-eos", "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["token_ids"] == reference(
        tcp_deployment.target, tcp_deployment.draft, 2, [3, 14, 15], "specinfer", 12
    )
    assert data["text"] is None
    assert set(data["stats"]) == {
        "mode", "stages", "width", "prefill_steps", "decode_steps", "new_tokens", "tokens_per_step", "hit_rate",
    }  # fmt: skip
    assert set(data) == {"token_ids", "text", "stats", "speculation", "model", "weight_hash"}
    # as `specpipe generate`; the version that served it, as the stages report it
    from specpipe.common.model.loading import weight_fingerprint

    assert data["weight_hash"] == weight_fingerprint(tcp_deployment.target)
    assert set(data["speculation"]) == {
        "regrowths", "steady_tokens_per_step", "layers_per_step", "token_source",
        "draft_hit_rate", "ngram_hit_rate",
    }  # fmt: skip
    pp = _cli("client", "generate", "--router", addr, "--prompt-ids", "3,14,15", "--mode", "pp",
              "--max-new-tokens", "6", "--ignore-eos", "--json")  # fmt: skip
    assert pp.returncode == 0, pp.stderr
    # pp: one token per pass through the 2 stages once the first token is out.
    spec = json.loads(pp.stdout)["speculation"]
    assert (spec["regrowths"], spec["steady_tokens_per_step"]) == (0, 0.5)
    assert spec["token_source"] == ""  # pp grows no tree
    text = _cli(
        "client",
        "generate",
        "--router",
        addr,
        "--prompt",
        "Hi",
        "--max-new-tokens",
        "5",
        "--ignore-eos",
    )
    assert text.returncode == 0 and "tokens/step=" in text.stderr
    bad = _cli(
        "client", "generate", "--router", addr, "--prompt-ids", "3,999", "--max-new-tokens", "5"
    )
    assert bad.returncode != 0
    assert "INVALID_ARGUMENT" in bad.stderr and "outside the vocabulary" in bad.stderr


def test_bench_serve_loads_the_router_and_reports(tcp_deployment, tmp_path, capsys) -> None:
    import json

    from specpipe.cli import main

    out = tmp_path / "serve.json"
    code = main(
        ["bench", "serve", "--router", tcp_deployment.router_address, "--dataset", "random:5",
         "--num-requests", "6", "--concurrency", "3", "--max-new-tokens", "8", "--ignore-eos",
         "--mode", "pp", "--json", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 48 and summary["output_throughput"] > 0
    assert 0 < summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p99"]
    saved = json.loads(out.read_text())
    assert len(saved["requests"]) == 6 and saved["summary"]["config"]["concurrency"] == 3
