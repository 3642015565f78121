"""Layouts: invocation records -> physical token sequences (stage 2). Positions are restored here.

``packed`` (MemOPD) -- one physical row per episode, the shared prefix ``q`` stored once::

    tokens     q0 q1 q2 | x0 x0 a0 a0 | x1 x1 x1 a1      (P=3; call blocks B_1, B_2)
    positions   0  1  2 |  3  4  5  6 |  3  4  5  6      each block continues from P
    segment     0  0  0 |  1  1  1  1 |  2  2  2  2      0 = q, t+1 = call t
    resp_mask   -  -  - |  0  0  1  1 |  0  0  0  1      1 where the policy sampled (m_act)

verl convention: prompt = ``q``, response = the blocks, and the token at physical index ``j`` is
predicted by the logits at ``j - 1``; so a call ``t >= 1`` must have a non-empty context ``x_t``
(else its first action token would be predicted from the previous call's block): refused here.

Layouts (registry ``build_layout(name, episodes, options=LayoutOptions())``), all built from the same
records and listing the action tokens in the same ``(episode, call, k)`` order:

- ``packed``: one stream (B=1) of all episodes' packed rows; needs segment attention.
- ``per_call``: one right-padded row per invocation, ``[q ; x_t ; a_t]``, positions 0..L-1
  (state-correct, ``q`` repeated: the MemAgent-style speed baseline); plain causal rows.
- ``per_call_varlen``: the same rows unpadded in one stream (the varlen form of ``per_call``).
- ``flat``: one right-padded row per episode, positions 0..L-1 and plain causal attention: the
  persistent history. Its tokens are ``packed``'s with the turn separator
  (``LayoutOptions.flat_separator_ids``, e.g. ChatML's ``\\n``) inserted before every call block
  ``t >= 1`` at action and teacher mask 0, so the history reads as the chat template writes
  consecutive turns; with no separator (the default ``()``) exactly ``packed``'s tokens (what stock
  verl does with the row)::

      tokens   q0 q1 q2 | x0 x0 a0 a0 | s | x1 x1 x1 a1      (one separator token s)
      act       0  0  0 |  0  0  1  1 | 0 |  0  0  0  1

Attention metadata (segment visibility, checks of restored positions) is built in
``verl_memopd.segments``: a layout's ``segments`` is a :class:`~verl_memopd.segments.SegmentMeta` over
the ``B * L`` token stream (rows concatenated), and :func:`packed_rows_segments` gives it for packed rows.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from verl_memopd.records import Episode, RecordError
from verl_memopd.registry import Registry
from verl_memopd.segments import LayoutError, SegmentMeta, segment_meta

__all__ = [
    "PackedRow",
    "pack_episode",
    "packed_rows_segments",
    "BatchLayout",
    "LayoutOptions",
    "register_layout",
    "build_layout",
    "layout_names",
    "PAD_ID",
]

#: Token id used to right-pad rows of padded layouts. Any id works: right padding is never
#: visible to real tokens under causal attention, and pad positions predict nothing.
PAD_ID = 0


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


def packed_rows_segments(rows: Sequence[PackedRow]) -> SegmentMeta:
    """Metadata for verl rows concatenated unpadded into one stream of N = sum(P + R) tokens."""
    seg = torch.tensor([s for r in rows for s in r.segment_ids])
    row = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([len(r.segment_ids) for r in rows]))
    return segment_meta(seg, row, torch.tensor([p for r in rows for p in r.position_ids]))


# --- layouts --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchLayout:
    """A batch of episodes laid out for one forward pass. Shapes: B rows of L tokens, A action tokens.

    Attributes:
        name: the layout's registry name.
        input_ids: (B, L) int64 token ids (``PAD_ID`` at padding).
        position_ids: (B, L) int64 -- restored (``packed``) or 0..L-1 per row.
        valid_mask: (B, L) bool -- True at real tokens, False at padding.
        segments: attention metadata over the ``B * L`` stream (rows concatenated).
        action_mask: (B, L) bool -- True at position ``j`` when token ``j + 1`` is an action token
            (m_act): aligned to the *predicting* position, as verl's log-prob of response token j.
        teacher_mask: (B, L) bool, <= action_mask -- the same for teacher-supervised tokens (m_T).
        action_origin: (A, 3) int64 -- ``(episode, call, k)`` of every action token, in stream order;
            ``k`` indexes the call's ``response_ids``. The same order in every layout.
        action_index: (derived) (A,) int64 -- index into the ``B * L`` stream of the predicting position g(t, k).
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
        b, length = shape
        if self.segments.num_tokens != b * length:
            raise LayoutError(
                f"layout {self.name!r}: segments cover {self.segments.num_tokens} tokens, not B*L = {b * length}"
            )
        if (self.teacher_mask & ~self.action_mask).any():
            raise LayoutError(f"layout {self.name!r}: teacher_mask must satisfy m_T <= m_act")
        index = self.action_mask.reshape(-1).nonzero().squeeze(1)
        if tuple(self.action_origin.shape) != (index.numel(), 3):
            raise LayoutError(
                f"layout {self.name!r}: action_origin has shape {tuple(self.action_origin.shape)}, "
                f"expected ({index.numel()}, 3)"
            )
        self._check_predictors(index)
        object.__setattr__(self, "action_index", index)
        object.__setattr__(self, "action_ids", self.input_ids.reshape(-1)[index + 1])
        rows_plain = self.segments.keys_are_queries and torch.equal(
            self.segments.cu_seqlens_q.long(), torch.arange(b + 1) * length
        )
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
                f"position {int(index[a])}, which is not the last token of its own state (a leak between calls)"
            )


