"""Layouts and segment metadata: restored states, visibility, verl batches, and refused records."""

import dataclasses

import pytest
import torch

from verl_memopd.packing import (
    BatchLayout,
    build_layout,
    layout_names,
    pack_episode,
    packed_rows_segments,
    register_layout,
)
from verl_memopd.rce import EpisodeShape, random_episodes
from verl_memopd.records import Episode, Invocation, RecordError
from verl_memopd.segments import LayoutError, SegmentMeta, padded_batch_segments, segment_meta

VOCAB = 97
LAYOUTS = ("packed", "per_call", "per_call_varlen", "flat")


def _inv(prompt, response, action=None):
    return Invocation(tuple(prompt), tuple(response), tuple(-1.0 for _ in response), action_mask=action)


def _figure_episode():
    """The module docstring's example: P=3, B_1 = x0 x0 a0 a0, B_2 = x1 x1 x1 a1."""
    q = [1, 2, 3]
    return Episode("fig", "u", q, (_inv(q + [4, 5], [6, 7]), _inv(q + [8, 9, 10], [11])))


def _state_of(layout: BatchLayout, a: int) -> tuple[list, list]:
    """The (ids, positions) an action token's predicting position attends to, read off the metadata."""
    meta, j = layout.segments, int(layout.action_index[a])
    s = int(meta.segment_of_tokens()[j])
    qa, qb, ka, kb = meta.bounds[s]
    keys = meta.key_index[ka : kb - (qb - qa) + (j - qa) + 1]
    return layout.input_ids.reshape(-1)[keys].tolist(), layout.position_ids.reshape(-1)[keys].tolist()


@pytest.fixture(scope="module")
def episodes():
    return random_episodes(
        12, VOCAB, seed=7, shape=EpisodeShape(prefix_len=(1, 9), chunk_len=(1, 6), response_len=(1, 7))
    )


def test_figure_visibility_matches_the_drawing():
    layout = build_layout("packed", [_figure_episode()])
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 3, 4, 5, 6]]
    drawn = {2: "11100000000", 6: "11111110000", 7: "11100001000", 10: "11100001111"}
    vis = layout.segments.visibility()
    for row, bits in drawn.items():
        assert vis[row].int().tolist() == [int(b) for b in bits]


@pytest.mark.parametrize("name", ["packed", "per_call", "per_call_varlen"])
def test_every_action_token_sees_exactly_its_generation_state(name, episodes):
    layout = build_layout(name, episodes, VOCAB)
    assert layout.action_index.numel() == sum(inv.num_action_tokens for ep in episodes for inv in ep.invocations)
    for a, (e, c, k) in enumerate(layout.action_origin.tolist()):
        inv = episodes[e].invocations[c]
        ids, pos = _state_of(layout, a)
        assert ids == list(inv.prompt_ids + inv.response_ids[:k])
        assert pos == list(range(len(ids)))
        assert int(layout.action_ids[a]) == inv.response_ids[k]


def test_flat_changes_the_state_of_later_calls(episodes):
    layout = build_layout("flat", episodes, VOCAB)
    wrong = 0
    for a, (e, c, k) in enumerate(layout.action_origin.tolist()):
        inv = episodes[e].invocations[c]
        wrong += _state_of(layout, a)[0] != list(inv.prompt_ids + inv.response_ids[:k])
    later_calls = int((layout.action_origin[:, 1] > 0).sum())
    assert later_calls > 0 and wrong == later_calls


def test_layouts_list_action_tokens_in_one_order(episodes):
    layouts = [build_layout(n, episodes, VOCAB) for n in LAYOUTS]
    for other in layouts[1:]:
        assert torch.equal(other.action_origin, layouts[0].action_origin)
        assert torch.equal(other.action_ids, layouts[0].action_ids)
        assert int(other.teacher_mask.sum()) == int(layouts[0].teacher_mask.sum())
    needs = {layout.name: layout.needs_segment_attention for layout in layouts}
    assert needs == {"packed": True, "per_call": False, "per_call_varlen": True, "flat": False}


def test_packed_stores_the_prefix_once(episodes):
    packed, per_call = build_layout("packed", episodes), build_layout("per_call_varlen", episodes)
    calls = sum(len(ep.invocations) for ep in episodes)
    saved = sum(ep.prefix_len * (len(ep.invocations) - 1) for ep in episodes)
    assert per_call.input_ids.numel() - packed.input_ids.numel() == saved
    assert packed.segments.cu_seqlens_q.numel() - 1 == len(episodes) + calls


