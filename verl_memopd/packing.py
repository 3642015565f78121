"""Layouts: invocation records -> physical token sequences (stage 2). Positions are restored here.

``packed`` (MemOPD) -- one physical row per episode, the shared prefix ``q`` stored once::

    tokens     q0 q1 q2 | x0 x0 a0 a0 | x1 x1 x1 a1      (P=3; call blocks B_1, B_2)
    positions   0  1  2 |  3  4  5  6 |  3  4  5  6      each block continues from P
    segment     0  0  0 |  1  1  1  1 |  2  2  2  2      0 = q, t+1 = call t
    resp_mask   -  -  - |  0  0  1  1 |  0  0  0  1      1 where the policy sampled (m_act)

Visibility (row = query, column = key; 1 = may attend)::

              q0 q1 q2 x0 x0 a0 a0 x1 x1 x1 a1
        q2     1  1  1  .  .  .  .  .  .  .  .
        a0     1  1  1  1  1  1  .  .  .  .  .      B_1 sees all of q and its own past
        x1     1  1  1  .  .  .  .  1  .  .  .      B_2 never sees B_1
        a1     1  1  1  .  .  .  .  1  1  1  1

verl convention: prompt = ``q``, response = the blocks, and the token at physical index ``j`` is
predicted by the logits at ``j - 1``; so a call ``t >= 1`` must have a non-empty context ``x_t``
(else its first action token would be predicted from the previous call's block): refused here.

Layouts (registry ``build_layout(name, episodes)``), all built from the same records and listing
the action tokens in the same ``(episode, call, k)`` order:

- ``packed``: one stream (B=1) of all episodes' packed rows; needs segment attention.
- ``per_call``: one right-padded row per invocation, ``[q ; x_t ; a_t]``, positions 0..L-1
  (state-correct, ``q`` repeated: the MemAgent-style speed baseline); plain causal rows.
- ``per_call_varlen``: the same rows unpadded in one stream (the varlen form of ``per_call``).
- ``flat``: one right-padded row per episode with the same tokens as ``packed``, positions 0..L-1
  and plain causal attention (the persistent-history baseline; what stock verl does with the row).

Attention metadata is a :class:`SegmentMeta` over the flattened ``B * L`` token stream: each
query segment attends causally, bottom-right aligned, to its gathered keys (see its docstring).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from verl_memopd.records import Episode, RecordError

__all__ = [
    "PackedRow", "pack_episode", "LayoutError", "SegmentMeta", "segment_meta", "packed_rows_segments",
    "padded_batch_segments", "BatchLayout", "register_layout", "build_layout", "layout_names",
    "PAD_ID", "PAD_SEGMENT",
]

#: Token id used to right-pad rows of padded layouts. Any id works: right padding is never
#: visible to real tokens under causal attention, and pad positions predict nothing.
PAD_ID = 0
#: Segment id of padding tokens in :func:`segment_meta`: each padding run is isolated.
PAD_SEGMENT = -1


class LayoutError(ValueError):
    """A layout or attention metadata that would break a call's state (leak, merge, misalign)."""


@dataclass(frozen=True)
class PackedRow:
    """One episode as one verl row (see module docstring). Lengths: P prompt, R response.

    Attributes:
        prompt_ids: (P,) the shared prefix ``q``.
        response_ids: (R,) the call blocks ``[x_0 a_0 | x_1 a_1 | ...]`` concatenated.
        response_mask: (R,) 1 where the token was sampled by the policy (m_act), else 0.
        teacher_mask: (R,) 1 where the teacher supervises (m_T <= m_act).
        response_logprobs: (R,) rollout log-probs at sampled tokens, 0.0 at context tokens.
        position_ids: (P + R,) restored positions: 0..P-1 for q, each block continuing from P.
        segment_ids: (P + R,) 0 for q, t + 1 for the tokens of call t.
    """

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    response_mask: tuple[int, ...]
    teacher_mask: tuple[int, ...]
    response_logprobs: tuple[float, ...]
    position_ids: tuple[int, ...]
    segment_ids: tuple[int, ...]