class _Row(NamedTuple):
    """One physical row before assembly: per-token lists, plus ``(episode, call, k)`` per action token."""

    ids: list
    pos: list
    seg: list
    act: list
    teach: list
    origin: list


#: the per-token columns of a :class:`_Row`
_COLUMNS = ("ids", "pos", "seg", "act", "teach")


def _episode_row(ep: Episode, e: int) -> _Row:
    row = pack_episode(ep)
    p = ep.prefix_len
    origin = [(e, t, k) for t, inv in enumerate(ep.invocations) for k, m in enumerate(inv.action_mask) if m]
    return _Row(
        list(row.prompt_ids + row.response_ids),
        list(row.position_ids),
        list(row.segment_ids),
        [0] * p + list(row.response_mask),
        [0] * p + list(row.teacher_mask),
        origin,
    )


def _separated(row: _Row, separator: tuple[int, ...]) -> _Row:
    """An episode's packed ``row`` with ``separator`` inserted before every call block ``t >= 1`` (where
    the segment id turns to ``t + 1 >= 2``), at action and teacher mask 0, taking the following block's
    position and segment; the action tokens and their ``origin`` order are unchanged."""
    out, n = _Row([], [], [], [], [], list(row.origin)), len(separator)
    for j in range(len(row.ids)):
        if n and row.seg[j] > 1 and row.seg[j] != row.seg[j - 1]:
            inserted = (separator, [row.pos[j]] * n, [row.seg[j]] * n, [0] * n, [0] * n)
            for name, values in zip(_COLUMNS, inserted):
                getattr(out, name).extend(values)
        for name in _COLUMNS:
            getattr(out, name).append(getattr(row, name)[j])
    return out


def _plain(row: _Row) -> _Row:
    """The same tokens as one plain causal sequence: positions 0..L-1, one segment."""
    return row._replace(pos=list(range(len(row.ids))), seg=[0] * len(row.ids))


def _calls(row: _Row, ep: Episode) -> list[_Row]:
    """One row ``[q ; block_t]`` per call of an episode's packed row."""
    p, out, origin = ep.prefix_len, [], list(row.origin)
    for t, inv in enumerate(ep.invocations):
        idx = list(range(p)) + [j for j, s in enumerate(row.seg) if s == t + 1]
        n_act = sum(inv.action_mask)
        out.append(
            _plain(
                _Row(
                    [row.ids[j] for j in idx],
                    [],
                    [],
                    [row.act[j] for j in idx],
                    [row.teach[j] for j in idx],
                    origin[:n_act],
                )
            )
        )
        origin = origin[n_act:]
    return out


@dataclass(frozen=True)
class LayoutOptions:
    """Options a layout may read (``build_layout(..., options=)``); each layout documents the ones it uses.

    Attributes:
        flat_separator_ids: the ``flat`` layout's turn separator, inserted before every call block
            ``t >= 1`` (ChatML: the ids of ``"\\n"``); ``()`` = blocks joined as they are.
    """

    flat_separator_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # operator.index: integers (numpy's included) only, a float is refused rather than truncated
        object.__setattr__(self, "flat_separator_ids", tuple(operator.index(i) for i in self.flat_separator_ids))

    def validate_vocab(self, vocab_size: int) -> None:
        bad = [i for i in self.flat_separator_ids if not 0 <= i < vocab_size]
        if bad:
            raise LayoutError(f"flat_separator_ids {bad} outside the vocabulary [0, {vocab_size})")


