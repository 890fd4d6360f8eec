"""`specpipe profile` and `specpipe plan`: measure a node kind, and plan which node kind
hosts which layers (docs/planning.md). One module: the two commands share the node
profiles' loading and the plan's printing, and `plan` writes what `profile` reads."""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path
from typing import Any

from .args import DTYPE_CHOICES, CliError, add_device_arg, parse_device, positive_int

DEFAULT_PLAN_CONTEXT = 2048  # tokens per request a plan provisions KV cache for


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `profile` and `plan` commands to the top-level subparsers."""
    from specpipe.common.perf.profile import PROFILE_CONTEXTS, PROFILE_REQUESTS

    p = sub.add_parser(
        "profile",
        help="measure this node: seconds per layer, head and draft; memory (a node profile)",
        description="Measure this node on the target's layers (loaded a few at a time) and "
        "write its node profile (JSON, docs/planning.md) for `specpipe plan`.",
    )
    p.add_argument("--target", required=True, help="target model: name, HF directory or GGUF")
    p.add_argument("--draft", default=None, help="also time the draft model's forward")
    add_device_arg(p)
    p.add_argument("--out", required=True, metavar="NODE.json", help="where to write it")
    p.add_argument("--name", default=None, help="the node kind's name (default: the device's)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPE_CHOICES), help="weights' dtype")
    p.add_argument("--rows", type=_ints, default=None, help="row counts (default 1,2,4,...,256)")
    p.add_argument(
        "--contexts",
        type=_ints,
        default=list(PROFILE_CONTEXTS),
        help="cached rows each row count is timed at (default "
        + ",".join(map(str, PROFILE_CONTEXTS))
        + ")",
    )
    p.add_argument(
        "--requests",
        type=positive_int,
        default=PROFILE_REQUESTS,
        help="a forward's rows are spread over up to this many requests (default %(default)s)",
    )
    p.add_argument("--repeats", type=positive_int, default=3, help="timed runs per point")
    p.add_argument(
        "--memory-gib",
        type=float,
        default=None,
        help="memory the node offers for weights and KV cache (default: what is free now)",
    )
    p.add_argument(
        "--node-selector",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Kubernetes node labels of this kind (copied into `plan --helm-values`)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser(
        "plan",
        help="choose stages, node kinds and layer ranges for heterogeneous nodes",
        description="Choose the number of stages, the node kind of each and their layer "
        "ranges, minimizing the slowest stage's step time within every node's memory.",
    )
    p.add_argument("--target", required=True, help="target model (only its config is read)")
    p.add_argument(
        "--nodes",
        required=True,
        metavar="NODE.json:COUNT,...",
        help="node profiles and how many nodes of each kind there are",
    )
    p.add_argument(
        "--stages", default="auto", help="number of stages, or auto (default: the fastest)"
    )
    p.add_argument(
        "--concurrency", type=positive_int, default=1, help="requests served at once (KV cache)"
    )
    p.add_argument(
        "--context",
        type=positive_int,
        default=DEFAULT_PLAN_CONTEXT,
        help="tokens per request (KV cache; stage costs are taken at this context)",
    )
    p.add_argument(
        "--rows",
        type=positive_int,
        default=None,
        help="rows a stage computes per step (default: concurrency x the default tree width; "
        "pp: the concurrency)",
    )
    p.add_argument(
        "--tokens-per-step",
        type=float,
        default=1.0,
        help="tokens each request gains per step, for tokens/s (default 1: specpipe at a "
        "perfect hit rate; pp: 1/stages)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=list(DTYPE_CHOICES),
        help="weights' dtype (default: the profiles', else float32)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--helm-values",
        default=None,
        metavar="FILE",
        help="write the stages as Helm values (stagePools: name, layers, replicas, and the "
        "node kind's nodeSelector, resources and gpu)",
    )
    p.add_argument(
        "--emulate-costs",
        default=None,
        metavar="FILE",
        help="write the cost file that paces each stage of the plan as its node kind "
        "(`specpipe up --layers ... --emulate-costs FILE`: the cluster emulated on one "
        "machine; the draft is left unpaced)",
    )
    p.set_defaults(func=_cmd_plan)


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,4, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected integers >= 0, got {text!r}")
    return sorted(set(values))


# -- profile ---------------------------------------------------------------------------------
def _cmd_profile(args: argparse.Namespace) -> int:
    import torch

    from specpipe.common.perf.cost_model import BUDGET_ROWS
    from specpipe.common.perf.planner import GIB
    from specpipe.common.perf.profile import (
        MeasureSettings,
        ProfileError,
        device_facts,
        measure_profile,
    )
    from specpipe.common.runtime.loader import parse_dtype
    from specpipe.common.store.resolver import resolve_model
    from specpipe.services.modelinfo import free_memory_bytes

    device = parse_device(args.device)
    selector = {}
    for item in args.node_selector:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise CliError(f"--node-selector must look like KEY=VALUE, got {item!r}")
        selector[key] = value
    rows = args.rows or list(BUDGET_ROWS)
    if rows[0] < 1:
        raise CliError("--rows must be >= 1")
    if args.memory_gib is not None and not args.memory_gib > 0:
        raise CliError("--memory-gib must be positive")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    # What the node offers, taken before anything of the model is loaded.
    memory = (
        round(args.memory_gib * GIB) if args.memory_gib is not None else free_memory_bytes(device)
    )
    target = resolve_model(args.target)
    draft = resolve_model(args.draft) if args.draft else None
    name = args.name or _slug(device_facts(device)["name"] or device) or "node"
    settings = MeasureSettings(tuple(rows), tuple(args.contexts), args.requests, args.repeats)
    try:
        profile = measure_profile(
            name,
            target,
            device,
            parse_dtype(args.dtype),
            memory,
            settings,
            draft,
            log=lambda m: print(f"profile: {m}", file=sys.stderr, flush=True),
        )
    except ProfileError as e:
        raise CliError(str(e)) from None
    if selector:
        profile = _with(profile, node_selector=selector)
    profile.save(args.out)
    at = profile.at(1, settings.contexts[0])
    print(
        f"{args.out}: {name}: {1e3 * at.layer:.3f} ms per layer, {1e3 * at.head:.3f} ms head "
        f"(1 row, context {settings.contexts[0]}), {profile.memory_gib:.2f} GiB free"
    )
    return 0


def _with(profile, **changes):
    from dataclasses import replace

    return replace(profile, **changes)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


# -- plan ------------------------------------------------------------------------------------
def _parse_nodes(text: str) -> list[tuple[Path, int]]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        path, colon, count = part.rpartition(":")
        if not colon or not path:
            path, count = part, "1"
        if not count.isdigit() or int(count) < 1:
            raise CliError(f"--nodes: expected NODE.json:COUNT with COUNT >= 1, got {part!r}")
        out.append((Path(path), int(count)))
    if not out:
        raise CliError("--nodes: give at least one NODE.json:COUNT")
    return out


def _cmd_plan(args: argparse.Namespace) -> int:
    from specpipe.common.model.config import ModelConfig
    from specpipe.common.perf.planner import PlanError
    from specpipe.common.perf.profile import NodeProfile, ProfileError
    from specpipe.common.store.resolver import resolve_model

    stages = None
    if args.stages != "auto":
        if not args.stages.isdigit() or int(args.stages) < 1:
            raise CliError(f"--stages must be a positive integer or auto, got {args.stages!r}")
        stages = int(args.stages)
    if not 0 < args.tokens_per_step < float("inf"):
        raise CliError(f"--tokens-per-step must be positive, got {args.tokens_per_step}")
    nodes = _parse_nodes(args.nodes)
    try:
        profiles = [(NodeProfile.load(path), count) for path, count in nodes]
    except ProfileError as e:
        raise CliError(str(e)) from None
    cfg = ModelConfig.from_dir(resolve_model(args.target))
    try:
        for profile, _ in profiles:
            profile.check_model(cfg)
        report = plan_report(args, cfg, profiles, stages)
    except (PlanError, ProfileError) as e:
        raise CliError(str(e)) from None
    by_name = dict(profiles_by_name(profiles))
    if args.helm_values:
        path = Path(args.helm_values)
        path.write_text(helm_values(report["plan"], by_name))
    text = report["text"]
    if args.emulate_costs:
        from specpipe.common.perf.profile import emulated_costs

        plan = report["plan"]
        emulated_costs([(by_name[st.node], st.layers) for st in plan.stages]).save(
            args.emulate_costs
        )
        text += [
            "",
            f"{args.emulate_costs}: the plan's per-stage costs; emulate it on one machine with",
            "  " + up_command(args.target, plan, args.emulate_costs),
        ]
    if args.json:
        print(json.dumps(report["json"]))
    else:
        print("\n".join(text))
    return 0


def up_command(target: str, plan, cost_file: str) -> str:
    """The `specpipe up` line that runs `plan` on this machine, each stage paced by its
    node kind's costs (the cost file's stage k is stage k of the plan)."""
    import shlex

    layers = ",".join(st.layers_text for st in plan.stages)
    argv = ["specpipe", "up", "--target", target, "--stages", str(len(plan.stages))]
    argv += ["--layers", layers, "--emulate-costs", cost_file]
    return shlex.join(argv)


def profiles_by_name(profiles) -> list[tuple[str, Any]]:
    return [(p.name, p) for p, _ in profiles]


def plan_dtype(args: argparse.Namespace, profiles) -> str:
    if args.dtype:
        return args.dtype
    measured = {p.dtype for p, _ in profiles if p.dtype}
    if len(measured) > 1:
        raise CliError(f"the profiles were measured with dtypes {sorted(measured)}: give --dtype")
    return measured.pop() if measured else "float32"


def plan_report(args: argparse.Namespace, cfg, profiles, stages: int | None) -> dict[str, Any]:
    """The plan, its baselines (even and parameter-balanced splits on the same nodes, the
    best node kind for each of their stages) as text and as JSON."""
    from specpipe.common.model.partition import plan_stages
    from specpipe.common.perf.planner import (
        GIB,
        ModelSizes,
        NodeKind,
        PlanError,
        assign_kinds,
        plan_split,
        smallest_stage_bytes,
    )
    from specpipe.common.runtime.loader import parse_dtype
    from specpipe.common.spec.options import DEFAULT_WIDTH

    names = [p.name for p, _ in profiles]
    if len(set(names)) != len(names):
        raise CliError(f"node profiles need distinct names, got {names}")
    dtype = plan_dtype(args, profiles)
    sizes = ModelSizes.from_config(cfg, parse_dtype(dtype).itemsize)
    rows = args.rows or args.concurrency * DEFAULT_WIDTH
    kv_tokens = args.concurrency * args.context
    kinds = [NodeKind(p.name, n, p.at(rows, args.context)) for p, n in profiles]
    plan = plan_split(sizes, kinds, kv_tokens, stages)
    s = len(plan.stages)

    def tokens_per_second(step: float) -> float:
        return args.concurrency * args.tokens_per_step / step if step > 0 else float("inf")

    baselines: dict[str, Any] = {}
    for split in ("even", "balanced"):
        try:
            baselines[split] = assign_kinds(sizes, kinds, kv_tokens, plan_stages(cfg, s, split))
        except PlanError as e:
            baselines[split] = str(e)

    def entry(p) -> dict[str, Any]:
        if isinstance(p, str):
            return {"error": p}
        return {**p.to_dict(), "tokens_per_second": tokens_per_second(p.step_seconds)}

    out_json = {
        **plan.to_dict(),
        "tokens_per_second": tokens_per_second(plan.step_seconds),
        "baselines": {k: entry(v) for k, v in baselines.items()},
        "regime": {
            "rows": rows,
            "context": args.context,
            "concurrency": args.concurrency,
            "tokens_per_step": args.tokens_per_step,
            "dtype": dtype,
        },
    }
    memory = {p.name: p.memory_bytes for p, _ in profiles}
    text = [
        f"target {cfg.model_type}, {cfg.num_layers} layers, {dtype}; {rows} rows per step at "
        f"context {args.context}; KV cache for {args.concurrency} request(s) of "
        f"{args.context} tokens",
        "nodes: " + ", ".join(f"{p.name} x{n} ({p.memory_gib:.3g} GiB)" for p, n in profiles),
    ]
    one = smallest_stage_bytes(sizes, kv_tokens)
    for p, _ in profiles:
        if p.memory_bytes < one:
            text.append(
                f"note: {p.name} cannot hold even one layer ({one / GIB:.3g} GiB with its KV "
                f"cache; it offers {p.memory_gib:.3g} GiB): not used"
            )
    stage_rows = [("stage", "node", "layers", "step ms", "memory GiB")]
    for k, st in enumerate(plan.stages):
        stage_rows.append(
            (
                str(k),
                st.node,
                st.layers_text,
                f"{1e3 * st.step_seconds:.2f}",
                f"{st.memory_bytes / GIB:.3g} of {memory[st.node] / GIB:.3g}",
            )
        )
    text += ["", f"planned split, {s} stages:", *_table(stage_rows, indent="  ")]
    split_rows = [("split", "stages", "step ms", "tokens/s", "x planned", "nodes:layers")]
    failed = []
    for name, p in [("planned", plan), *baselines.items()]:
        if isinstance(p, str):
            failed.append(f"{name}: does not fit: {p}")
            continue
        ratio = p.step_seconds / plan.step_seconds if plan.step_seconds > 0 else 1.0
        split_rows.append(
            (
                name,
                str(len(p.stages)),
                f"{1e3 * p.step_seconds:.2f}",
                f"{tokens_per_second(p.step_seconds):.2f}",
                f"{ratio:.2f}",
                " ".join(f"{st.node}:{st.layers_text}" for st in p.stages),
            )
        )
    text += ["", *_table(split_rows), *failed]
    text.append(
        f"tokens/s: {args.concurrency} request(s) x {args.tokens_per_step:g} token(s) per step "
        "/ the slowest stage's step time"
    )
    return {"plan": plan, "json": out_json, "text": text}


def _table(rows: list[tuple[str, ...]], indent: str = "") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in rows
    ]


def helm_values(plan, profiles: dict[str, Any]) -> str:
    """The plan as a Helm values snippet: one stage pool per stage (docs/planning.md), in
    the chart's `stagePools` shape (helm/specpipe/values.yaml). A node kind's scheduling
    is written only where its profile gives it, so a pool without it keeps the chart's
    stage settings; `gpu` from the device a measured profile was taken on."""
    import yaml

    pools = []
    for k, st in enumerate(plan.stages):
        profile = profiles[st.node]
        pool: dict[str, Any] = {
            "name": f"stage-{k}-{_slug(st.node)[:24]}".rstrip("-"),
            "layers": st.layers_text,
            "replicas": 1,
        }
        if profile.node_selector:
            pool["nodeSelector"] = dict(profile.node_selector)
        if profile.resources:
            pool["resources"] = dict(profile.resources)
        device = (profile.extra.get("device") or {}).get("type")
        if device in ("cuda", "cpu"):
            pool["gpu"] = device == "cuda"
        pools.append(pool)
    header = (
        f"# specpipe plan: {len(pools)} stages, step {1e3 * plan.step_seconds:.2f} ms "
        "(docs/planning.md)\n"
    )
    return header + yaml.dump({"stagePools": pools}, Dumper=_quoting_dumper(), sort_keys=False)


@functools.cache
def _quoting_dumper() -> type:
    """A safe YAML dumper that quotes every string holding a colon: "12:24" is a base-60
    integer to YAML 1.1 readers."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
        style = '"' if ":" in data else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    Dumper.add_representer(str, represent_str)
    return Dumper