def pack_episode(episode: Episode) -> PackedRow:
    """Build the ``packed`` row of an episode: ``q`` once, then each call's block."""
    p = episode.prefix_len
    resp, rmask, tmask, lps = [], [], [], []
    pos, seg = list(range(p)), [0] * p
    for t, inv in enumerate(episode.invocations):
        ctx = episode.context_ids(t)
        if t > 0 and not ctx:
            raise RecordError(
                f"episode {episode.episode_id!r} call {t}: empty context x_t after the prefix; in a packed "
                f"row its first action token would be predicted from call {t - 1}'s block"
            )
        block_len = len(ctx) + len(inv.response_ids)
        resp += list(ctx) + list(inv.response_ids)
        rmask += [0] * len(ctx) + [int(m) for m in inv.action_mask]
        tmask += [0] * len(ctx) + [int(m) for m in inv.teacher_mask]
        lps += [0.0] * len(ctx) + list(inv.response_logprobs)
        pos += list(range(p, p + block_len))
        seg += [t + 1] * block_len
    return PackedRow(episode.prefix_ids, tuple(resp), tuple(rmask), tuple(tmask), tuple(lps), tuple(pos), tuple(seg))


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
        for name, t, dt in (("cu_seqlens_q", cq, torch.int32), ("cu_seqlens_k", ck, torch.int32),
                            ("key_index", ki, torch.int64)):
            if t.dtype != dt or t.dim() != 1:
                raise LayoutError(f"SegmentMeta.{name} must be 1-D {dt}, got {t.dtype} with shape {tuple(t.shape)}")
        if cq.numel() != ck.numel() or cq.numel() < 2 or cq[0] != 0 or ck[0] != 0:
            raise LayoutError(f"SegmentMeta: cu_seqlens_q/k must both be (S + 1,) with S >= 1, starting at 0; "
                              f"got {cq.numel()} and {ck.numel()} entries")
        lq, lk = cq.diff().long(), ck.diff().long()
        n = int(cq[-1])
        if (lq <= 0).any() or (lk < lq).any():
            raise LayoutError("SegmentMeta: every segment needs >= 1 query and at least as many keys as queries")
        if ki.numel() != int(ck[-1]) or (ki.numel() and (ki.min() < 0 or ki.max() >= n)):
            raise LayoutError(f"SegmentMeta.key_index must hold cu_seqlens_k[-1] = {int(ck[-1])} indices in [0, {n})")
        if (self.max_seqlen_q, self.max_seqlen_k) != (int(lq.max()), int(lk.max())):
            raise LayoutError(f"SegmentMeta: max_seqlen_q/k = {self.max_seqlen_q}/{self.max_seqlen_k}, "
                              f"segments say {int(lq.max())}/{int(lk.max())}")
        seg_of_tok = torch.repeat_interleave(torch.arange(lq.numel(), device=lq.device), lq)
        own_slot = (ck[1:] - cq[1:]).long()[seg_of_tok] + torch.arange(n, device=lq.device)
        if not torch.equal(ki[own_slot], torch.arange(n, device=ki.device)):
            raise LayoutError("SegmentMeta: the last Lq keys of a segment must be its own queries, in order "
                              "(bottom-right causal alignment)")

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
        return SegmentMeta(self.cu_seqlens_q.to(device), self.cu_seqlens_k.to(device), self.key_index.to(device),
                           self.max_seqlen_q, self.max_seqlen_k)


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
            f"contiguous runs in increasing order (a split or repeated segment would merge two calls' states)")


def segment_meta(segment_ids: torch.Tensor, row_ids: torch.Tensor,
                 position_ids: Optional[torch.Tensor] = None) -> SegmentMeta:
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
        raise LayoutError(f"segment_ids and row_ids must be equal non-empty 1-D tensors, got "
                          f"{tuple(seg.shape)} and {tuple(row.shape)}")
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
        raise LayoutError(f"row {int(run_row[i])} segment {int(run_seg[i])} (call {int(run_seg[i]) - 1}) has no "
                          f"shared prefix (segment 0) in its row")
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


