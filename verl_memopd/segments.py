"""Attention metadata of a token stream: which keys every token attends to (stage 2 -> 3).

Built here from per-token segment and row ids (a layout's ``B * L`` tokens, rows concatenated, or verl's
remove-padding stream); layouts are built in ``verl_memopd.packing``, the metadata is executed in
``verl_memopd.attention``. In a ``packed`` row::

    tokens     q0 q1 q2 | x0 x0 a0 a0 | x1 x1 x1 a1      (P=3; call blocks B_1, B_2)
    positions   0  1  2 |  3  4  5  6 |  3  4  5  6      each block continues from P
    segment     0  0  0 |  1  1  1  1 |  2  2  2  2      0 = q, t+1 = call t

Visibility (row = query, column = key; 1 = may attend)::

              q0 q1 q2 x0 x0 a0 a0 x1 x1 x1 a1
        q2     1  1  1  .  .  .  .  .  .  .  .
        a0     1  1  1  1  1  1  .  .  .  .  .      B_1 sees all of q and its own past
        x1     1  1  1  .  .  .  .  1  .  .  .      B_2 never sees B_1
        a1     1  1  1  .  .  .  .  1  1  1  1

Attention metadata is a :class:`SegmentMeta` over the ``B * L`` token stream (rows concatenated): each
query segment attends causally, bottom-right aligned, to its gathered keys (see its docstring).

Shapes: :func:`segment_meta` takes ``segment_ids`` / ``row_ids`` / ``position_ids`` of shape (N,)
(``PAD_SEGMENT`` = -1 at padding, each padding run isolated; rows never see each other);
:func:`padded_batch_segments` takes a padded verl micro-batch's (B, L) ``segment_ids``,
``attention_mask`` (1 at real tokens) and ``position_ids``. The result holds ``cu_seqlens_q`` /
``cu_seqlens_k`` (S + 1,) int32 and ``key_index`` (Nk,) int64 for S query segments.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import torch

__all__ = ["LayoutError", "SegmentMeta", "segment_meta", "padded_batch_segments", "PAD_SEGMENT"]

#: Segment id of padding tokens in :func:`segment_meta`: each padding run is isolated.
PAD_SEGMENT = -1


class LayoutError(ValueError):
    """A layout or attention metadata that would break a call's state (leak, merge, misalign)."""


# --- attention metadata ---------------------------------------------------------------------------
def _cu(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])


