"""Function calling measured with the Berkeley Function Calling Leaderboard (issue 36
point 5): a subset of bfcl-eval's `simple_python` and `multiple` categories sent through
SpecPipe's OpenAI-compatible HTTP API by bfcl's own OpenAI Chat Completions FC handler
(`tools`, `tool_choice: "auto"`, greedy) in autoregressive and specpipe modes, scored by
bfcl's own AST checker; then, optionally, aiperf against the same deployment with its
server-metrics scrape of `<base_url>/metrics` on.

Runs in bfcl-eval's own virtualenv (never the project's); SpecPipe runs from this
checkout's `.venv`:

    /work/bfcl-venv/bin/python benchmarks/bench_bfcl.py --simple 15 --multiple 10 \
        --aiperf /work/aiperf-venv/bin/aiperf

Reports accuracy per category and mode, whether both modes gave the same answers, and
specpipe's tokens per step. Writes benchmarks/results/bfcl/<target>.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from bfcl_eval.constants.enums import Language, ReturnFormat
from bfcl_eval.constants.model_config import MODEL_CONFIG_MAPPING, ModelConfig
from bfcl_eval.eval_checker.eval_runner import _evaluate_single_ast_entry
from bfcl_eval.model_handler.api_inference.openai_completion import OpenAICompletionsHandler
from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from http_up import wait_until_serving

ROOT = Path(__file__).resolve().parent.parent
SPECPIPE = [str(ROOT / ".venv" / "bin" / "python"), "-m", "specpipe.cli"]
OUT = ROOT / "benchmarks" / "results" / "bfcl"
# bfcl's checker looks the model up by this key ("_" would read as "/" there).
REGISTRY = "specpipe-FC"
CATEGORIES = ("simple_python", "multiple")
MODES = ("autoregressive", "specpipe")
# what each answer's `speculation` object says that the report keeps
SPECULATION_FIELDS = (
    "decode_steps", "new_tokens", "tokens_per_step", "hit_rate", "token_source", "late_draft_answers"
)  # fmt: skip


class SpecPipeHandler(OpenAICompletionsHandler):
    """bfcl's Chat Completions FC handler with SpecPipe's per-request `mode`, an explicit
    `tool_choice: "auto"`, greedy decoding and a bound on the output; keeps each answer's
    `speculation` object (tokens per step) for the report."""

    mode = "autoregressive"
    max_tokens = 256
    last_speculation: dict | None = None

    def generate_with_backoff(self, **kwargs):
        kwargs.pop("store", None)  # OpenAI's storage flag: nothing to store here
        if "tools" in kwargs:
            kwargs["tool_choice"] = "auto"
        kwargs.update(temperature=0, max_tokens=self.max_tokens)
        kwargs["extra_body"] = {"mode": self.mode}
        response, latency = super().generate_with_backoff(**kwargs)
        self.last_speculation = (response.model_extra or {}).get("speculation")
        return response, latency


def register(target: str) -> None:
    """bfcl's model table entry for the served model (its checker reads
    `underscore_to_dot`: the handler sends `a.b` as `a_b`, as OpenAI's names must)."""
    MODEL_CONFIG_MAPPING[REGISTRY] = ModelConfig(
        model_name=target,
        display_name=f"{target} on SpecPipe (FC)",
        url="https://huggingface.co/Qwen/Qwen2.5-Coder-1.5B-Instruct",
        org="Qwen",
        license="apache-2.0",
        model_handler=SpecPipeHandler,
        input_price=None,
        output_price=None,
        is_fc_model=True,
        underscore_to_dot=True,
    )