def _check_positions(pos: torch.Tensor, seg: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                     lp: torch.Tensor, run_row: torch.Tensor) -> None:
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
            f"were restored positions recomputed as 0..L-1?)")


def packed_rows_segments(rows: Sequence[PackedRow]) -> SegmentMeta:
    """Metadata for verl rows concatenated unpadded into one stream of N = sum(P + R) tokens."""
    seg = torch.tensor([s for r in rows for s in r.segment_ids])
    row = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([len(r.segment_ids) for r in rows]))
    return segment_meta(seg, row, torch.tensor([p for r in rows for p in r.position_ids]))


def padded_batch_segments(segment_ids: torch.Tensor, attention_mask: torch.Tensor,
                          position_ids: Optional[torch.Tensor] = None, unpad: bool = False) -> SegmentMeta:
    """Metadata for a padded verl micro-batch (left-padded prompt, right-padded response).

    Args:
        segment_ids: (B, L) int -- ``PackedRow.segment_ids`` placed at the row's real tokens.
        attention_mask: (B, L) 0/1 -- 1 at real tokens (verl's ``attention_mask``).
        position_ids: optional (B, L) restored positions, checked at real tokens.
        unpad: False -> metadata for the padded ``B * L`` stream (each padding run isolated);
            True -> for the stream of real tokens in row-major order (verl's remove-padding stream).
    """
    if segment_ids.dim() != 2 or segment_ids.shape != attention_mask.shape:
        raise LayoutError(f"segment_ids and attention_mask must be equal (B, L) tensors, got "
                          f"{tuple(segment_ids.shape)} and {tuple(attention_mask.shape)}")
    real = attention_mask.bool().cpu()
    seg = torch.where(real, segment_ids.long().cpu(), PAD_SEGMENT)
    row = torch.arange(seg.shape[0]).unsqueeze(1).expand_as(seg)
    pos = None if position_ids is None else position_ids.long().cpu()
    if unpad:
        return segment_meta(seg[real], row[real], None if pos is None else pos[real])
    return segment_meta(seg.reshape(-1), row.reshape(-1), None if pos is None else pos.reshape(-1))


