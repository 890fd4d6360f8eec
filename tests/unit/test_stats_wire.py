"""One set of stats names: the record, the proto, the client's dict and `--json`."""

from __future__ import annotations

from specpipe.common.spec.stats import RECORD_KEYS, DecodeStats
from specpipe.services.client.common import Completion
from specpipe.services.stats_wire import TIMING_KEYS, stats_from_proto, stats_to_proto
from specpipe.v1 import generation_pb2 as gen


def test_every_record_key_is_a_proto_field_and_round_trips() -> None:
    fields = {f.name for f in gen.SpeculationStats.DESCRIPTOR.fields}
    assert set(RECORD_KEYS) | set(TIMING_KEYS) == fields
    st = DecodeStats(mode="specpipe", stages=3, width=4, decode_steps=7, new_tokens=5)
    st.hits, st.regrowths, st.late_draft_answers, st.emit_steps = 4, 1, 2, [3, 4, 5, 6, 7]
    back = stats_from_proto(stats_to_proto(st, 12.5, 3.25))
    assert {k: back[k] for k in RECORD_KEYS} == st.record()
    assert back["time_to_first_token_ms"] == 12.5
    done = Completion("r", [1], "", "length", 2, 5, stats=back)
    assert done.summary() == st.summary() and done.speculation() == st.speculation()
    assert st.record()["tokens_per_step"] == round(5 / 7, 6)
