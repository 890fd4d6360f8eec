"""Fixtures of the multi-process service tests: deployments of tiny random models on
loopback (separate OS processes, free ports), always torn down, and references from
the in-process engine."""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from specpipe.common.runtime.loader import build_local, parse_dtype
from specpipe.common.runtime.lockstep import LockstepGeneration
from specpipe.common.spec.options import DecodeOptions
from specpipe.common.spec.sampling import SamplingParams
from specpipe.common.spec.stats import DecodeStats
from specpipe.services.launcher import ServicesDeployment
from specpipe.services.router.requests import RequestDefaults

EOS = 96  # the conftest models' eos_token_id (vocab - 1)

# Deployments and their in-process references compute in fp64. They run the same rows in
# other groupings (cache shapes, one stage per process), and fp32 results differ by ~1e-5
# with shape and with the CPU's BLAS kernels: enough, on some machine, for a seeded draw
# near a CDF step or a near-tie to come out differently. fp64 noise (~1e-13) cannot.
DTYPE = "float64"


# A chat template in the char tokenizer's alphabet (printable ASCII, no newline).
CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}|{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


# A chat template that teaches Qwen2.5's tool-call format (`<tool_call>{...}</tool_call>`),
# in the same alphabet: the tools (by name: the tiny models' context is short), an
# assistant's calls and the tools' results rendered.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}[tools]{% for t in tools %}{{ t.function.name }};{% endfor %}"
    "<tool_call>|{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}'
    "</tool_call>{% endfor %}|{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def add_char_tokenizer(model_dir: Path, chat_template: str = CHAT_TEMPLATE) -> Path:
    """A character-level tokenizer over the tiny models' 97 ids: id 0 <s>, 1..95 the
    printable ASCII characters, 96 </s> (so text prompts and text deltas can be tested),
    with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, **{chr(c): c - 31 for c in range(32, 127)}, "</s>": 96}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = chat_template
    fast.save_pretrained(model_dir)
    return model_dir


@pytest.fixture(scope="session")
def text_model_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The llama test model plus a tokenizer."""
    d = tmp_path_factory.mktemp("llama_text")
    for f in llama_dir.iterdir():
        shutil.copy(f, d / f.name)
    return add_char_tokenizer(d)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failing test's report carries the log tails of the deployments it used: a hang
    or a lost request on a CI machine is otherwise seen only as a client's deadline."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    for fixture, value in getattr(item, "funcargs", {}).items():
        if isinstance(value, ServicesDeployment):
            for name, child in value.children.items():
                tail = child.log_tail(LOG_TAIL_LINES)
                if tail:
                    report.sections.append((f"{fixture}: {name}.log (last lines)", tail))


LOG_TAIL_LINES = 40


PINNED_TREE = dataclasses.asdict(RequestDefaults.fixed())


def start(target: Path, draft, stages: int, transport: str, **kw) -> ServicesDeployment:
    """A deployment, plaintext unless `secure=True` is given: these tests call stages and
    the draft themselves. The launcher's default (secure) is what `specpipe up` runs;
    tests/integration/test_launcher.py and the --secure tests cover it."""
    kw.setdefault("dtype", DTYPE)
    kw.setdefault("secure", False)
    # The tree of requests that set none is pinned (the router would tune it): these
    # tests check one setting's mechanics; a None given keeps the router's tuning.
    kw["scheduling"] = {**PINNED_TREE, **(kw.get("scheduling") or {})}
    dep = ServicesDeployment(target, draft, stages, transport=transport, threads=1, **kw)
    dep.start()
    return dep


@pytest.fixture(scope="session")
def tcp_deployment(text_model_dir: Path) -> Iterator[ServicesDeployment]:
    """2 stages over TCP, the target itself as draft (long hit streaks, deep trees);
    `--device auto` (the CPU here)."""
    dep = start(text_model_dir, "oracle", 2, "tcp", device="auto")
    try:
        yield dep
    finally:
        dep.stop()


@pytest.fixture(scope="session")
def ucx_deployment(llama_dir: Path, unrelated_draft_dir: Path) -> Iterator[ServicesDeployment]:
    """3 stages over UCX, an unrelated random draft (mostly misses: restarts)."""
    pytest.importorskip("ucxx")
    dep = start(llama_dir, unrelated_draft_dir, 3, "ucx")
    try:
        yield dep
    finally:
        dep.stop()


@pytest.fixture
def fresh_deployment(llama_dir: Path) -> Iterator[ServicesDeployment]:
    """A private deployment a test may break (kill a stage)."""
    dep = start(llama_dir, "oracle", 2, "tcp")
    try:
        yield dep
    finally:
        dep.stop()


def reference_stats(
    target: Path, draft, stages: int, prompt: list[int], mode: str, max_new_tokens: int
) -> DecodeStats:
    """Stats of the in-process lockstep engine for a greedy request."""
    return reference_run(target, draft, stages, prompt, mode, max_new_tokens).stats


def reference_run(
    target: Path,
    draft,
    stages: int,
    prompt: list[int],
    mode: str,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    top_p: float = 1.0,
    top_k: int = 0,
    width: int = 8,
    stop_token_ids: tuple[int, ...] = (),
    prefill_chunk: int = 128,
) -> LockstepGeneration:
    """The same request through the in-process lockstep engine (tokens and stats)."""
    draft_dir = target if draft == "oracle" else draft
    dep = build_local(target, stages, draft_dir, parse_dtype(DTYPE))
    opts = DecodeOptions(
        max_new_tokens=max_new_tokens,
        sampling=SamplingParams(temperature, top_k, top_p, seed),
        width=width,
        stop_token_ids=stop_token_ids,
        prefill_chunk=prefill_chunk,
    )
    gen = LockstepGeneration(dep.pipeline, dep.draft, prompt, mode, opts)
    gen.run()
    return gen


def reference(target: Path, draft, stages: int, prompt: list[int], mode: str, *args, **kw):
    """Tokens of the in-process lockstep engine for the same request."""
    return reference_run(target, draft, stages, prompt, mode, *args, **kw).output


def service_stub(address: str, kind: str, security=None):
    """A Stage or Draft stub (for Describe) on a fresh channel; mutual TLS with
    `security` (a deployment's `ServicesDeployment.security`)."""
    from specpipe.v1 import draft_pb2_grpc, stage_pb2_grpc

    if security is None:
        ch = grpc.insecure_channel(address)
    else:
        creds, options = security.channel_credentials(), security.channel_options()
        ch = grpc.secure_channel(address, creds, options)
    stub = (stage_pb2_grpc.StageStub if kind == "stage" else draft_pb2_grpc.DraftStub)(ch)
    return ch, stub


def active_requests(dep: ServicesDeployment) -> dict[str, int]:
    """Requests each process of a deployment holds state for."""
    from specpipe.v1 import dataplane_pb2

    from specpipe.client import Client

    counts = {}
    key = dep.api_keys[0] if dep.api_keys else None
    with Client(dep.router_address, timeout=5, api_key=key) as c:
        counts["router"] = c.describe().active_requests
    for name, child in dep.children.items():
        if name == "router":
            continue
        ch, stub = service_stub(child.info["grpc"], child.kind, dep.security)
        with ch:
            counts[name] = stub.Describe(dataplane_pb2.DescribeRequest(), timeout=5).active_requests
    return counts


def wait_idle(dep: ServicesDeployment, timeout: float = 10.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        counts = active_requests(dep)
        if not any(counts.values()) or time.monotonic() > deadline:
            return counts
        time.sleep(0.1)
