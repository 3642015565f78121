"""Each call of a packed row as its own sequence: the ``per_call`` execution.

A packed row holds ``q`` once and every call's block after it (segment ids 0 = q, t+1 = call t).
Running call t *alone* means the sequence ``[q, block_t]`` with the same restored positions and
plain causal attention -- what the rollout engine saw. :func:`calls_alone` lays out all calls of
a micro-batch as one stream of such sequences (``q`` repeated once per call), so that
``memopd.layout=per_call`` runs every forward of actor, reference, critic and teacher this way and
reads each packed token's output back with ``index`` (the paper's per-call baseline for the packing
speed-up, with otherwise identical rows, losses and metrics). (The RCE check does not use this
stream: its alone pass is rebuilt from the invocation records and must not run through the ``memopd_*``
attention it audits; see ``verl_memopd.audit.record_calls``.)

A row without call blocks (verl's synthetic padding rows) is its own plain causal sequence.
"""

from __future__ import annotations

import torch

from verl_memopd.fields import SEGMENTS
from verl_memopd.segments import segment_meta

Span = tuple[torch.Tensor, int, int]


def calls_alone(
    input_ids: list[torch.Tensor], position_ids: list[torch.Tensor], segment_ids: list[torch.Tensor]
) -> tuple[dict, list[list[Span]], torch.Tensor]:
    """All calls of the rows as standalone sequences, concatenated into one stream of N' tokens.

    Args (one entry per row b, each (L_b,)): the packed row's tokens, restored positions and
    segment ids.

    Returns ``(inputs, spans, index)``:
        inputs: ``input_ids`` / ``position_ids`` (1, N') and ``memopd_segments`` (every sequence
            its own plain causal row) for the model;
        spans[b][t] = (block_index, start, end): the packed-row indices of call t's block and the
            stream slice [start, end) that holds the same tokens run alone;
        index: (N,) with N = sum_b L_b -- for every token of the packed stream (rows concatenated),
            the stream position whose output stands for it (a ``q`` token: its copy in the row's
            last call; outputs at q are identical in every copy).
    """
    ids, pos, lengths, spans, index = [], [], [], [], []
    offset = 0
    for tok, p, seg in zip(input_ids, position_ids, segment_ids):
        calls = [c for c in range(1, int(seg.max()) + 1) if bool((seg == c).any())]
        keeps = [torch.nonzero((seg == 0) | (seg == c), as_tuple=True)[0] for c in calls]
        row_index = torch.empty(seg.numel(), dtype=torch.long, device=seg.device)
        row_spans = []
        for keep in keeps or [torch.arange(seg.numel(), device=seg.device)]:
            stream = offset + torch.arange(keep.numel(), device=seg.device)
            row_index[keep] = stream
            ids.append(tok[keep])
            pos.append(p[keep])
            lengths.append(keep.numel())
            offset += keep.numel()
        for c, keep in zip(calls, keeps):
            block = torch.nonzero(seg == c, as_tuple=True)[0]
            end = int(row_index[block[-1]]) + 1
            row_spans.append((block, end - block.numel(), end))
        spans.append(row_spans)
        index.append(row_index)
    stream_pos = torch.cat(pos)
    row_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    meta = segment_meta(torch.zeros_like(stream_pos), row_ids.to(stream_pos.device), stream_pos)
    inputs = {
        "input_ids": torch.cat(ids).unsqueeze(0),
        "position_ids": stream_pos.unsqueeze(0),
        SEGMENTS: meta.to(stream_pos.device),
    }
    return inputs, spans, torch.cat(index)
