"""This machine's kernel checks kept between processes (`common/model/kernel_checks.py`):
a stage start reads the batch-invariance check of a shape it has seen instead of running
it again, and a record for another machine, torch or shape answers nothing."""

from __future__ import annotations

import json

import pytest
import torch
from specpipe.common.model import batch_invariant, kernel_checks
from specpipe.common.model.batch_invariant import RowInvariantLinear
from specpipe.common.model.loading import load_stage

BF16 = torch.bfloat16


@pytest.fixture
def record_file(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "kernel-checks.json"
    monkeypatch.setenv(kernel_checks.KERNEL_CHECKS_ENV, str(path))
    return path


def test_an_answer_is_kept_for_this_machine_only(record_file, monkeypatch) -> None:
    assert kernel_checks.recorded("shape a") is None
    kernel_checks.record("shape a", True)
    kernel_checks.record("shape b", False)
    assert kernel_checks.recorded("shape a") is True
    assert kernel_checks.recorded("shape b") is False
    assert kernel_checks.recorded("shape c") is None
    assert not list(record_file.parent.glob(".kernel-checks-*"))  # no temporary left
    monkeypatch.setattr(kernel_checks, "machine_key", lambda: "torch 0.0|OTHER|cpu")
    assert kernel_checks.recorded("shape a") is None


def test_a_damaged_record_reads_as_empty_and_is_rewritten(record_file) -> None:
    record_file.parent.mkdir(parents=True)
    for text in ("{not json", "[1, 2]", json.dumps({"x": "yes"})):
        record_file.write_text(text)
        assert kernel_checks.recorded("x") is None
    kernel_checks.record("shape a", True)
    assert kernel_checks.recorded("shape a") is True


def test_an_empty_setting_keeps_nothing_on_disk(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(kernel_checks.KERNEL_CHECKS_ENV, "")
    assert kernel_checks.record_path() is None
    kernel_checks.record("shape a", True)
    assert kernel_checks.recorded("shape a") is None


def test_an_unwritable_record_is_skipped(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(kernel_checks.KERNEL_CHECKS_ENV, str(blocker / "kernel-checks.json"))
    kernel_checks.record("shape a", True)  # its folder cannot be made: nothing raised
    assert kernel_checks.recorded("shape a") is None


def test_a_later_process_reads_the_check_instead_of_running_it(
    llama_dir, record_file, monkeypatch, caplog
) -> None:
    """The first load checks each linear shape and records it; a new process (the
    in-process memo emptied) loads without checking, and follows the record, a recorded
    failure included."""
    ran: list[tuple[int, int]] = []
    real = batch_invariant.linear_rows_invariant

    def counted(layer, rows=0) -> bool:
        ran.append((layer.in_features, layer.out_features))
        return real(layer, rows)

    monkeypatch.setattr(batch_invariant, "linear_rows_invariant", counted)
    monkeypatch.setattr(batch_invariant, "_kernels_checked", {})
    first = load_stage(llama_dir, dtype=BF16)
    assert ran and len(ran) == len(set(ran))
    recorded = json.loads(record_file.read_text())
    assert len(recorded) == len(ran)
    answers = set(recorded.values())

    ran.clear()
    monkeypatch.setattr(batch_invariant, "_kernels_checked", {})
    again = load_stage(llama_dir, dtype=BF16)
    assert ran == []
    assert bool(again.rows_alone) == bool(first.rows_alone) == (answers == {True})

    record_file.write_text(json.dumps({k: False for k in recorded}))
    monkeypatch.setattr(batch_invariant, "_kernels_checked", {})
    batched = load_stage(llama_dir, dtype=BF16)
    assert ran == [] and not batched.rows_alone
    assert RowInvariantLinear not in {type(x) for x in batched.modules()}
    assert "stay batched" in caplog.text


def test_the_math_libraries_settings_are_part_of_the_machine(monkeypatch) -> None:
    """An answer found under one oneDNN/OpenMP setting says nothing under another."""
    kernel_checks.machine_key.cache_clear()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    plain = kernel_checks.machine_key()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    kernel_checks.machine_key.cache_clear()
    try:
        assert kernel_checks.machine_key() != plain
    finally:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
        kernel_checks.machine_key.cache_clear()
    assert kernel_checks.machine_key() == plain


def test_a_check_recorded_at_one_thread_count_is_run_again_at_another(
    llama_dir, record_file, monkeypatch
) -> None:
    ran: list[int] = []
    real = batch_invariant.linear_rows_invariant

    def counted(layer, rows=0) -> bool:
        ran.append(torch.get_num_threads())
        return real(layer, rows)

    monkeypatch.setattr(batch_invariant, "linear_rows_invariant", counted)
    monkeypatch.setattr(batch_invariant, "_kernels_checked", {})
    threads = torch.get_num_threads()
    load_stage(llama_dir, dtype=BF16)
    first = len(ran)
    assert first and set(ran) == {threads}
    torch.set_num_threads(threads + 1)
    try:
        load_stage(llama_dir, dtype=BF16)
    finally:
        torch.set_num_threads(threads)
    assert len(ran) == 2 * first and set(ran[first:]) == {threads + 1}
    assert len(json.loads(record_file.read_text())) == 2 * first
