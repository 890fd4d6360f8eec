"""Write helm/specpipe/files/grafana-dashboard.json, the chart's Grafana dashboard of the
services' metrics (services/metrics.py). Run after changing the panels below; the chart
test checks that every query names metrics the services serve."""

from __future__ import annotations

import json
from pathlib import Path

OUT = (
    Path(__file__).resolve().parent.parent
    / "helm"
    / "specpipe"
    / "files"
    / "grafana-dashboard.json"
)


def q(metric: str, extra: str = "") -> str:
    return f'{metric}{{namespace=~"$namespace"{extra}}}'


def quantiles(hist: str, by: str = "") -> list[tuple[str, str]]:
    group = f"le{', ' + by if by else ''}"
    return [
        (f"histogram_quantile({p}, sum by ({group}) (rate({q(hist + '_bucket')}[5m])))",
         f"p{int(p * 100)}{' {{' + by + '}}' if by else ''}")
        for p in (0.5, 0.95)
    ]  # fmt: skip


PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Requests", "short", [
        (f"sum({q('specpipe:num_requests_running')})", "running"),
        (f"sum({q('specpipe:num_requests_waiting')})", "waiting for a path"),
    ]),
    ("Tokens per second", "short", [
        (f"sum(rate({q('specpipe:generation_tokens_total')}[1m]))", "generated"),
        (f"sum(rate({q('specpipe:prompt_tokens_total')}[1m]))", "prompt"),
    ]),
    ("Time to first token", "s", quantiles("specpipe:time_to_first_token_seconds")),
    ("Inter-token latency", "s", quantiles("specpipe:inter_token_latency_seconds")),
    ("End-to-end request latency", "s", quantiles("specpipe:e2e_request_latency_seconds")),
    ("Speculation hit rate", "percentunit", [
        (f"sum(rate({q('specpipe:spec_hits_total')}[5m])) / "
         f"sum(rate({q('specpipe:generation_tokens_total')}[5m]))", "hits / tokens"),
    ]),
    ("Hits by tree depth", "short", [
        (f"sum by (depth) (rate({q('specpipe:spec_hits_by_depth_total')}[5m]))", "depth {{depth}}"),
    ]),
    ("Tokens per pipeline step", "short", quantiles("specpipe:spec_tokens_per_step")),
    ("Stage busy ratio", "percentunit", [
        (q("specpipe:stage_busy_ratio"), "{{pod}}"),
    ]),
    ("Stage queued rows", "short", [(q("specpipe:stage_queued_rows"), "{{pod}}")]),
    ("KV cache usage", "percentunit", [(q("specpipe:kv_cache_usage_perc"), "{{pod}}")]),
    ("Stage forward time", "s", quantiles("specpipe:stage_forward_seconds", "pod")),
    ("Draft busy ratio", "percentunit", [(q("specpipe:draft_busy_ratio"), "{{pod}}")]),
    ("Draft forward time", "s", quantiles("specpipe:draft_forward_seconds", "pod")),
    ("Faults", "short", [
        (f"sum(rate({q('specpipe:replays_total')}[5m]))", "replays / s"),
        (f"sum(rate({q('specpipe:draft_drops_total')}[5m]))", "draft drops / s"),
        (f"sum(rate({q('specpipe:request_failures_total')}[5m]))", "failed / s"),
    ]),
    ("Replicas seen by the routers", "short", [
        (f"max by (kind, state) ({q('specpipe:router_backends')})", "{{kind}} {{state}}"),
    ]),
    ("Model versions (1: new requests go there)", "short", [
        (f"max by (weight_hash, model) ({q('specpipe:router_model_versions')})",
         "{{model}} {{weight_hash}}"),
    ]),
    ("Path choice (router overhead)", "s", quantiles("specpipe:path_choice_seconds")),
]  # fmt: skip


def dashboard() -> dict:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": i + 1,
            "type": "timeseries",
            "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [
                {"refId": chr(65 + j), "expr": expr, "legendFormat": legend,
                 "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                for j, (expr, legend) in enumerate(targets)
            ],
        })  # fmt: skip
    return {
        "title": "SpecPipe",
        "uid": "specpipe",
        "tags": ["specpipe", "llm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Data source",
                },
                {
                    "name": "namespace",
                    "type": "query",
                    "label": "Namespace",
                    "includeAll": True,
                    "multi": True,
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": {
                        "query": "label_values(specpipe:num_requests_running, namespace)",
                        "refId": "namespaces",
                    },
                    "refresh": 2,
                },
            ]
        },
        "panels": panels,
    }


if __name__ == "__main__":
    OUT.write_text(json.dumps(dashboard(), indent=1) + "\n")
    print(f"wrote {OUT} ({len(PANELS)} panels)")
