"""Rows -> the engines' input streams: each call alone, each prompt group's ``q`` once, or the separated
persistent history (stage 2).

A micro-batch reaches an engine as packed rows (``packing``): per row b its tokens, restored positions and
segment ids (0 = q, t+1 = call t), each (L_b,). The engine runs them as one stream of N = sum_b L_b tokens,
or re-lays them first, and reads every per-token output back in the packed order with an ``index`` (N,):

``calls_alone`` -- the ``per_call`` execution. Running call t *alone* means the sequence ``[q, block_t]``
with the same restored positions and plain causal attention -- what the rollout engine saw. All calls of a
micro-batch become one stream of such sequences (``q`` repeated once per call), so that
``memopd.layout=per_call`` runs every forward of actor, reference, critic and teacher this way (the
paper's per-call baseline for the packing speed-up, with otherwise identical rows, losses and metrics).
(The RCE check does not use this stream: its alone pass is rebuilt from the invocation records and must
not run through the ``memopd_*`` attention it audits; see ``verl_memopd.audit.record_calls``.) A row
without call blocks (verl's synthetic padding rows) is its own plain causal sequence.

``share_prefix`` -- the group-shared prefix. GRPO and ``rollout.n > 1`` sample several episodes of the
**same** prompt ``q``. Within a micro-batch, rows of the same prompt group (verl's ``uid``, written per
row by ``verl_memopd.trainer.rows`` as ``memopd_prompt_group``) whose ``q`` token ids are verified
identical form a depth-1 prefix tree: the first such row (the *owner*) keeps its ``q``; the others
(*members*) drop theirs, and their call blocks follow the owner's blocks in the stream, attending to the
owner's ``q`` K/V::

    rows (packed)   A: qA | a1 | a2        B: qB | b1 | b2        (uid(A) = uid(B), qA == qB)
    stream          q  a1 a2 b1 b2                                 (segments 0, 1, 2, 3, 4; one tree)
    keys of b1      [q ; b1]   -- positions, visibility and arithmetic as in B's own packed row

Nothing else changes: positions are the rows' restored ones (q's outputs do not depend on the row,
since q sees only q), and a member's q token reads the owner's copy (gradients of all copies sum into
it, as they would into the hidden states of q computed once). A group split across micro-batches
(dynamic batch sizes) just shares less. Rows without call blocks (the flat layout, verl's padding
rows) and rows of group ``-1`` are never shared.

``flat_history`` -- the persistent history with its turns separated (``memopd.teacher.flat_separator_ids``).
A row of the flat layout holds the packed row's tokens ``[q | block_0 | block_1 | ...]`` joined as they are;
the teacher's flat pass runs it with the separator ids inserted before every call block ``t >= 1`` (found
from the row's ``memopd_call_index``), positions 0..L'-1 and plain causal attention -- the tokens of
``packing``'s ``flat`` layout with ``LayoutOptions(flat_separator_ids=...)``. A separator token's output
stands for no row token; every action token is still predicted by the token before it in its own block.

All take and return plain tensors (no verl): ``verl_memopd.trainer.engine`` applies them.
"""

from __future__ import annotations

from typing import Optional

import torch

from verl_memopd.fields import SEGMENTS
from verl_memopd.segments import segment_meta

__all__ = ["Span", "calls_alone", "share_prefix", "flat_history"]

#: (block_index, start, end): a call block's packed-row indices and its slice of the calls-alone stream
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


def _prefix_len(seg: torch.Tensor) -> int:
    """P: the row's leading ``q`` tokens (segment 0); 0 when the row has no call blocks."""
    if seg.numel() == 0 or int(seg.max()) <= 0:
        return 0
    return int((seg != 0).nonzero()[0])


def _owners(input_ids: list[torch.Tensor], segment_ids: list[torch.Tensor], groups: list[int]) -> list[int]:
    """For every row, the row whose q it uses (itself when it keeps its own)."""
    owner, first = list(range(len(input_ids))), {}
    for b, (ids, seg, g) in enumerate(zip(input_ids, segment_ids, groups)):
        p = _prefix_len(seg)
        if g < 0 or p == 0:
            continue
        for c in first.get((g, p), []):  # same group and |q|: verify the ids, never trust the group alone
            if torch.equal(input_ids[c][:p], ids[:p]):
                owner[b] = c
                break
        else:
            first.setdefault((g, p), []).append(b)
    return owner


