"""`specpipe profile` and `specpipe plan`: the JSON contract, Helm values, one-line errors
with exit code 2."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import yaml
from specpipe.common.model.config import ModelConfig

from specpipe.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse errors
        code = int(e.code)
    out = capsys.readouterr()
    return code, out.out, out.err


def node(tmp_path: Path, name: str, **fields) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"name": name, **fields}))
    return path


@pytest.fixture
def fast_slow(tmp_path: Path) -> str:
    fast = node(
        tmp_path,
        "fast",
        seconds_per_layer=0.01,
        seconds_head=0.01,
        memory_gib=1,
        nodeSelector={"accelerator": "h100"},
        resources={"limits": {"nvidia.com/gpu": 1}},
    )
    slow = node(tmp_path, "slow", seconds_per_layer=0.025, seconds_head=0.025, memory_gib=1)
    return f"{fast}:2,{slow}:2"


def test_plan_json_contract(capsys, llama_dir, fast_slow, tmp_path) -> None:
    values = tmp_path / "values.yaml"
    code, out, err = run(
        capsys,
        "plan",
        "--target",
        str(llama_dir),
        "--nodes",
        fast_slow,
        "--json",
        "--helm-values",
        str(values),
    )
    assert code == 0, err
    plan = json.loads(out)
    n = ModelConfig.from_dir(llama_dir).num_layers
    stages = plan["stages"]
    assert {"stages", "step_seconds"} <= set(plan)
    assert all(set(s) == {"node", "layers", "step_seconds"} for s in stages)
    bounds = [tuple(int(x) for x in s["layers"].split(":")) for s in stages]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert plan["step_seconds"] == max(s["step_seconds"] for s in stages)
    assert stages[-1]["node"] == "fast"  # the head on a fast node
    for split in ("even", "balanced"):
        assert plan["baselines"][split]["step_seconds"] >= plan["step_seconds"]
    assert plan["tokens_per_second"] == pytest.approx(1 / plan["step_seconds"])
    pools = yaml.safe_load(values.read_text())["stagePools"]
    assert [p["layers"] for p in pools] == [s["layers"] for s in stages]
    for pool, stage in zip(pools, stages, strict=True):
        assert pool["replicas"] == 1
        if stage["node"] == "fast":
            assert set(pool) == {"name", "layers", "replicas", "nodeSelector", "resources"}
            assert pool["nodeSelector"] == {"accelerator": "h100"}
            assert pool["resources"] == {"limits": {"nvidia.com/gpu": 1}}
        else:  # nothing given: the pool keeps the chart's stage settings
            assert set(pool) == {"name", "layers", "replicas"}
    assert len({p["name"] for p in pools}) == len(pools)


def test_plan_writes_the_cost_file_specpipe_up_paces_its_stages_to(
    capsys, llama_dir, fast_slow, tmp_path
) -> None:
    """`plan --emulate-costs FILE` writes what `specpipe up --layers ... --emulate-costs
    FILE` takes: stage k's curve is its node kind's cost for its layers, and the printed
    `specpipe up` line is one the CLI accepts, with the plan's layers."""
    import shlex

    from specpipe.common.model.partition import LayerRange
    from specpipe.common.perf.emulate import EmulatedCosts
    from specpipe.common.perf.profile import NodeProfile

    from specpipe.cli import build_parser

    cost_file = tmp_path / "split.json"
    argv = ["plan", "--target", str(llama_dir), "--nodes", fast_slow]
    code, out, err = run(capsys, *argv, "--json", "--emulate-costs", str(cost_file))
    assert code == 0, err
    plan = json.loads(out)
    costs = EmulatedCosts.load(cost_file)
    costs.check_stages(len(plan["stages"]))
    n = ModelConfig.from_dir(llama_dir).num_layers
    profiles = {p.stem: NodeProfile.load(p) for p in tmp_path.glob("*.json") if p != cost_file}
    for k, st in enumerate(plan["stages"]):
        a, b = (int(x) for x in st["layers"].split(":"))
        want = profiles[st["node"]].stage_cost(LayerRange(a, b, n))
        for rows in (1, 8, 64):
            assert costs.stage(k)(rows, 128) == pytest.approx(want(rows, 128))
    # The text output names the `specpipe up` line that runs it.
    code, out, err = run(capsys, *argv, "--emulate-costs", str(cost_file))
    assert code == 0, err
    (line,) = [x.strip() for x in out.splitlines() if x.strip().startswith("specpipe up ")]
    up = build_parser().parse_args(shlex.split(line)[1:])
    assert up.layers == ",".join(s["layers"] for s in plan["stages"])
    assert up.emulate_costs == str(cost_file) and up.stages == len(plan["stages"])


