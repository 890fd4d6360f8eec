"""The load generator's datasets and summary, without a router."""

from __future__ import annotations

import json

import pytest
from specpipe.services.client.loadgen import Result, load_dataset, percentiles, summarize


def test_percentiles_interpolate() -> None:
    assert percentiles([1.0, 2.0, 3.0, 4.0, 5.0]) == {"p50": 3.0, "p90": 4.6, "p99": 4.96}
    assert percentiles([]) == {"p50": 0.0, "p90": 0.0, "p99": 0.0}


def test_summary_counts_tokens_latencies_and_errors() -> None:
    ok = Result(ok=True, prompt_tokens=3, output_tokens=3, start=0.0, token_times=[0.5, 0.7, 0.9])
    bad = Result(ok=False, error="UNAVAILABLE")
    s = summarize([ok, ok, bad], wall=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, {"UNAVAILABLE": 1})
    assert s["output_throughput"] == 3.0 and s["request_throughput"] == 1.0
    assert s["ttft_ms"]["p50"] == 500.0 and s["tbt_ms"]["p50"] == pytest.approx(200.0)


def test_datasets(tmp_path) -> None:
    rand = load_dataset("random:4", 3, vocab_size=10)
    assert len(rand) == 3 and all(len(p.ids) == 4 and max(p.ids) < 10 for p in rand)
    assert load_dataset("chat", 20, 10)[0].text
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt_ids": [1, 2]}) + "\n")
    got = load_dataset(str(f), 3, 10)
    assert [(p.text, p.ids) for p in got] == [("hi", None), (None, (1, 2)), ("hi", None)]
    with pytest.raises(ValueError, match="no prompts"):
        (tmp_path / "empty.jsonl").write_text("")
        load_dataset(str(tmp_path / "empty.jsonl"), 1, 10)
