"""Activations and prunes <-> their protobuf messages: the rows and prune signals the
router sends the stages and the draft over gRPC (the control plane), the same rows every
data-plane frame header carries, and the error for a message that cannot be decoded.
"""

from __future__ import annotations

import torch
from specpipe.common.spec.messages import Activation, Prune
from specpipe.v1 import dataplane_pb2 as pb


class FrameError(ValueError):
    """A frame or a control message that cannot be decoded (corrupt, unknown dtype, sizes or
    row counts that disagree)."""


def rows_to_proto(act: Activation) -> pb.Rows:
    return pb.Rows(
        positions=act.positions.tolist(),
        committed=act.committed,
        node_ids=act.node_ids.tolist(),
        parent_ids=act.parent_ids.tolist(),
    )


def activation_from_rows(request_id: str, rows: pb.Rows) -> Activation:
    """An Activation with the rows' metadata and no tensor yet."""
    i64 = torch.int64
    return Activation(
        request_id=request_id,
        positions=torch.tensor(rows.positions, dtype=i64),
        committed=rows.committed,
        node_ids=torch.tensor(rows.node_ids, dtype=i64),
        parent_ids=torch.tensor(rows.parent_ids, dtype=i64),
    )


def prune_to_proto(prune: Prune, seq: int) -> pb.PruneSignal:
    return pb.PruneSignal(
        seq=seq,
        commit_ids=prune.commit_ids.tolist(),
        keep_ids=prune.keep_ids.tolist(),
        horizon=prune.horizon,
    )


def prune_from_proto(sig: pb.PruneSignal) -> Prune:
    return Prune(
        commit_ids=torch.tensor(sig.commit_ids, dtype=torch.int64),
        keep_ids=torch.tensor(sig.keep_ids, dtype=torch.int64),
        horizon=sig.horizon,
    )


def token_activation(request_id: str, rows: pb.Rows, token_ids) -> Activation:
    """Stage-1 or draft input: rows plus their token ids (validated lengths)."""
    act = activation_from_rows(request_id, rows)
    act.tokens = torch.tensor(list(token_ids), dtype=torch.int64)
    if act.tokens.numel() != len(act):
        raise FrameError(f"{act.tokens.numel()} token ids for {len(act)} rows")
    if not act.committed and (
        act.node_ids.numel() != len(act) or act.parent_ids.numel() != len(act)
    ):
        raise FrameError("tree rows need one node id and one parent id each")
    return act
