"""Restore every row's MemOPD layout in TransferQueue before the first forward of a step.

verl's V1 agent-loop worker stores each row with ``position_ids = 0..L-1`` (it recomputes them
from the attention mask) and keeps the agent's ``extra_fields`` as they came. The memory agent
records the exact layout there (``verl_memopd.agent.loop``); :func:`restore_layout` rewrites,
for the step's keys, the fields every later forward reads (actor, ref, critic, teacher)::

    position_ids          (P + R,) restored positions      | flat layout: 0..P+R-1 (verl's own)
    memopd_segment_ids    (P + R,) 0 = q, t+1 = call t      | flat layout: all 0 (one causal segment)
    memopd_teacher_mask   (R,) m_T per response token: the agent's, restricted by ``memopd.distill.teacher_mask``
                          (action: as recorded; answer: the last call's tokens; memory: the other calls')
    memopd_call_index     (R,) call t of each response token (per-invocation metrics)
    memopd_calls_alone    () 1 under the per_call layout (the packed fields, executed call by call,
                          calls.py), else 0 -- always written, so re-laying out a step's rows (the
                          teacher's flat pass, audits) never leaves a stale flag behind
    memopd_prompt_group   () the row's prompt group: index of verl's uid among the step's uids
                          (-1: never share q; groups.py)

The trainer may lay the same rows out twice in a step: ``memopd.teacher.state=flat`` (or an audit)
has the teacher score the flat layout, then restores the student's layout for reference and critic.

verl's synthetic padding rows (tag ``is_padding``; appended when the batch does not divide into the
data-parallel / mini-batch sizes) copy the first real row's ``extra_fields``; they get a plain
layout and an all-zero teacher mask instead, so they never carry teacher supervision.

It also reports what sharing ``q`` saves: the packed row holds ``P + R`` tokens, running the calls
one by one would take ``sum_t (|prompt_t| + |response_t|)`` (``memopd/*`` metrics of the step).
"""

from __future__ import annotations

import torch
import transfer_queue as tq
from verl.utils.tensordict_utils import list_of_dict_to_tensordict

from verl_memopd.fields import CALL_INDEX, CALLS_ALONE, EPISODE, POSITION_IDS, PROMPT_GROUP, SEGMENT_IDS, TEACHER_MASK


class MemopdRowError(ValueError):
    """A row that does not carry a MemOPD episode layout."""


def layout_fields(
    prompt_len: int, response_len: int, extra: dict, layout: str, where: str, teacher_mask_policy: str = "action"
) -> dict:
    """The restored fields of one row (``extra``: its agent-loop ``extra_fields``) under ``layout``; the
    teacher mask restricted to the calls ``teacher_mask_policy`` names (config.TEACHER_MASK_POLICIES)."""
    missing = [k for k in (POSITION_IDS, SEGMENT_IDS, TEACHER_MASK) if k not in extra]
    if missing:
        raise MemopdRowError(
            f"{where}: no {missing} in extra_fields; MemOPD rows come from the memory agent "
            f"(agent_name memopd_memory_agent) or another agent that records its episode"
        )
    p, r = prompt_len, response_len
    segments = torch.tensor(extra[SEGMENT_IDS], dtype=torch.int64)
    positions = torch.tensor(extra[POSITION_IDS], dtype=torch.int64)
    teacher_mask = torch.tensor(extra[TEACHER_MASK], dtype=torch.int64)
    if segments.numel() != p + r or positions.numel() != p + r or teacher_mask.numel() != r:
        raise MemopdRowError(
            f"{where}: layout lengths (positions {positions.numel()}, segments {segments.numel()}, "
            f"teacher mask {teacher_mask.numel()}) do not match prompt {p} + response {r}"
        )
    calls = (segments[p:] - 1).clamp(min=0)
    teacher_mask = teacher_mask * _supervised_calls(calls, teacher_mask_policy, where)
    if layout == "flat":
        positions, segments = torch.arange(p + r), torch.zeros(p + r, dtype=torch.int64)
    fields = {"position_ids": positions, SEGMENT_IDS: segments, TEACHER_MASK: teacher_mask, CALL_INDEX: calls}
    return _execution(fields, layout)