def test_verl_padded_batch_gives_the_packed_rows_metadata(episodes):
    rows = [pack_episode(ep) for ep in episodes]
    reference = packed_rows_segments(rows)
    p_max, r_max = max(len(r.prompt_ids) for r in rows), max(len(r.response_ids) for r in rows)
    seg = torch.full((len(rows), p_max + r_max), 99)
    pos = torch.full_like(seg, 555)
    mask = torch.zeros_like(seg)
    for b, r in enumerate(rows):  # verl: left-padded prompt, right-padded response
        p, n = len(r.prompt_ids), len(r.segment_ids)
        cols = slice(p_max - p, p_max - p + n)
        seg[b, cols], pos[b, cols], mask[b, cols] = torch.tensor(r.segment_ids), torch.tensor(r.position_ids), 1
    unpadded = padded_batch_segments(seg, mask, pos, unpad=True)
    for field in ("cu_seqlens_q", "cu_seqlens_k", "key_index"):
        assert torch.equal(getattr(unpadded, field), getattr(reference, field))
    padded = padded_batch_segments(seg, mask, pos)
    real = mask.reshape(-1).bool()
    assert torch.equal(padded.visibility()[real][:, real], reference.visibility())
    with pytest.raises(LayoutError, match=r"position_ids\[\d+\] = \d+, expected"):
        padded_batch_segments(seg, mask, torch.arange(seg.shape[1]).expand_as(seg), unpad=True)


@pytest.mark.parametrize(
    "seg, row, pos, match",
    [
        ([0, 0, 1, 1, 2, 1], [0] * 6, None, "segment 1 follows segment 2"),
        ([0, 1, 1, 0, 2], [0] * 5, None, "segment 0 follows segment 1"),
        ([1, 1, 2], [0] * 3, None, "has no shared prefix"),
        ([0, 0, 0, 0], [0, 1, 1, 0], None, "row_ids must be non-decreasing"),
        ([0, 0, 1, 1], [0] * 4, [0, 1, 3, 4], r"row 0 segment 1: position_ids\[2\] = 3, expected 2"),
        ([-2, 0], [0, 0], None, "segment_ids must be >= -1"),
    ],
)
def test_segment_metadata_refuses_merging_layouts(seg, row, pos, match):
    with pytest.raises(LayoutError, match=match):
        segment_meta(torch.tensor(seg), torch.tensor(row), None if pos is None else torch.tensor(pos))


def test_segment_meta_rejects_inconsistent_tensors():
    good = segment_meta(torch.tensor([0, 0, 1]), torch.zeros(3, dtype=torch.long))
    with pytest.raises(LayoutError, match="last Lq keys"):
        dataclasses.replace(good, key_index=good.key_index.flip(0))
    with pytest.raises(LayoutError, match="int32"):
        dataclasses.replace(good, cu_seqlens_q=good.cu_seqlens_q.long())
    with pytest.raises(LayoutError, match="max_seqlen"):
        dataclasses.replace(good, max_seqlen_k=1)


def test_layout_refuses_a_predictor_from_another_call():
    layout = build_layout("packed", [_figure_episode()])
    mask = layout.action_mask.clone()
    mask[0, 6] = True  # the last token of call 0 would "predict" call 1's first token
    origin = torch.cat([layout.action_origin[:2], torch.tensor([[0, 1, 0]]), layout.action_origin[2:]])
    with pytest.raises(LayoutError, match=r"\(episode 0, call 1, k 0\).*leak between calls"):
        dataclasses.replace(layout, action_mask=mask, action_origin=origin)


def _from_dict(changes):
    base = _figure_episode().to_dict()
    for (t, key), value in changes.items():
        base["invocations"][t][key] = value
    return Episode.from_dict(base)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({(1, "response_logprobs"): [-1.0, -1.0]}, "call 1: response_logprobs has 2 entries, response_ids has 1"),
        ({(0, "response_ids"): [], (0, "response_logprobs"): []}, "call 0: response_ids is empty"),
        ({(1, "prompt_ids"): [1, 2]}, "call 1: prompt_ids does not start with the shared prefix"),
        (
            {(1, "prompt_ids"): [1, 9, 3, 8]},
            "call 1: prompt_ids does not start with the shared prefix q .first difference at token 1",
        ),
        ({(0, "action_mask"): [1]}, "call 0: action_mask has 1 entries"),
    ],
)
def test_bad_records_are_refused_naming_field_and_call(changes, match):
    with pytest.raises(RecordError, match=match):
        _from_dict(changes)


@pytest.mark.parametrize("name", LAYOUTS)
def test_layouts_refuse_ids_outside_the_vocabulary_and_empty_contexts(name):
    with pytest.raises(RecordError, match=r"call 1: prompt_ids\[5\] = 10 is outside the vocabulary \[0, 10\)"):
        build_layout(name, [_figure_episode()], vocab_size=10)
    q = [1, 2]
    no_context = Episode("e", "u", q, (_inv(q + [3], [4]), _inv(q, [5])))
    with pytest.raises(RecordError, match="call 1: empty context"):
        build_layout(name, [no_context])


def test_layout_registry_refuses_duplicates_and_lists_names():
    assert set(LAYOUTS) <= set(layout_names())
    with pytest.raises(ValueError, match="already registered"):
        register_layout("packed", padded=False)(lambda episodes, options: [])
    with pytest.raises(KeyError, match="valid layouts: flat, packed, per_call"):
        build_layout("tree", [_figure_episode()])
    with pytest.raises(LayoutError, match="non-empty sequence of Episode"):
        build_layout("packed", [])


def test_segment_meta_device_round_trip_keeps_bounds():
    meta = build_layout("packed", [_figure_episode()]).segments
    moved = meta.to("cpu")
    assert isinstance(moved, SegmentMeta) and moved.bounds == meta.bounds