@dataclass(frozen=True)
class SegmentMeta:
    """Varlen attention metadata over a stream of N tokens split into S query segments.

    Segment ``s`` has queries ``stream[cu_seqlens_q[s]:cu_seqlens_q[s+1]]`` (Lq of them) and keys
    ``stream[key_index[cu_seqlens_k[s]:cu_seqlens_k[s+1]]]`` (Lk >= Lq). The last Lq keys are the
    queries themselves, in order; attention is causal aligned bottom-right (as flash-attn >= 2.1
    with ``causal=True``): query ``i`` sees its segment's first ``Lk - Lq + i + 1`` keys::

        keys    q0 q1 q2 b0 b1          (Lq = 2 queries b0 b1, Lk = 5 keys [q ; block])
        b0       1  1  1  1  .
        b1       1  1  1  1  1

    Attributes:
        cu_seqlens_q: (S + 1,) int32, starts at 0, strictly increasing, ends at N.
        cu_seqlens_k: (S + 1,) int32, starts at 0, ends at Nk.
        key_index: (Nk,) int64 -- stream index of every gathered key/value row.
        max_seqlen_q / max_seqlen_k: longest query / key segment.
        keys_are_queries: (derived) every segment's keys are exactly its queries (no gather needed).
        bounds: (derived) per segment ``(q_start, q_end, k_start, k_end)`` as Python ints.

    Derived values are cached properties, not dataclass fields: tree utilities that rebuild
    dataclasses with ``dataclasses.replace`` (FSDP2's ``cast_forward_inputs``) see init fields only.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    key_index: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    def __post_init__(self) -> None:
        cq, ck, ki = self.cu_seqlens_q, self.cu_seqlens_k, self.key_index
        for name, t, dt in (
            ("cu_seqlens_q", cq, torch.int32),
            ("cu_seqlens_k", ck, torch.int32),
            ("key_index", ki, torch.int64),
        ):
            if t.dtype != dt or t.dim() != 1:
                raise LayoutError(f"SegmentMeta.{name} must be 1-D {dt}, got {t.dtype} with shape {tuple(t.shape)}")
        if cq.numel() != ck.numel() or cq.numel() < 2 or cq[0] != 0 or ck[0] != 0:
            raise LayoutError(
                f"SegmentMeta: cu_seqlens_q/k must both be (S + 1,) with S >= 1, starting at 0; "
                f"got {cq.numel()} and {ck.numel()} entries"
            )
        lq, lk = cq.diff().long(), ck.diff().long()
        n = int(cq[-1])
        if (lq <= 0).any() or (lk < lq).any():
            raise LayoutError("SegmentMeta: every segment needs >= 1 query and at least as many keys as queries")
        if ki.numel() != int(ck[-1]) or (ki.numel() and (ki.min() < 0 or ki.max() >= n)):
            raise LayoutError(f"SegmentMeta.key_index must hold cu_seqlens_k[-1] = {int(ck[-1])} indices in [0, {n})")
        if (self.max_seqlen_q, self.max_seqlen_k) != (int(lq.max()), int(lk.max())):
            raise LayoutError(
                f"SegmentMeta: max_seqlen_q/k = {self.max_seqlen_q}/{self.max_seqlen_k}, "
                f"segments say {int(lq.max())}/{int(lk.max())}"
            )
        seg_of_tok = torch.repeat_interleave(torch.arange(lq.numel(), device=lq.device), lq)
        own_slot = (ck[1:] - cq[1:]).long()[seg_of_tok] + torch.arange(n, device=lq.device)
        if not torch.equal(ki[own_slot], torch.arange(n, device=ki.device)):
            raise LayoutError(
                "SegmentMeta: the last Lq keys of a segment must be its own queries, in order "
                "(bottom-right causal alignment)"
            )

    @cached_property
    def keys_are_queries(self) -> bool:
        return bool(torch.equal(self.cu_seqlens_q, self.cu_seqlens_k))

    @cached_property
    def bounds(self) -> tuple[tuple[int, int, int, int], ...]:
        cq, ck = self.cu_seqlens_q, self.cu_seqlens_k
        rows = torch.stack([cq[:-1], cq[1:], ck[:-1], ck[1:]], 1).tolist()
        return tuple(tuple(r) for r in rows)

    @property
    def num_tokens(self) -> int:
        """N, the length of the query stream."""
        return self.bounds[-1][1]

    def segment_of_tokens(self) -> torch.Tensor:
        """(N,) int64: the segment index of every stream token."""
        lq = self.cu_seqlens_q.diff().long()
        return torch.repeat_interleave(torch.arange(lq.numel(), device=lq.device), lq)

    def visibility(self) -> torch.Tensor:
        """(N, N) bool: ``[i, j]`` True when stream token ``i`` attends to token ``j`` (O(N^2); for checks)."""
        vis = torch.zeros(self.num_tokens, self.num_tokens, dtype=torch.bool)
        for qa, qb, ka, kb in self.bounds:
            keys = self.key_index[ka:kb].cpu()
            vis[qa:qb, keys] = torch.ones(qb - qa, kb - ka, dtype=torch.bool).tril((kb - ka) - (qb - qa))
        return vis

    def to(self, device: torch.device | str) -> "SegmentMeta":
        return SegmentMeta(
            self.cu_seqlens_q.to(device),
            self.cu_seqlens_k.to(device),
            self.key_index.to(device),
            self.max_seqlen_q,
            self.max_seqlen_k,
        )


def _runs(seg: torch.Tensor, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Starts and lengths of maximal runs of equal ``(row, segment)`` in a stream."""
    change = torch.ones_like(seg, dtype=torch.bool)
    change[1:] = (seg[1:] != seg[:-1]) | (row[1:] != row[:-1])
    starts = change.nonzero().squeeze(1)
    return starts, torch.cat([starts[1:], starts.new_tensor([seg.numel()])]) - starts


def _check_run_order(run_seg: torch.Tensor, run_row: torch.Tensor, row_idx: torch.Tensor) -> None:
    if (run_row[1:] < run_row[:-1]).any():
        raise LayoutError("row_ids must be non-decreasing: each row's tokens must be contiguous in the stream")
    real = run_seg != PAD_SEGMENT
    rs, rr, rid = run_seg[real], row_idx[real], run_row[real]
    bad = ((rr[1:] == rr[:-1]) & (rs[1:] <= rs[:-1])).nonzero()
    if bad.numel():
        i = int(bad[0]) + 1
        raise LayoutError(
            f"row {int(rid[i])}: segment {int(rs[i])} follows segment {int(rs[i - 1])}; segments must be single "
            f"contiguous runs in increasing order (a split or repeated segment would merge two calls' states)"
        )


