"""Shared fixtures: tiny random models made in the test session (no downloads)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
from specpipe.common.model.kernel_checks import KERNEL_CHECKS_ENV
from specpipe.common.model.synthetic import save_random_model
from specpipe.common.spec.sampling import SamplingParams
from specpipe.common.spec.verify import VerifySpec
from specpipe.services.control import verify_spec_to_proto
from specpipe.v1 import dataplane_pb2

# Kernel checks are run, never read from or written to the user's record: every test
# sees this machine's kernels as a fresh install does (`test_kernel_checks` sets its own).
os.environ[KERNEL_CHECKS_ENV] = ""

# Tiny models gain nothing from intra-op threads, and on a 2-core machine shared with
# service processes the threads only contend.
torch.set_num_threads(1)


# Tests call it by this name.
make_tiny_model = save_random_model


@pytest.fixture(autouse=True, scope="module")
def _release_http_apis():
    """FastAPI keeps the endpoints it has classified in caches of 4096 entries
    (`fastapi.dependencies.models`); a router's endpoints are its `HttpApi`'s bound
    methods, so every router a test made would live, gRPC servers and channels
    included, until the interpreter tears its modules down, where gRPC's deallocators
    fail to report ("Error in sys.excepthook" at the suite's end). A server holds one
    `HttpApi` for its life; a test module's routers are let go when the module ends."""
    yield
    from fastapi.dependencies import models

    for name in dir(models):
        cache_clear = getattr(getattr(models, name), "cache_clear", None)
        if name.endswith("_cached") and cache_clear is not None:
            cache_clear()
    gc.collect()


def greedy_verify(output_start: int = 1) -> dataplane_pb2.VerifySpec:
    """The `verify` of a stage Open for a greedy request (the last stage verifies every
    request and refuses an Open without one)."""
    return verify_spec_to_proto(VerifySpec(SamplingParams(), output_start=output_start))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", layers=5, seed=0)


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("qwen2"),
        "qwen2",
        layers=3,
        hidden=40,
        heads=5,
        kv_heads=1,
        tied=True,
        seed=1,
    )


@pytest.fixture(scope="session")
def unrelated_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random model sharing only the vocabulary: its guesses are mostly wrong."""
    return make_tiny_model(
        tmp_path_factory.mktemp("draft"), "llama", layers=2, hidden=32, heads=4, kv_heads=2, seed=7
    )