# --- layouts --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchLayout:
    """A batch of episodes laid out for one forward pass. Shapes: B rows of L tokens, A action tokens.

    Attributes:
        name: the layout's registry name.
        input_ids: (B, L) int64 token ids (``PAD_ID`` at padding).
        position_ids: (B, L) int64 -- restored (``packed``) or 0..L-1 per row.
        valid_mask: (B, L) bool -- True at real tokens, False at padding.
        segments: attention metadata over the flattened ``B * L`` stream.
        action_mask: (B, L) bool -- True at position ``j`` when token ``j + 1`` is an action token
            (m_act): aligned to the *predicting* position, as verl's log-prob of response token j.
        teacher_mask: (B, L) bool, <= action_mask -- the same for teacher-supervised tokens (m_T).
        action_origin: (A, 3) int64 -- ``(episode, call, k)`` of every action token, in stream order;
            ``k`` indexes the call's ``response_ids``. The same order in every layout.
        action_index: (derived) (A,) int64 -- flat ``B * L`` index of the predicting position g(t, k).
        action_ids: (derived) (A,) int64 -- the action token ids (targets).
        needs_segment_attention: (derived) False only when every row is one plain causal sequence,
            so any causal attention implementation executes the layout exactly.
    """

    name: str
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    valid_mask: torch.Tensor
    segments: SegmentMeta
    action_mask: torch.Tensor
    teacher_mask: torch.Tensor
    action_origin: torch.Tensor
    action_index: torch.Tensor = field(init=False, repr=False)
    action_ids: torch.Tensor = field(init=False, repr=False)
    needs_segment_attention: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        shape = tuple(self.input_ids.shape)
        for name in ("input_ids", "position_ids", "valid_mask", "action_mask", "teacher_mask"):
            if len(shape) != 2 or tuple(getattr(self, name).shape) != shape:
                raise LayoutError(f"layout {self.name!r}: {name} must have the (B, L) shape {shape}")
        b, l = shape
        if self.segments.num_tokens != b * l:
            raise LayoutError(f"layout {self.name!r}: segments cover {self.segments.num_tokens} tokens, "
                              f"not B*L = {b * l}")
        if (self.teacher_mask & ~self.action_mask).any():
            raise LayoutError(f"layout {self.name!r}: teacher_mask must satisfy m_T <= m_act")
        index = self.action_mask.reshape(-1).nonzero().squeeze(1)
        if tuple(self.action_origin.shape) != (index.numel(), 3):
            raise LayoutError(f"layout {self.name!r}: action_origin has shape {tuple(self.action_origin.shape)}, "
                              f"expected ({index.numel()}, 3)")
        self._check_predictors(index)
        object.__setattr__(self, "action_index", index)
        object.__setattr__(self, "action_ids", self.input_ids.reshape(-1)[index + 1])
        rows_plain = self.segments.keys_are_queries and torch.equal(
            self.segments.cu_seqlens_q.long(), torch.arange(b + 1) * l)
        object.__setattr__(self, "needs_segment_attention", not rows_plain)

    def _check_predictors(self, index: torch.Tensor) -> None:
        """Every action token's predicting position must be the key just before it in its own state."""
        meta, target = self.segments, index + 1
        ok = (index % self.input_ids.shape[1]) < self.input_ids.shape[1] - 1  # target in the same row
        target = torch.where(ok, target, index)
        valid = self.valid_mask.reshape(-1)
        s = meta.segment_of_tokens()[target]
        slot = (meta.cu_seqlens_k[1:] - meta.cu_seqlens_q[1:]).long()[s] + target - 1
        ok &= valid[index] & valid[target] & (slot >= meta.cu_seqlens_k[:-1].long()[s])
        ok &= meta.key_index[slot.clamp(min=0)] == index
        bad = (~ok).nonzero()
        if bad.numel():
            a = int(bad[0])
            e, c, k = self.action_origin[a].tolist()
            raise LayoutError(
                f"layout {self.name!r}: action token (episode {e}, call {c}, k {k}) would be predicted from stream "
                f"position {int(index[a])}, which is not the last token of its own state (a leak between calls)")


class _Row(NamedTuple):
    """One physical row before assembly: per-token lists, plus ``(episode, call, k)`` per action token."""

    ids: list
    pos: list
    seg: list
    act: list
    teach: list
    origin: list


def _episode_row(ep: Episode, e: int) -> _Row:
    row = pack_episode(ep)
    p = ep.prefix_len
    origin = [(e, t, k) for t, inv in enumerate(ep.invocations) for k, m in enumerate(inv.action_mask) if m]
    return _Row(list(row.prompt_ids + row.response_ids), list(row.position_ids), list(row.segment_ids),
                [0] * p + list(row.response_mask), [0] * p + list(row.teacher_mask), origin)


def _plain(row: _Row) -> _Row:
    """The same tokens as one plain causal sequence: positions 0..L-1, one segment."""
    return row._replace(pos=list(range(len(row.ids))), seg=[0] * len(row.ids))


def _calls(row: _Row, ep: Episode) -> list[_Row]:
    """One row ``[q ; block_t]`` per call of an episode's packed row."""
    p, out, origin = ep.prefix_len, [], list(row.origin)
    for t, inv in enumerate(ep.invocations):
        idx = list(range(p)) + [j for j, s in enumerate(row.seg) if s == t + 1]
        n_act = sum(inv.action_mask)
        out.append(_plain(_Row([row.ids[j] for j in idx], [], [], [row.act[j] for j in idx],
                               [row.teach[j] for j in idx], origin[:n_act])))
        origin = origin[n_act:]
    return out


