"""A request's stats on the wire: `DecodeStats.record()` as `SpeculationStats` and back.

The proto's fields carry the record's names, so the router, the SDK and the command
line share one mapping; the router adds its wall-clock timings.
"""

from __future__ import annotations

from specpipe.common.spec.stats import DecodeStats
from specpipe.v1 import generation_pb2 as gen

TIMING_KEYS = ("time_to_first_token_ms", "mean_time_between_tokens_ms")


def stats_to_proto(stats: DecodeStats, ttft_ms: float, tbt_ms: float) -> gen.SpeculationStats:
    return gen.SpeculationStats(
        **stats.record(), time_to_first_token_ms=ttft_ms, mean_time_between_tokens_ms=tbt_ms
    )


def stats_from_proto(msg: gen.SpeculationStats) -> dict[str, object]:
    """Every field by name (the record's keys plus the timings)."""
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}