def _supervised_calls(calls: torch.Tensor, policy: str, where: str) -> torch.Tensor:
    """(R,) int64: 1 on the response tokens of the calls ``policy`` lets the teacher supervise."""
    if policy == "action":
        return torch.ones_like(calls)
    last = calls == calls.max()
    if policy == "answer":
        return last.long()
    if policy == "memory":
        return (~last).long()
    raise MemopdRowError(f"{where}: memopd.distill.teacher_mask={policy!r}: expected action, answer or memory")


def padding_fields(prompt_len: int, response_len: int, layout: str) -> dict:
    """The fields of a verl padding row: positions 0..L-1, one causal segment, no teacher tokens."""
    n = prompt_len + response_len
    zeros = torch.zeros(response_len, dtype=torch.int64)
    return _execution(
        {
            "position_ids": torch.arange(n),
            SEGMENT_IDS: torch.zeros(n, dtype=torch.int64),
            TEACHER_MASK: zeros,
            CALL_INDEX: zeros.clone(),
        },
        layout,
    )


def _execution(fields: dict, layout: str) -> dict:
    """``per_call``: the packed row's fields, flagged (1) for the engines to run each call alone; other layouts 0."""
    fields[CALLS_ALONE] = torch.tensor(int(layout == "per_call"))
    return fields


def sharing_metrics(rows: list[tuple[int, dict]]) -> dict[str, float]:
    """``memopd/*`` token accounting of a step: ``rows`` = (packed length P + R, extra_fields) per row."""
    packed = sum(n for n, _ in rows)
    calls = [inv for _, extra in rows for inv in extra[EPISODE]["invocations"]]
    per_call = sum(len(inv["prompt_ids"]) + len(inv["response_ids"]) for inv in calls)
    return {
        "memopd/calls_per_episode": len(calls) / len(rows),
        "memopd/packed_tokens_per_episode": packed / len(rows),
        "memopd/per_call_tokens_per_episode": per_call / len(rows),
        "memopd/tokens_saved_by_shared_prefix": 1.0 - packed / per_call,
    }


def prompt_groups(keys: list[str], share: bool) -> list[int]:
    """Per row, the index of its prompt's uid among the step's (verl V1 keys ``{uid}_{session}_{i}``;
    the ``rollout.n`` samples of one prompt share the uid); all -1 when ``share`` is off."""
    if not share:
        return [-1] * len(keys)
    uids: dict[str, int] = {}
    return [uids.setdefault(key.split("_")[0], len(uids)) for key in keys]


def restore_layout(
    batch, layout: str, share_prefix: bool = False, teacher_mask_policy: str = "action"
) -> dict[str, float]:
    """Rewrite the layout fields of ``batch`` (a KVBatchMeta of the step) in TransferQueue;
    returns the step's :func:`sharing_metrics`. ``share_prefix``: the rows of one prompt group
    may compute their common ``q`` once (``memopd.share_prefix_across_group``; packed layout).
    ``teacher_mask_policy``: ``memopd.distill.teacher_mask``."""
    data = tq.kv_batch_get(
        keys=batch.keys, partition_id=batch.partition_id, select_fields=["prompts", "responses", "extra_fields"]
    )
    rows, lengths, prompts = [], [], {}
    groups = prompt_groups(list(batch.keys), share_prefix and layout == "packed")
    for key, tag, group, prompt, response, extra in zip(
        batch.keys, batch.tags, groups, data["prompts"].unbind(), data["responses"].unbind(), data["extra_fields"]
    ):
        p, r = prompt.numel(), response.numel()
        if tag.get("is_padding", False):
            rows.append(padding_fields(p, r, layout) | {PROMPT_GROUP: torch.tensor(-1)})
            continue
        rows.append(
            layout_fields(p, r, extra, layout, f"row {key}", teacher_mask_policy) | {PROMPT_GROUP: torch.tensor(group)}
        )
        lengths.append((p + r, extra))
        if group >= 0:
            prompts.setdefault((group, tuple(prompt.tolist())), []).append(p)
    tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=list_of_dict_to_tensordict(rows))
    metrics = sharing_metrics(lengths)
    if share_prefix and layout == "packed":  # an upper bound: a group split across micro-batches shares less
        shared = sum(sum(ps[1:]) for ps in prompts.values())
        metrics["memopd/group_prefix_tokens_saved"] = shared / max(1, sum(n for n, _ in lengths))
    return metrics
