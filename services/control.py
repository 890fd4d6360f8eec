"""Activations and prunes <-> their protobuf messages: the rows and prune signals the
router sends the stages and the draft over gRPC (the control plane), the same rows every
data-plane frame header carries, and the error for a message that cannot be decoded.
"""

from __future__ import annotations

import numpy as np
import torch
from specpipe.common.perf.cost_model import CostCurve
from specpipe.common.runtime.errors import InvalidInput
from specpipe.common.runtime.prefix_hash import CacheScope
from specpipe.common.runtime.validation import MAX_ROWS, Limits, check_counts
from specpipe.common.spec.grammar import Grammar
from specpipe.common.spec.messages import (
    Activation,
    Prune,
    PruneArrays,
    RowArrays,
    TokenLogprobs,
    Verified,
)
from specpipe.common.spec.options import MAX_LOGPROBS
from specpipe.common.spec.sampling import SamplingParams
from specpipe.common.spec.verify import VerifySpec
from specpipe.v1 import dataplane_pb2 as pb


class FrameError(ValueError):
    """A frame or a control message that cannot be decoded (corrupt, unknown dtype, sizes or
    row counts that disagree)."""


# Bytes per row of a control message: a position, node and parent id and a token id as
# varints (at most 10 bytes each, far less in practice) and field tags.
BYTES_PER_ROW = 48
DEFAULT_MAX_CONTROL_BYTES = 4 << 20  # a stage without a model (gRPC's default)


def max_control_bytes(limits: Limits | None) -> int:
    """The largest control message a stage or the draft reads: a prefill chunk or tree of
    `MAX_ROWS` rows, a prune naming every cached row, or a prompt filling the context.
    gRPC refuses larger ones (RESOURCE_EXHAUSTED) before reading them."""
    if limits is None:
        return DEFAULT_MAX_CONTROL_BYTES
    return (1 << 20) + BYTES_PER_ROW * (limits.max_capacity + limits.max_rows)


def array_of(values, dtype: type = np.int64) -> np.ndarray:
    """A message's repeated numbers as a numpy array (the router's kind: messages.py)."""
    return np.fromiter(values, dtype=dtype, count=len(values))


def tensor_of(values, dtype: type = np.int64) -> torch.Tensor:
    """A message's repeated numbers as a tensor, through numpy: half the time of
    `torch.tensor` on a repeated field (several per request and step on every stage)."""
    return torch.from_numpy(array_of(values, dtype))


def rows_to_proto(act: Activation | RowArrays) -> pb.Rows:
    """The rows of a stage's activation, or of the router's (numpy: no row tokens)."""
    row_tokens = act.row_tokens if isinstance(act, Activation) else None
    return pb.Rows(
        positions=act.positions.tolist(),
        committed=act.committed,
        node_ids=act.node_ids.tolist(),
        parent_ids=act.parent_ids.tolist(),
        token_ids=[] if row_tokens is None else row_tokens.tolist(),
    )


def activation_from_rows(
    request_id: str, rows: pb.Rows, tokens: int | None = None, max_rows: int = MAX_ROWS
) -> Activation:
    """An Activation with the rows' metadata and no tensor yet. The counts are checked
    first, from the message's lengths (`tokens`: the token ids that come with them)."""
    try:
        check_counts(
            len(rows.positions), len(rows.node_ids), len(rows.parent_ids), rows.committed,
            tokens, max_rows,
        )  # fmt: skip
    except InvalidInput as e:
        raise FrameError(str(e)) from None
    if rows.token_ids and len(rows.token_ids) != len(rows.positions):
        raise FrameError(f"{len(rows.token_ids)} row token ids for {len(rows.positions)} rows")
    return Activation(
        request_id=request_id,
        positions=tensor_of(rows.positions),
        committed=rows.committed,
        node_ids=tensor_of(rows.node_ids),
        parent_ids=tensor_of(rows.parent_ids),
        row_tokens=tensor_of(rows.token_ids) if rows.token_ids else None,
    )


def prune_to_proto(prune: Prune | PruneArrays, seq: int) -> pb.PruneSignal:
    return pb.PruneSignal(
        seq=seq,
        commit_ids=prune.commit_ids.tolist(),
        keep_ids=prune.keep_ids.tolist(),
        horizon=prune.horizon,
    )


def prune_from_proto(sig: pb.PruneSignal) -> Prune:
    return Prune(
        commit_ids=tensor_of(sig.commit_ids),
        keep_ids=tensor_of(sig.keep_ids),
        horizon=sig.horizon,
    )


def token_activation(
    request_id: str, rows: pb.Rows, token_ids, max_rows: int = MAX_ROWS
) -> Activation:
    """Stage-1 or draft input: rows plus their token ids (counts checked before the
    tensors are built)."""
    act = activation_from_rows(request_id, rows, len(token_ids), max_rows)
    act.tokens = tensor_of(token_ids)
    return act


def verify_spec_to_proto(spec: VerifySpec) -> pb.VerifySpec:
    sp = spec.sampling
    msg = pb.VerifySpec(
        temperature=sp.temperature,
        top_k=sp.top_k,
        top_p=sp.top_p,
        seed=sp.seed,
        output_start=spec.output_start,
    )
    if spec.logprobs is not None:
        msg.logprobs = spec.logprobs
    if spec.prompt_logprobs is not None:
        msg.prompt_logprobs = spec.prompt_logprobs
    if spec.grammar is not None:
        msg.grammar = spec.grammar.text
        msg.grammar_consumed.extend(spec.grammar_consumed)
    if sp.repetition_penalty != 1.0:
        msg.repetition_penalty = sp.repetition_penalty
    msg.frequency_penalty, msg.presence_penalty = sp.frequency_penalty, sp.presence_penalty
    msg.logit_bias.update(sp.logit_bias)
    msg.min_tokens = spec.min_tokens
    msg.stop_token_ids.extend(spec.stop_token_ids)
    return msg