def segment_meta(
    segment_ids: torch.Tensor, row_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None
) -> SegmentMeta:
    """Attention metadata for a stream of N tokens from per-token segment and row ids (vectorised).

    Args:
        segment_ids: (N,) int -- 0 for a row's shared prefix ``q``, ``t + 1`` for call ``t``'s block,
            ``PAD_SEGMENT`` (-1) for padding. A row holding only segment 0 is a plain causal sequence.
        row_ids: (N,) int, non-decreasing -- the row (episode) of each token; rows never see each other.
        position_ids: optional (N,) int -- if given, checked against the segments: ``q`` counts
            0..P-1 and every block continues from P (padding unchecked).

    Every maximal run of equal ``(row, segment)`` is one query segment. A block's keys are
    ``[its row's q ; itself]``; ``q``, padding runs and rows without blocks see only themselves.
    """
    seg = torch.as_tensor(segment_ids).long().cpu()
    row = torch.as_tensor(row_ids).long().cpu()
    if seg.dim() != 1 or seg.shape != row.shape or seg.numel() == 0:
        raise LayoutError(
            f"segment_ids and row_ids must be equal non-empty 1-D tensors, got "
            f"{tuple(seg.shape)} and {tuple(row.shape)}"
        )
    if (seg < PAD_SEGMENT).any():
        raise LayoutError(f"segment_ids must be >= {PAD_SEGMENT}, found {int(seg.min())}")
    starts, lengths = _runs(seg, row)
    run_seg, run_row = seg[starts], row[starts]
    row_idx = _cu((run_row[1:] != run_row[:-1]).long())
    _check_run_order(run_seg, run_row, row_idx)
    n_rows = int(row_idx[-1]) + 1
    p_start, p_len = torch.full((n_rows,), -1), torch.zeros(n_rows, dtype=torch.long)
    is_q, is_block = run_seg == 0, run_seg > 0
    p_start[row_idx[is_q]], p_len[row_idx[is_q]] = starts[is_q], lengths[is_q]
    orphan = (is_block & (p_start[row_idx] < 0)).nonzero()
    if orphan.numel():
        i = int(orphan[0])
        raise LayoutError(
            f"row {int(run_row[i])} segment {int(run_seg[i])} (call {int(run_seg[i]) - 1}) has no "
            f"shared prefix (segment 0) in its row"
        )
    lp = torch.where(is_block, p_len[row_idx], 0)
    ps = torch.where(is_block, p_start[row_idx], 0)
    if position_ids is not None:
        _check_positions(torch.as_tensor(position_ids).long().cpu().reshape(-1), seg, starts, lengths, lp, run_row)
    lk = lp + lengths
    cu_k = _cu(lk)
    slot_run = torch.repeat_interleave(torch.arange(lk.numel()), lk)
    j = torch.arange(int(cu_k[-1])) - cu_k[slot_run]
    key_index = torch.where(j < lp[slot_run], ps[slot_run] + j, starts[slot_run] + j - lp[slot_run])
    return SegmentMeta(_cu(lengths).int(), cu_k.int(), key_index, int(lengths.max()), int(lk.max()))


def _check_positions(
    pos: torch.Tensor,
    seg: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    lp: torch.Tensor,
    run_row: torch.Tensor,
) -> None:
    if pos.shape != seg.shape:
        raise LayoutError(f"position_ids has shape {tuple(pos.shape)}, segment_ids {tuple(seg.shape)}")
    run_of_tok = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    expected = torch.arange(seg.numel()) - starts[run_of_tok] + lp[run_of_tok]
    wrong = ((seg != PAD_SEGMENT) & (pos != expected)).nonzero()
    if wrong.numel():
        j = int(wrong[0])
        r, s = int(run_row[run_of_tok[j]]), int(seg[j])
        raise LayoutError(
            f"row {r} segment {s}: position_ids[{j}] = {int(pos[j])}, expected {int(expected[j])} (q counts from 0 "
            f"and every call block continues from len(q); other positions would merge segments or shift RoPE -- "
            f"were restored positions recomputed as 0..L-1?)"
        )


def padded_batch_segments(
    segment_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: Optional[torch.Tensor] = None,
    unpad: bool = False,
) -> SegmentMeta:
    """Metadata for a padded verl micro-batch (left-padded prompt, right-padded response).

    Args:
        segment_ids: (B, L) int -- ``PackedRow.segment_ids`` placed at the row's real tokens.
        attention_mask: (B, L) 0/1 -- 1 at real tokens (verl's ``attention_mask``).
        position_ids: optional (B, L) restored positions, checked at real tokens.
        unpad: False -> metadata for the padded ``B * L`` stream (each padding run isolated);
            True -> for the stream of real tokens in row-major order (verl's remove-padding stream).
    """
    if segment_ids.dim() != 2 or segment_ids.shape != attention_mask.shape:
        raise LayoutError(
            f"segment_ids and attention_mask must be equal (B, L) tensors, got "
            f"{tuple(segment_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    real = attention_mask.bool().cpu()
    seg = torch.where(real, segment_ids.long().cpu(), PAD_SEGMENT)
    row = torch.arange(seg.shape[0]).unsqueeze(1).expand_as(seg)
    pos = None if position_ids is None else position_ids.long().cpu()
    if unpad:
        return segment_meta(seg[real], row[real], None if pos is None else pos[real])
    return segment_meta(seg.reshape(-1), row.reshape(-1), None if pos is None else pos.reshape(-1))
