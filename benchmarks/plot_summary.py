"""The README's performance figure, from saved benchmark results (no new measurement):
(left) serving throughput through the real services on emulated devices, before and
after step alignment, beside the projection of the same runs; (right) the Qwen pair at
S = 8 projected for one device per stage, many requests, three modes and two cost views.

    python benchmarks/plot_summary.py     # writes benchmarks/results/summary.png
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = Path(__file__).resolve().parent / "results"


def serve_cells(name: str) -> list[dict]:
    return json.loads((RESULTS / name / "results.json").read_text())["serve"]


def series(cells: list[dict], mode: str, key: str) -> tuple[list[int], list[float]]:
    pts = sorted(
        (c["concurrency"], c[key]["output_throughput"]) for c in cells if c["mode"] == mode
    )
    return [p[0] for p in pts], [p[1] for p in pts]


def main() -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    before, aligned = serve_cells("emulated-before-align"), serve_cells("emulated-aligned")
    for cells, mode, key, style, label in (
        (aligned, "specpipe", "services", "o-", "specpipe, aligned stages"),
        (before, "specpipe", "services", "o--", "specpipe, before alignment"),
        (aligned, "pp", "services", "s-", "pp"),
        (aligned, "specpipe", "projected", "x:", "specpipe, projected"),
        (aligned, "pp", "projected", "+:", "pp, projected"),
    ):
        left.plot(*series(cells, mode, key), style, label=label)
    left.set(
        title="Through the services, emulated devices\n(S = 3, flat 100/60 ms, tiny model)",
        xlabel="concurrent clients",
        ylabel="output tokens / s",
        xscale="log",
    )
    left.set_xscale("log", base=2)
    left.legend(fontsize=7)

    project = json.loads((RESULTS / "emulated" / "results.json").read_text())["project"]
    for mode, marker, color in (
        ("specpipe", "o", "C0"),
        ("specinfer", "^", "C3"),
        ("pp", "s", "C2"),
    ):
        for view, style in (("flat", "--"), ("flat_free_draft", "-")):
            pts = sorted(
                (c["concurrency"], c["output_throughput"])
                for c in project
                if c["mode"] == mode and c["view"] == view
            )
            if mode == "pp" and view == "flat_free_draft":
                continue  # pp has no draft: the same as flat
            label = f"{mode}, {'flat' if view == 'flat' else 'flat + free draft'}"
            right.plot(
                *zip(*pts, strict=True), marker=marker, linestyle=style, color=color, label=label
            )
    right.set(
        title="Projected, Qwen2.5-Coder 1.5B/0.5B, S = 8\n(one device per stage)",
        xlabel="concurrent requests",
        ylabel="output tokens / s",
    )
    right.set_xscale("log", base=2)
    right.legend(fontsize=7)
    fig.tight_layout()
    out = RESULTS / "summary.png"
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
