"""`specpipe up --split-cores-while-drafting` on one host with a draft
(services/cpu_threads.py): the stage's forwards run on its share of the cores while the
draft holds requests and on every core while
it holds none, the flag coming from the draft process itself; the tokens stay those of
plain decoding."""

from __future__ import annotations

import os
import time
from pathlib import Path

from specpipe.services.client.sync import Client
from specpipe.services.launcher import ServicesDeployment

from .conftest import DTYPE, PINNED_TREE


def test_the_stage_runs_fewer_threads_while_a_request_uses_the_draft(
    llama_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    # a 2-core host whose models count as large (the tiny ones would run one thread)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr("specpipe.services.launcher.small_model", lambda *a: False)
    dep = ServicesDeployment(
        llama_dir, "oracle", 1, transport="tcp", secure=False, dtype=DTYPE,
        log_dir=tmp_path / "logs", scheduling=PINNED_TREE, split_cores_while_drafting=True,
    )  # fmt: skip
    assert (dep.threads, dep.draft_threads, dep.threads_with_draft) == (2, 1, 1)
    dep.start()
    try:
        run = dict(prompt_ids=[1, 2, 3, 4], max_new_tokens=12, ignore_eos=True)
        with Client(dep.router_address, timeout=60) as client:
            plain = client.generate(**run, mode="pp").token_ids
            drafted = client.generate(**run).token_ids  # the pinned tree: the draft's
            deadline = time.monotonic() + 10  # the draft's flag follows its release
            while not _said(dep, "1 -> 2") and time.monotonic() < deadline:
                again = client.generate(**run, mode="pp").token_ids
                assert again == plain
        assert drafted == plain
        for change in ("0 -> 2 (the draft idles", "2 -> 1 (the draft works", "1 -> 2"):
            assert _said(dep, change), change
    finally:
        dep.stop()


def _said(dep: ServicesDeployment, text: str) -> bool:
    return text in dep.children["stage0"].log_file.read_text()
