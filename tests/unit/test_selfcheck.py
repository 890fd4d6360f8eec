"""`specpipe selfcheck --device cpu` and `scripts/gpu_check.sh --device cpu`: the device
check's parts run on the CPU in CI with tiny shapes, so the script cannot rot before a
GPU runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specpipe.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_selfcheck_on_the_cpu_passes_timings_and_services(tmp_path, capsys) -> None:
    out = tmp_path / "check.json"
    parts = "environment,timings,services"
    code = main(["selfcheck", "--device", "cpu", "--parts", parts, "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    assert report["verdict"] == "PASS"
    assert [p["name"] for p in report["parts"]] == parts.split(",")
    assert all(p["status"] == "PASS" for p in report["parts"]), printed
    data = {p["name"]: p["data"] for p in report["parts"]}
    assert any(p.startswith("torch==") for p in data["environment"]["packages"])
    timings = data["timings"]
    assert timings["copy_gb_per_s"] > 0
    for model in ("stage0", "stage1", "draft"):
        steps = {k: v for k, v in timings[model].items() if "x" in k and k != "x_floor"}
        assert set(steps) == {"1x1", "8x8", "64x1"}, timings[model]
        assert timings[model]["floor_ms"] > 0
        for t in steps.values():
            assert t["busy_ms"] > 0 and t["kernels"] > 0 and t["x_floor"] > 0
            assert t["attention"] != ["none seen"], t  # SDPA's CPU operation is named
    served = data["services"]
    assert served["tokens"] > 0 and served["per_token_ms_median"] > 0
    assert served["tokens_per_step"] > 0
    assert "the served tokens equal the in-process engine's" in printed
    assert "  stage1: cpu" in printed and "data plane tcp: host memory" in printed
    assert "selfcheck on cpu: PASS" in printed


def gpu_check(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "GPU_CHECK_OUT": str(tmp_path), "PYTHON": sys.executable}
    env.pop("OUT", None)
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--device", "cpu", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert (tmp_path / "gpu_check.log").exists()
    return proc, report


def test_the_gpu_check_script_runs_its_parts_apart_on_the_cpu(tmp_path) -> None:
    """Each part in a process of its own (the reference is transformers' forward)."""
    proc, report = gpu_check(tmp_path, "--parts", "environment,reference")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [p["status"] for p in report["parts"]] == ["PASS", "PASS"], proc.stdout
    reference = report["parts"][1]["data"]
    assert set(reference) >= {"model", "1x1", "8x8", "64x1"}
    assert "selfcheck on cpu: PASS" in proc.stdout and "results in" in proc.stdout


@pytest.mark.slow
def test_the_whole_gpu_check_dry_run_on_the_cpu(tmp_path) -> None:
    """Every part, as a GPU machine runs them (minutes here: the device tests included)."""
    proc, report = gpu_check(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [p["name"] for p in report["parts"]] == [
        "environment", "timings", "reference", "generation", "services", "tests",
    ]  # fmt: skip
    assert all(p["status"] == "PASS" for p in report["parts"]), proc.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--parts", "environment,warp"], "--parts: unknown warp"),
        (["--device", "tpu"], "--device: unknown device"),
    ],
)
def test_selfcheck_bad_arguments_are_one_line_and_exit_2(argv, message, capsys) -> None:
    code = main(["selfcheck", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_a_failing_part_fails_the_check(monkeypatch, capsys) -> None:
    from specpipe.cli import selfcheck

    monkeypatch.setattr(selfcheck, "attention_kernels", lambda device: {"math": False})
    assert main(["selfcheck", "--device", "cpu", "--parts", "environment"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] environment" in out and "selfcheck on cpu: FAIL" in out


def test_a_part_past_its_time_limit_fails_alone(tmp_path, capsys) -> None:
    code = main(["selfcheck", "--device", "cpu", "--parts", "environment,timings",
                 "--part-timeout", "0.5", "--json", str(tmp_path / "r.json")])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1 and "ran past its 0.5 s limit" in out, out
    report = json.loads((tmp_path / "r.json").read_text())
    assert [p["status"] for p in report["parts"]] == ["FAIL", "FAIL"]