#: ``fn(episodes, options) -> rows`` of a registered layout
LayoutRows = Callable[[Sequence[Episode], LayoutOptions], list[_Row]]


class _Layout(NamedTuple):
    """A registered layout: ``rows(episodes, options)``; ``padded`` rows become (B, L), else one stream."""

    rows: LayoutRows
    padded: bool


_LAYOUTS = Registry("layout")


def register_layout(name: str, padded: bool) -> Callable:
    """Register ``fn(episodes, options) -> rows`` as layout ``name``; ``padded`` rows become (B, L), else one
    stream."""

    def deco(fn: LayoutRows) -> LayoutRows:
        _LAYOUTS.add(name, _Layout(fn, padded))
        return fn

    return deco


def layout_names() -> tuple[str, ...]:
    return tuple(sorted(_LAYOUTS))


@register_layout("packed", padded=False)
def _packed(episodes: Sequence[Episode], options: LayoutOptions) -> list[_Row]:
    return [_episode_row(ep, e) for e, ep in enumerate(episodes)]


@register_layout("flat", padded=True)
def _flat(episodes: Sequence[Episode], options: LayoutOptions) -> list[_Row]:
    """The persistent history: each episode's packed row, separated (``options.flat_separator_ids``), as one
    plain causal sequence."""
    return [_plain(_separated(_episode_row(ep, e), options.flat_separator_ids)) for e, ep in enumerate(episodes)]


@register_layout("per_call", padded=True)
def _per_call(episodes: Sequence[Episode], options: LayoutOptions) -> list[_Row]:
    return [r for e, ep in enumerate(episodes) for r in _calls(_episode_row(ep, e), ep)]


@register_layout("per_call_varlen", padded=False)
def _per_call_varlen(episodes: Sequence[Episode], options: LayoutOptions) -> list[_Row]:
    return _per_call(episodes, options)


def build_layout(
    name: str, episodes: Sequence[Episode], vocab_size: Optional[int] = None, options: LayoutOptions = LayoutOptions()
) -> BatchLayout:
    """Lay out ``episodes`` (validated; ids, the options' included, checked against ``vocab_size`` when given)
    as layout ``name``, reading ``options``."""
    layout = _LAYOUTS.lookup(name)
    if not episodes or not all(isinstance(ep, Episode) for ep in episodes):
        raise LayoutError(f"layout {name!r}: needs a non-empty sequence of Episode records")
    if vocab_size is not None:
        for ep in episodes:
            ep.validate_vocab(vocab_size)
        options.validate_vocab(vocab_size)
    return _assemble(name, layout.rows(episodes, options), layout.padded)


def _assemble(name: str, rows: list[_Row], padded: bool) -> BatchLayout:
    lens = [len(r.ids) for r in rows]
    if padded:
        b, length = len(rows), max(lens)
        out = {k: torch.zeros(b, length, dtype=torch.long) for k in ("ids", "seg", "act", "teach")}
        out["ids"].fill_(PAD_ID)
        out["pos"] = torch.arange(length).repeat(b, 1)
        valid = torch.arange(length) < torch.tensor(lens).unsqueeze(1)
        for i, r in enumerate(rows):
            for k in ("ids", "pos", "seg", "act", "teach"):
                out[k][i, : lens[i]] = torch.tensor(getattr(r, k))
        row_ids = torch.arange(b).unsqueeze(1).expand(b, length)
    else:
        out = {
            k: torch.tensor([x for r in rows for x in getattr(r, k)]).unsqueeze(0)
            for k in ("ids", "pos", "seg", "act", "teach")
        }
        valid = torch.ones_like(out["ids"], dtype=torch.bool)
        row_ids = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lens)).unsqueeze(0)
    pred = {k: torch.zeros_like(out[k], dtype=torch.bool) for k in ("act", "teach")}
    for k in pred:
        pred[k][:, :-1] = out[k][:, 1:].bool()
    origin = torch.tensor([o for r in rows for o in r.origin], dtype=torch.long).reshape(-1, 3)
    meta = segment_meta(out["seg"].reshape(-1), row_ids.reshape(-1), out["pos"].reshape(-1))
    return BatchLayout(name, out["ids"], out["pos"], valid, meta, pred["act"], pred["teach"], origin)