_LAYOUTS: dict[str, tuple[Callable[[Sequence[Episode]], list[_Row]], bool]] = {}


def register_layout(name: str, padded: bool) -> Callable:
    """Register ``fn(episodes) -> rows`` as layout ``name``; ``padded`` rows become (B, L), else one stream."""
    def deco(fn: Callable[[Sequence[Episode]], list[_Row]]) -> Callable:
        if name in _LAYOUTS:
            raise ValueError(f"layout {name!r} is already registered")
        _LAYOUTS[name] = (fn, padded)
        return fn
    return deco


def layout_names() -> tuple[str, ...]:
    return tuple(sorted(_LAYOUTS))


@register_layout("packed", padded=False)
def _packed(episodes: Sequence[Episode]) -> list[_Row]:
    return [_episode_row(ep, e) for e, ep in enumerate(episodes)]


@register_layout("flat", padded=True)
def _flat(episodes: Sequence[Episode]) -> list[_Row]:
    return [_plain(_episode_row(ep, e)) for e, ep in enumerate(episodes)]


@register_layout("per_call", padded=True)
def _per_call(episodes: Sequence[Episode]) -> list[_Row]:
    return [r for e, ep in enumerate(episodes) for r in _calls(_episode_row(ep, e), ep)]


@register_layout("per_call_varlen", padded=False)
def _per_call_varlen(episodes: Sequence[Episode]) -> list[_Row]:
    return _per_call(episodes)


def build_layout(name: str, episodes: Sequence[Episode], vocab_size: Optional[int] = None) -> BatchLayout:
    """Lay out ``episodes`` (validated; ids checked against ``vocab_size`` when given) as layout ``name``."""
    if name not in _LAYOUTS:
        raise KeyError(f"unknown layout {name!r}; valid layouts: {', '.join(layout_names())}")
    if not episodes or not all(isinstance(ep, Episode) for ep in episodes):
        raise LayoutError(f"layout {name!r}: needs a non-empty sequence of Episode records")
    if vocab_size is not None:
        for ep in episodes:
            ep.validate_vocab(vocab_size)
    fn, padded = _LAYOUTS[name]
    return _assemble(name, fn(episodes), padded)


def _assemble(name: str, rows: list[_Row], padded: bool) -> BatchLayout:
    lens = [len(r.ids) for r in rows]
    if padded:
        b, l = len(rows), max(lens)
        out = {k: torch.zeros(b, l, dtype=torch.long) for k in ("ids", "seg", "act", "teach")}
        out["ids"].fill_(PAD_ID)
        out["pos"] = torch.arange(l).repeat(b, 1)
        valid = torch.arange(l) < torch.tensor(lens).unsqueeze(1)
        for i, r in enumerate(rows):
            for k in ("ids", "pos", "seg", "act", "teach"):
                out[k][i, : lens[i]] = torch.tensor(getattr(r, k))
        row_ids = torch.arange(b).unsqueeze(1).expand(b, l)
    else:
        out = {k: torch.tensor([x for r in rows for x in getattr(r, k)]).unsqueeze(0)
               for k in ("ids", "pos", "seg", "act", "teach")}
        valid = torch.ones_like(out["ids"], dtype=torch.bool)
        row_ids = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lens)).unsqueeze(0)
    pred = {k: torch.zeros_like(out[k], dtype=torch.bool) for k in ("act", "teach")}
    for k in pred:
        pred[k][:, :-1] = out[k][:, 1:].bool()
    origin = torch.tensor([o for r in rows for o in r.origin], dtype=torch.long).reshape(-1, 3)
    meta = segment_meta(out["seg"].reshape(-1), row_ids.reshape(-1), out["pos"].reshape(-1))
    return BatchLayout(name, out["ids"], out["pos"], valid, meta, pred["act"], pred["teach"], origin)