def test_plan_text_compares_with_even_and_balanced(capsys, llama_dir, fast_slow) -> None:
    code, out, _ = run(capsys, "plan", "--target", str(llama_dir), "--nodes", fast_slow)
    assert code == 0
    assert "planned split" in out
    for split in ("planned", "even", "balanced"):
        assert any(line.startswith(split) for line in out.splitlines())


def test_plan_with_fixed_stages(capsys, llama_dir, fast_slow) -> None:
    code, out, _ = run(
        capsys, "plan", "--target", str(llama_dir), "--nodes", fast_slow, "--stages", "2", "--json"
    )
    assert code == 0 and len(json.loads(out)["stages"]) == 2


@pytest.mark.parametrize(
    ("nodes", "extra", "message"),
    [
        ("{tiny}:3", [], "no node can hold even one layer"),
        ("{tiny}:x", [], "NODE.json:COUNT"),
        ("{missing}:1", [], "No such file"),
        ("{bad}:1", [], "unknown field"),
        ("{fast}:1", ["--stages", "0"], "--stages"),
        ("{fast}:1", ["--stages", "3"], "between 1 and"),
        ("{fast}:1,{fast}:1", [], "distinct names"),
        ("{fast}:1", ["--tokens-per-step", "0"], "--tokens-per-step"),
    ],
)
def test_plan_errors_are_one_line_exit_2(capsys, llama_dir, tmp_path, nodes, extra, message):
    paths = {
        "tiny": node(tmp_path, "tiny", seconds_per_layer=0.1, seconds_head=0.1, memory_gib=1e-6),
        "fast": node(tmp_path, "fast", seconds_per_layer=0.1, seconds_head=0.1, memory_gib=1),
        "bad": node(tmp_path, "bad", seconds_per_layer=0.1, seconds_head=0.1, memory=1),
        "missing": tmp_path / "missing.json",
    }
    code, out, err = run(
        capsys, "plan", "--target", str(llama_dir), "--nodes", nodes.format(**paths), *extra
    )
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1, err


def test_profile_writes_a_profile_plan_reads(capsys, llama_dir, qwen_dir, tmp_path) -> None:
    out_file = tmp_path / "cpu.json"
    code, out, err = run(
        capsys,
        "profile",
        "--target",
        str(llama_dir),
        "--draft",
        str(llama_dir),
        "--device",
        "cpu",
        "--out",
        str(out_file),
        "--name",
        "cpu-node",
        "--rows",
        "1,4",
        "--contexts",
        "8",
        "--requests",
        "2",
        "--repeats",
        "1",
        "--memory-gib",
        "2",
        "--node-selector",
        "kind=cpu",
    )
    assert code == 0, err
    profile = json.loads(out_file.read_text())
    assert profile["name"] == "cpu-node" and profile["memory_gib"] == 2
    assert profile["nodeSelector"] == {"kind": "cpu"} and profile["draft"][0]["rows"] == [1, 4]
    assert profile["layer"][0]["context"] == 8 and profile["device"]["type"] == "cpu"
    code, out, err = run(
        capsys, "plan", "--target", str(llama_dir), "--nodes", f"{out_file}:2", "--json"
    )
    assert code == 0, err
    assert {s["node"] for s in json.loads(out)["stages"]} == {"cpu-node"}
    # A profile of another model's layers prices nothing of this one.
    code, out, err = run(capsys, "plan", "--target", str(qwen_dir), "--nodes", f"{out_file}:2")
    assert code == 2 and "measured with another model" in err


def test_profile_errors(capsys, llama_dir, tmp_path) -> None:
    base = ["profile", "--target", str(llama_dir), "--out", str(tmp_path / "x.json")]
    code, _, err = run(capsys, *base, "--node-selector", "nolabel")
    assert code == 2 and "KEY=VALUE" in err
    code, _, err = run(capsys, *base, "--device", "tpu")
    assert code == 2 and "--device" in err
    code, _, err = run(capsys, *base, "--rows", "a,b")
    assert code == 2 and "--rows" in err
    assert not (tmp_path / "x.json").exists()
