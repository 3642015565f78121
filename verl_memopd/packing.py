"""Layouts: invocation records -> physical token sequences (stage 2). Positions are restored here.

``packed`` (MemOPD) -- one physical row per episode, the shared prefix ``q`` stored once::

    tokens     q0 q1 q2 | x0 x0 a0 a0 | x1 x1 x1 a1      (P=3; call blocks B_1, B_2)
    positions   0  1  2 |  3  4  5  6 |  3  4  5  6      each block continues from P
    segment     0  0  0 |  1  1  1  1 |  2  2  2  2      0 = q, t+1 = call t
    resp_mask   -  -  - |  0  0  1  1 |  0  0  0  1      1 where the policy sampled (m_act)

Visibility: ``q`` is causal within ``q``; a block token sees all of ``q`` and its own block
causally, never another block. verl convention: prompt = ``q``, response = the blocks, and
the token at physical index ``j`` is predicted by the logits at ``j - 1``; so a call ``t >= 1``
must have a non-empty context ``x_t`` (else its first action token would be predicted from the
previous call's block), which is refused here.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl_memopd.records import Episode, RecordError

__all__ = ["PackedRow", "pack_episode"]


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