def share_prefix(
    input_ids: list[torch.Tensor], position_ids: list[torch.Tensor], segment_ids: list[torch.Tensor], groups: list[int]
) -> Optional[tuple[dict, torch.Tensor]]:
    """Lay out a micro-batch's packed rows with each prompt group's q stored once.

    Args (one entry per row b): the packed row's tokens, restored positions, segment ids, each
    (L_b,), and its prompt group (int; -1 = keep its own q).

    Returns None when no two rows share (run the rows as they are), else ``(inputs, index)``:
        inputs: ``input_ids`` / ``position_ids`` (1, N') and ``memopd_segments`` for the model,
            N' = N - (q tokens of the member rows);
        index: (N,) with N = sum_b L_b -- for every token of the packed stream (rows concatenated),
            the position in the new stream whose output stands for it.
    """
    owner = _owners(input_ids, segment_ids, groups)
    if owner == list(range(len(input_ids))):
        return None
    members = {
        b: [m for m in range(len(owner)) if owner[m] == b and m != b] for b in range(len(owner)) if owner[b] == b
    }
    starts = torch.tensor([0] + [t.numel() for t in input_ids]).cumsum(0).tolist()
    device = input_ids[0].device
    index = torch.empty(starts[-1], dtype=torch.long, device=device)
    ids, pos, seg, tree = [], [], [], []
    offset = 0
    for t, (b, rows) in enumerate(members.items()):
        p = _prefix_len(segment_ids[b])
        q_stream = offset + torch.arange(p, device=device)
        last_seg = 0
        for r in [b, *rows]:
            keep = slice(0, None) if r == b else slice(p, None)
            n = input_ids[r][keep].numel()
            here = offset + torch.arange(n, device=device)
            index[starts[r] : starts[r + 1]] = here if r == b else torch.cat([q_stream, here])
            row_seg = segment_ids[r][keep]
            ids.append(input_ids[r][keep])
            pos.append(position_ids[r][keep])
            seg.append(torch.where(row_seg > 0, row_seg + last_seg, row_seg))  # calls of later rows follow on
            tree.append(torch.full((n,), t, dtype=torch.long, device=device))
            last_seg = int(seg[-1].max())
            offset += n
    stream_pos = torch.cat(pos)
    meta = segment_meta(torch.cat(seg), torch.cat(tree), stream_pos)  # checks q 0..P-1, blocks from P
    inputs = {
        "input_ids": torch.cat(ids).unsqueeze(0),
        "position_ids": stream_pos.unsqueeze(0),
        SEGMENTS: meta.to(device),
    }
    return inputs, index


def flat_history(
    input_ids: list[torch.Tensor], call_index: list[torch.Tensor], separator: tuple[int, ...]
) -> tuple[dict, torch.Tensor]:
    """Flat-layout rows with ``separator`` inserted before every call block ``t >= 1``, as one stream.

    Args (one entry per row b): the row's tokens (L_b,) and the call index of each response token
    (R_b,), R_b <= L_b (the row's last R_b tokens; a block starts where the call index changes);
    ``separator``: the ids inserted (S tokens each time).

    Returns ``(inputs, index)``:
        inputs: ``input_ids`` / ``position_ids`` (1, N') and ``memopd_segments`` (every row one plain
            causal sequence, positions 0..L'_b-1) for the model, N' = N + S * (block starts);
        index: (N,) with N = sum_b L_b -- for every token of the rows (concatenated), its stream position.
    """
    device = input_ids[0].device
    sep = torch.tensor(separator, dtype=input_ids[0].dtype, device=device)
    ids, lengths, index = [], [], []
    offset = 0
    for tok, calls in zip(input_ids, call_index):
        start = tok.numel() - calls.numel()
        starts = start + 1 + torch.nonzero(calls[1:] != calls[:-1], as_tuple=True)[0]
        before = torch.zeros(tok.numel(), dtype=torch.long, device=device)
        before[starts] = sep.numel()
        row_index = torch.arange(tok.numel(), device=device) + before.cumsum(0)
        row = torch.empty(tok.numel() + sep.numel() * starts.numel(), dtype=tok.dtype, device=device)
        row[row_index] = tok
        for j in (row_index[starts] - sep.numel()).tolist():
            row[j : j + sep.numel()] = sep
        ids.append(row)
        lengths.append(row.numel())
        index.append(offset + row_index)
        offset += row.numel()
    stream_pos = torch.cat([torch.arange(n, device=device) for n in lengths])
    row_ids = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    meta = segment_meta(torch.zeros_like(stream_pos), row_ids, stream_pos)
    inputs = {"input_ids": torch.cat(ids).unsqueeze(0), "position_ids": stream_pos.unsqueeze(0), SEGMENTS: meta}
    return inputs, torch.cat(index)
