"""Row layouts as the trainer restores them, and the engine's attention metadata for verl micro-batches."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from verl_memopd.fields import EPISODE, POSITION_IDS, SEGMENT_IDS, TEACHER_MASK
from verl_memopd.packing import pack_episode
from verl_memopd.records import Episode, Invocation
from verl_memopd.trainer.engine import micro_batch_segments
from verl_memopd.trainer.rows import MemopdRowError, layout_fields, padding_fields, sharing_metrics

Q = (5, 6, 7)


def _episode() -> Episode:
    calls = [Invocation(Q + (10, 11), (20, 21), (-0.1, -0.2)), Invocation(Q + (20, 21, 30), (40,), (-0.3,))]
    return Episode("e0", "u0", Q, tuple(calls))


def _extra(ep: Episode) -> dict:
    row = pack_episode(ep)
    return {
        EPISODE: ep.to_dict(),
        POSITION_IDS: list(row.position_ids),
        SEGMENT_IDS: list(row.segment_ids),
        TEACHER_MASK: list(row.teacher_mask),
    }


def test_packed_fields_are_the_recorded_layout():
    ep = _episode()
    row = pack_episode(ep)
    f = layout_fields(len(row.prompt_ids), len(row.response_ids), _extra(ep), "packed", "row x")
    assert f["position_ids"].tolist() == [0, 1, 2, 3, 4, 5, 6, 3, 4, 5, 6]
    assert f[SEGMENT_IDS].tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert f["memopd_call_index"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize(
    "policy, mask",
    [("action", [0, 0, 1, 1, 0, 0, 0, 1]), ("answer", [0, 0, 0, 0, 0, 0, 0, 1]), ("memory", [0, 0, 1, 1, 0, 0, 0, 0])],
)
@pytest.mark.parametrize("layout", ["packed", "flat"])
def test_teacher_mask_policy_restricts_m_T_to_its_calls(policy, mask, layout):
    f = layout_fields(3, 8, _extra(_episode()), layout, "row x", policy)
    assert f["memopd_teacher_mask"].tolist() == mask  # m_T <= m_act = [0, 0, 1, 1, 0, 0, 0, 1]
    with pytest.raises(MemopdRowError, match="row x: memopd.distill.teacher_mask='calls'"):
        layout_fields(3, 8, _extra(_episode()), layout, "row x", "calls")


def test_flat_fields_are_one_causal_sequence():
    ep = _episode()
    f = layout_fields(3, 8, _extra(ep), "flat", "row x")
    assert f["position_ids"].tolist() == list(range(11)) and f[SEGMENT_IDS].eq(0).all()


def test_rows_without_an_episode_layout_are_refused():
    with pytest.raises(MemopdRowError, match=r"row k: no \['memopd_position_ids'"):
        layout_fields(3, 8, {}, "packed", "row k")
    extra = _extra(_episode())
    with pytest.raises(MemopdRowError, match="do not match prompt 3 \\+ response 9"):
        layout_fields(3, 9, extra, "packed", "row k")


def test_sharing_metrics_count_the_prefix_once():
    ep = _episode()
    m = sharing_metrics([(11, _extra(ep))])
    per_call = (5 + 2) + (6 + 1)  # each call alone repeats q
    assert m["memopd/packed_tokens_per_episode"] == 11 and m["memopd/per_call_tokens_per_episode"] == per_call
    assert m["memopd/tokens_saved_by_shared_prefix"] == pytest.approx(1 - 11 / per_call)
    assert m["memopd/calls_per_episode"] == 2


def _micro_batch(rows: list[dict], use_rmpad: bool) -> TensorDict:
    nested = lambda key: torch.nested.as_nested_tensor([r[key] for r in rows], layout=torch.jagged)  # noqa: E731
    ids = [torch.arange(len(r["position_ids"])) for r in rows]
    td = TensorDict(
        {
            "input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
            "position_ids": nested("position_ids"),
            SEGMENT_IDS: nested(SEGMENT_IDS),
        },
        batch_size=[len(rows)],
    )
    return td


def test_engine_metadata_is_the_same_for_both_verl_micro_batch_paths():
    ep = _episode()
    short = Episode("e1", "u0", Q, ep.invocations[:1])
    packed = layout_fields(3, 8, _extra(ep), "packed", "a")
    flat = layout_fields(3, 4, _extra(short), "flat", "b")  # 7 tokens: padded to 11 on the padded path
    td = _micro_batch([packed, flat], use_rmpad=True)
    stream = micro_batch_segments(td, use_remove_padding=True).visibility()
    padded = micro_batch_segments(td, use_remove_padding=False).visibility()
    real = torch.cat([torch.ones(11), torch.ones(7), torch.zeros(4)]).bool()
    assert torch.equal(padded[real][:, real], stream)
    assert not padded[real][:, ~real].any()  # padding is never attended to
    # row 0: call 2's first token (stream index 7) sees q (0..2) and itself, not call 1 (3..6)
    assert stream[7, :3].all() and not stream[7, 3:7].any() and stream[7, 7]
    # row 1 (flat): plain causal; rows never see each other
    assert stream[17, 11:18].all() and not stream[11:, :11].any()


def test_verl_padding_rows_get_a_plain_layout_and_no_teacher_tokens():
    f = padding_fields(127, 1, "packed")  # verl's synthetic padding row: 127 prompt tokens + 1 response token
    assert f["position_ids"].tolist() == list(range(128)) and f[SEGMENT_IDS].eq(0).all()
    assert f["memopd_teacher_mask"].tolist() == [0] and f["memopd_call_index"].tolist() == [0]
    ep = _episode()
    td = _micro_batch([layout_fields(3, 8, _extra(ep), "packed", "a"), f], use_rmpad=True)
    vis = micro_batch_segments(td, use_remove_padding=True).visibility()
    assert not vis[11:, :11].any() and not vis[:11, 11:].any()  # the padding row is its own causal sequence


def test_per_call_rows_are_the_packed_rows_flagged_for_call_by_call_execution():
    ep = _episode()
    packed = layout_fields(3, 8, _extra(ep), "packed", "a")
    per_call = layout_fields(3, 8, _extra(ep), "per_call", "a")
    assert per_call.pop("memopd_calls_alone").item() == 1 and packed.pop("memopd_calls_alone").item() == 0
    assert all(torch.equal(per_call[k], packed[k]) for k in packed)
    assert padding_fields(127, 1, "per_call")["memopd_calls_alone"].item() == 1  # every row has the same keys
