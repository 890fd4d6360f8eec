"""`specpipe selfcheck --device cpu` (what `scripts/gpu_check.sh --device cpu` runs): the
device check's parts run on the CPU in CI, so the script cannot rot before a GPU runs it."""

from __future__ import annotations

import json

import pytest

from specpipe.cli import main


def test_selfcheck_on_the_cpu_passes_every_part(tmp_path, capsys) -> None:
    # "tests" runs test files this suite runs anyway; the other parts run here.
    out = tmp_path / "check.json"
    parts = "environment,generation,services,timings"
    code = main(["selfcheck", "--device", "cpu", "--parts", parts, "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    assert report["verdict"] == "PASS"
    assert [p["name"] for p in report["parts"]] == parts.split(",")
    assert all(p["status"] == "PASS" for p in report["parts"]), printed
    timings = next(p for p in report["parts"] if p["name"] == "timings")["data"]
    assert set(timings) == {"1x1", "1x64", "8x8", "64x1"}
    assert all(t["device_ms"] > 0 and t["kernels"] > 0 for t in timings.values())
    assert "selfcheck on cpu: PASS" in printed
    services = next(p for p in report["parts"] if p["name"] == "services")["data"]
    assert services["devices"] == {"stage0": "cpu", "stage1": "cpu", "draft": "cpu"}
    assert "  stage1: cpu" in printed and "data plane tcp: host memory" in printed


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