def verify_spec_from_proto(msg: pb.VerifySpec, grammar_tokenizer=None) -> VerifySpec:
    """A request's verification parameters, checked (InvalidInput if out of range, or a
    grammar that cannot be used or refuses its consumed tokens). A grammar is bound to
    `grammar_tokenizer` (this stage's model's, `grammar.load_grammar_tokenizer`)."""
    if msg.grammar and grammar_tokenizer is None:
        raise InvalidInput("structured output needs the model's tokenizer on this stage")
    try:
        grammar = Grammar(msg.grammar, grammar_tokenizer) if msg.grammar else None
        sampling = SamplingParams(
            msg.temperature,
            msg.top_k,
            msg.top_p,
            msg.seed,
            repetition_penalty=msg.repetition_penalty or 1.0,
            frequency_penalty=msg.frequency_penalty,
            presence_penalty=msg.presence_penalty,
            logit_bias=dict(msg.logit_bias),
        )
        logprobs = msg.logprobs if msg.HasField("logprobs") else None
        prompt = msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None
        consumed = tuple(msg.grammar_consumed)
        spec = VerifySpec(
            sampling,
            msg.output_start,
            logprobs,
            prompt,
            grammar,
            consumed,
            min_tokens=msg.min_tokens,
            stop_token_ids=tuple(msg.stop_token_ids),
        )
        spec.grammar_state()  # the grammar compiles and takes the output so far
        return spec
    except ValueError as e:
        raise InvalidInput(f"bad verification parameters: {e}") from None


def logprobs_to_proto(logprobs) -> list[pb.TokenLogprobs]:
    return [
        pb.TokenLogprobs(logprob=lp.logprob, top_ids=lp.top_ids, top_logprobs=lp.top_logprobs)
        for lp in logprobs
    ]


def verified_to_proto(v: Verified) -> pb.Verification:
    msg = pb.Verification(node_ids=v.node_ids, token_ids=v.tokens, position=v.position)
    msg.logprobs.extend(logprobs_to_proto(v.logprobs or ()))
    msg.prompt_logprobs.extend(logprobs_to_proto(v.prompt_logprobs or ()))
    return msg


def verified_from_proto(
    request_id: str, msg: pb.Verification, max_nodes: int, vocab: int | None, logprobs: bool
) -> Verified:
    """A last stage's verification, checked against what the request can have: at most
    `max_nodes` nodes, tokens in the vocabulary, logprobs (one per token, at most
    MAX_LOGPROBS alternatives each) exactly when the request asked for them."""
    n = len(msg.node_ids)
    if not 1 <= n <= max_nodes or len(msg.token_ids) != n:
        raise FrameError(
            f"a verification of {n} nodes and {len(msg.token_ids)} tokens (at most {max_nodes})"
        )
    tokens, high = tuple(msg.token_ids), vocab if vocab else 1 << 62
    if min(tokens) < 0 or max(tokens) >= high:
        raise FrameError(f"a verified token outside the vocabulary of {vocab}")
    lps = None
    if logprobs:
        if len(msg.logprobs) != n:
            raise FrameError(f"{len(msg.logprobs)} logprobs for {n} tokens")
        lps = _logprobs_from_proto(msg.logprobs)
    # A request's first verification, when it asked for them (the controller checks
    # their number against its prompt).
    prompt = _logprobs_from_proto(msg.prompt_logprobs) if msg.prompt_logprobs else None
    return Verified(request_id, tuple(msg.node_ids), tokens, msg.position, lps, prompt)


def _logprobs_from_proto(msgs) -> tuple[TokenLogprobs, ...]:
    found = []
    for lp in msgs:
        if len(lp.top_ids) > MAX_LOGPROBS or len(lp.top_ids) != len(lp.top_logprobs):
            raise FrameError("malformed top logprobs")
        found.append(TokenLogprobs(lp.logprob, tuple(lp.top_ids), tuple(lp.top_logprobs)))
    return tuple(found)


def cost_curve_to_proto(curve: CostCurve, context: int = 0) -> pb.CostCurve:
    return pb.CostCurve(rows=curve.rows, seconds=curve.seconds, context=context)


def cost_curve_from_proto(msg: pb.CostCurve | None) -> CostCurve | None:
    """A Describe's cost curve; None when none was measured or it is malformed (a peer's
    curve is advice for the tuning, never a reason to fail)."""
    if msg is None or not msg.rows:
        return None
    try:
        return CostCurve.from_dict({"rows": list(msg.rows), "seconds": list(msg.seconds)})
    except ValueError:
        return None


def cache_scope_to_proto(scope: CacheScope) -> pb.CacheScope:
    return pb.CacheScope(salt=scope.salt, owner=scope.owner)


def cache_scope_from_proto(msg: pb.CacheScope) -> CacheScope:
    """A request's prefix-cache scope; InvalidInput when it is oversized."""
    try:
        return CacheScope(bytes(msg.salt), bytes(msg.owner))
    except ValueError as e:
        raise InvalidInput(str(e)) from None