def serve(args, log_dir: Path) -> subprocess.Popen:
    """`specpipe up` with the HTTP API and /metrics open; returns once /health answers."""
    cmd = [*SPECPIPE, "up", "--target", args.target, "--draft", args.draft]
    cmd += ["--stages", str(args.stages), "--http-port", str(args.port)]
    cmd += ["--http-metrics", "open", "--tool-call-parser", args.tool_call_parser]
    cmd += ["--width", str(args.width), "--layers-per-step", str(args.layers_per_step)]
    # the draft, not `auto`: auto measures each source on the first requests' tokens
    cmd += ["--token-source", args.token_source]
    cmd += ["--log-dir", str(log_dir)]
    log = open(log_dir / "up.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(["nice", "-n", "10", *cmd], stdout=log, stderr=subprocess.STDOUT)
    return wait_until_serving(proc, args.port, args.startup_timeout, log.name, poll=3)


def entries(category: str, count: int) -> list[tuple[dict, dict, dict]]:
    """The first `count` cases: (as generation sends it, as the checker reads it, truth)."""
    sent = load_dataset_entry(category)[:count]
    checked = load_dataset_entry(
        category, include_prereq=False, include_language_specific_hint=False
    )
    truth = {t["id"]: t for t in load_ground_truth_entry(category)}
    by_id = {e["id"]: e for e in checked}
    return [(e, by_id[e["id"]], truth[e["id"]]) for e in sent]


def run_case(handler: SpecPipeHandler, mode: str, category: str, case: tuple) -> dict:
    """One case through the server in `mode`, scored by bfcl's checker."""
    sent, checked, truth = case
    handler.mode = mode
    t0 = time.monotonic()
    result, meta = handler.inference(sent, include_input_log=False, exclude_state_log=True)
    score = _evaluate_single_ast_entry(
        handler,
        sent["id"],
        result,
        truth["ground_truth"],
        checked,
        REGISTRY,
        category,
        language=Language.PYTHON,
        return_format=ReturnFormat.PYTHON,
    )
    spec = handler.last_speculation or {}
    mark = "ok " if score["valid"] else "BAD"
    print(f"  {mode:14s} {sent['id']:18s} {mark} {json.dumps(result)[:110]}", flush=True)
    return {
        "id": sent["id"],
        "result": result,
        "valid": bool(score["valid"]),
        "error": score.get("error"),
        "output_tokens": meta["output_token_count"],
        "input_tokens": meta["input_token_count"],
        "wall_s": round(time.monotonic() - t0, 2),
        **{k: spec.get(k) for k in SPECULATION_FIELDS},
    }


def summary(rows: list[dict]) -> dict:
    steps = sum(r["decode_steps"] or 0 for r in rows)
    tokens = sum(r["new_tokens"] or 0 for r in rows)
    return {
        "cases": len(rows),
        "correct": sum(r["valid"] for r in rows),
        "accuracy": round(sum(r["valid"] for r in rows) / len(rows), 4) if rows else None,
        "output_tokens": sum(r["output_tokens"] for r in rows),
        "wall_s": round(sum(r["wall_s"] for r in rows), 1),
        # over the category: its tokens over its decode steps (the router's counts)
        "tokens_per_step": round(tokens / steps, 3) if steps else None,
        "hit_rate": round(
            sum((r["hit_rate"] or 0) * (r["new_tokens"] or 0) for r in rows) / tokens, 3
        )
        if tokens
        else None,
    }


def run_aiperf(args, art: Path) -> dict:
    """aiperf, a few streamed chat requests, with its server-metrics scrape on (its
    default: `<url>/metrics`, here SpecPipe's vLLM-named series)."""
    cmd = [args.aiperf, "profile", "--model", args.target, "--url", f"http://127.0.0.1:{args.port}"]
    cmd += ["--endpoint-type", "chat", "--streaming", "--concurrency", "1"]
    cmd += ["--request-count", str(args.aiperf_requests), "--synthetic-input-tokens-mean", "64"]
    cmd += ["--output-tokens-mean", str(args.aiperf_tokens)]
    cmd += ["--extra-inputs", f"max_tokens:{args.aiperf_tokens}"]
    cmd += ["--extra-inputs", f"min_tokens:{args.aiperf_tokens}"]
    cmd += ["--extra-inputs", "temperature:0", "--tokenizer", str(args.tokenizer)]
    cmd += ["--artifact-dir", str(art), "--ui", "none", "--workers-max", "1"]
    cmd += ["--request-rate", "100", "--arrival-pattern", "constant"]
    cmd += ["--request-timeout-seconds", "1800"]
    done = subprocess.run(["nice", "-n", "10", *cmd], capture_output=True, text=True)
    (art / "aiperf.stdout").write_text(done.stdout + "\n" + done.stderr)
    if done.returncode:
        raise RuntimeError(f"aiperf failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    files = sorted(str(p.relative_to(art)) for p in art.rglob("*") if p.is_file())
    rec = json.loads(next(art.rglob("profile_export_aiperf.json")).read_text())

    def avg(name: str) -> float | None:
        value = (rec.get(name) or {}).get("avg")
        return None if value is None else round(float(value), 3)

    scraped = sorted(art.rglob("server_metrics_export.json"))
    text = scraped[0].read_text() if scraped else ""
    return {
        "command": " ".join(cmd),
        "server_metrics_file": str(scraped[0]) if scraped else None,
        # the series aiperf's scrape of <url>/metrics found, by name
        "server_metrics_vllm": sorted(set(re.findall(r'"(vllm:[\w:]+)', text))),
        "server_metrics_specpipe": sorted(set(re.findall(r'"(specpipe:[\w:]+)', text))),
        "requests": avg("request_count"),
        "ttft_ms": avg("time_to_first_token"),
        "itl_ms": avg("inter_token_latency"),
        "output_tokens_per_s": avg("output_token_throughput"),
        "output_tokens": avg("output_sequence_length"),
        "errors": avg("error_request_count"),
        "artifacts": str(art),
        "files": files,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--width", default="4", help="tree width (specpipe mode)")
    ap.add_argument("--layers-per-step", default="1", help="K (specpipe mode)")
    ap.add_argument("--token-source", default="draft", help="specpipe mode's proposals")
    ap.add_argument(
        "--tool-call-parser",
        default="qwen2_5_coder",
        help="the server's (qwen2_5_coder: Qwen2.5-Coder's bare and fenced JSON calls)",
    )
    ap.add_argument("--simple", type=int, default=15, help="first N of simple_python")
    ap.add_argument("--multiple", type=int, default=10, help="first N of multiple")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=18736)
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--aiperf", help="aiperf executable (its own venv); none: no aiperf run")
    ap.add_argument("--aiperf-requests", type=int, default=4)
    ap.add_argument("--aiperf-tokens", type=int, default=16)
    ap.add_argument("--out", default=None, help="result file (default: results/bfcl/<target>.json)")
    args = ap.parse_args()
    args.tokenizer = Path.home() / ".cache" / "specpipe" / "models" / args.target

    register(args.target)
    # The handler's client reads these (bfcl's way to aim it at any OpenAI-compatible server).
    os.environ["OPENAI_BASE_URL"] = f"http://127.0.0.1:{args.port}/v1"
    os.environ["OPENAI_API_KEY"] = "none"
    cfg = MODEL_CONFIG_MAPPING[REGISTRY]
    handler = SpecPipeHandler(
        model_name=cfg.model_name, temperature=0, registry_name=REGISTRY, is_fc_model=True
    )
    handler.client = handler.client.with_options(timeout=1800, max_retries=0)
    handler.max_tokens = args.max_tokens
    cases = {"simple_python": entries("simple_python", args.simple)}
    cases["multiple"] = entries("multiple", args.multiple)

    path = Path(args.out) if args.out else OUT / f"{args.target}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bfcl-up-"))
    result = {
        "target": args.target,
        "draft": args.draft,
        "stages": args.stages,
        "width": args.width,
        "layers_per_step": args.layers_per_step,
        "tool_call_parser": args.tool_call_parser,
        "token_source": args.token_source,
        "bfcl_eval": version("bfcl-eval"),
        "request": "bfcl OpenAICompletionsHandler (FC): tools, tool_choice auto, temperature 0, "
        f"max_tokens {args.max_tokens}, extra body mode",
        "order": "each case in every mode in turn (the later modes find its prompt cached)",
        "server_log_dir": str(log_dir),
    }
    runs: dict[str, dict[str, list]] = {m: {c: [] for c in cases} for m in MODES}
    proc = serve(args, log_dir)
    try:
        if (
            args.aiperf
        ):  # first: a few short requests, so the record has it however long the rest takes
            try:
                result["aiperf"] = run_aiperf(args, Path(tempfile.mkdtemp(prefix="bfcl-aiperf-")))
            except (RuntimeError, StopIteration) as e:
                result["aiperf"] = {"error": str(e)[-2000:]}
            print("aiperf:", json.dumps(result["aiperf"])[:1500], flush=True)
        # categories in turn, case by case: a run cut short has some of each
        for turn in itertools.zip_longest(*([(c, x) for x in xs] for c, xs in cases.items())):
            for category, case in filter(None, turn):
                for mode in MODES:
                    runs[mode][category].append(run_case(handler, mode, category, case))
                report(result, runs, path)
    finally:
        proc.terminate()
        proc.wait(120)
    print("\n| category | mode | correct | accuracy | output tokens | tokens/step | wall s |")
    print("|---|---|---|---|---|---|---|")
    for m in MODES:
        for c in cases:
            s = result["summary"][m][c]
            print(
                f"| {c} | {m} | {s['correct']}/{s['cases']} | {s['accuracy']} | "
                f"{s['output_tokens']} | {s['tokens_per_step']} | {s['wall_s']} |"
            )
    print(f"answers differing between modes: {result['answers_differing_between_modes']}")
    print(f"wrote {path}")


def report(result: dict, runs: dict[str, dict[str, list]], path: Path) -> None:
    """The result so far, written after every case (a long run keeps what it measured)."""
    first, *others = (runs[m] for m in MODES)
    result["summary"] = {m: {c: summary(rows) for c, rows in runs[m].items()} for m in MODES}
    result["answers_differing_between_modes"] = {
        c: [
            r["id"]
            for i, r in enumerate(rows)
            if any(i < len(o[c]) and o[c][i]["result"] != r["result"] for o in others)
        ]
        for c, rows in first.items()
    }
    result["cases"] = runs
    path.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
