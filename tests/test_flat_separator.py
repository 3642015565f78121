"""The persistent history's turn separator (``memopd.teacher.flat_separator_ids``).

The ``flat`` layout (``packing``) and the teacher engine's flat stream (``streams.flat_history``) insert the
separator before every call block t >= 1 at action / teacher mask 0, so the history reads as the chat template
writes consecutive turns (ChatML ``<|im_end|>\\n<|im_start|>``) while the action tokens and their
``(episode, call, k)`` order stay the packed layout's. The option resolves at start-up from the tokenizer's
chat template, or as given; refusals name it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from verl_memopd.bench.tiny import build_tokenizer
from verl_memopd.fields import CALL_INDEX, FLAT_SEPARATOR, POSITION_IDS, SEGMENT_IDS, SEGMENTS, TEACHER_MASK
from verl_memopd.packing import LayoutOptions, build_layout, pack_episode
from verl_memopd.rce import EpisodeShape, random_episodes
from verl_memopd.records import Episode, Invocation
from verl_memopd.segments import LayoutError
from verl_memopd.streams import flat_history
from verl_memopd.trainer import ppo
from verl_memopd.trainer.config import AuditConfig, DistillConfig, MemopdConfig, MemopdConfigError, TeacherConfig
from verl_memopd.trainer.rows import layout_fields
from verl_memopd.trainer.teacher import chat_turn_separator, flat_separator_ids

VOCAB = 97
SEP = (95, 96)


@pytest.fixture(scope="module")
def episodes():
    return random_episodes(
        8, 90, seed=11, shape=EpisodeShape(prefix_len=(1, 6), calls=(1, 4), chunk_len=(1, 5), response_len=(1, 5))
    )


def _separated(episodes, separator=SEP):
    return build_layout("flat", episodes, VOCAB, LayoutOptions(flat_separator_ids=separator))


def _figure_episode():
    q = [1, 2, 3]
    inv = [(q + [4, 5], [6, 7]), (q + [8, 9, 10], [11])]
    return Episode("fig", "u", q, tuple(Invocation(tuple(p), tuple(r), tuple(-1.0 for _ in r)) for p, r in inv))


# --- the flat layout ------------------------------------------------------------------------------
def test_the_separator_sits_between_blocks_outside_both_masks():
    layout = _separated([_figure_episode()], separator=(9,))
    ids = layout.input_ids[0].tolist()
    assert ids == [1, 2, 3, 4, 5, 6, 7, 9, 8, 9, 10, 11]  # q | x0 a0 | s | x1 a1
    assert layout.position_ids[0].tolist() == list(range(12))
    predicted = [j + 1 for j in layout.action_mask[0].nonzero().squeeze(1).tolist()]
    assert predicted == [5, 6, 11] and not layout.teacher_mask[0, 6]  # separator (index 7) predicted by none
    assert not layout.needs_segment_attention


def test_separated_flat_lists_the_packed_action_tokens_in_order(episodes):
    packed, flat = build_layout("packed", episodes, VOCAB), _separated(episodes)
    assert torch.equal(flat.action_origin, packed.action_origin)
    assert torch.equal(flat.action_ids, packed.action_ids)
    assert torch.equal(
        flat.teacher_mask.reshape(-1)[flat.action_index], packed.teacher_mask.reshape(-1)[packed.action_index]
    )
    for b, ep in enumerate(episodes):
        length = len(ep.prefix_ids) + len(pack_episode(ep).response_ids) + len(SEP) * (len(ep.invocations) - 1)
        assert int(flat.valid_mask[b].sum()) == length
        assert flat.position_ids[b, :length].tolist() == list(range(length))
        ids = flat.input_ids[b, :length].tolist()
        start = len(ep.prefix_ids)
        for t, inv in enumerate(ep.invocations):  # every block t >= 1 follows the separator
            if t:
                assert tuple(ids[start : start + len(SEP)]) == SEP
                assert not flat.action_mask[b, start - 1 : start + len(SEP)].any()
                start += len(SEP)
            block = list(ep.context_ids(t) + inv.response_ids)
            assert ids[start : start + len(block)] == block
            start += len(block)
        assert ids[: len(ep.prefix_ids)] == list(ep.prefix_ids) and start == length


def test_no_separator_reproduces_the_joined_flat_rows(episodes):
    old = build_layout("flat", episodes, VOCAB)
    new = _separated(episodes, separator=())
    for key in ("input_ids", "position_ids", "valid_mask", "action_mask", "teacher_mask", "action_origin"):
        assert torch.equal(getattr(old, key), getattr(new, key)), key
    row = pack_episode(episodes[0])
    assert old.input_ids[0, : len(row.prompt_ids + row.response_ids)].tolist() == list(
        row.prompt_ids + row.response_ids
    )


def test_separator_ids_are_checked_against_the_vocabulary(episodes):
    with pytest.raises(LayoutError, match=r"flat_separator_ids \[97\] outside the vocabulary \[0, 97\)"):
        _separated(episodes, separator=(3, 97))


# --- the teacher engine's flat stream equals the flat layout ----------------------------------------
def test_the_engine_stream_runs_the_flat_layout_tokens(episodes):
    """The trainer's flat rows (``rows.layout_fields``) through ``streams.flat_history``: the separated
    flat layout's tokens, positions 0..L'-1, one plain causal sequence per row; ``index`` maps every row token
    to its copy, so an action token is predicted by the token before it in its own block."""
    packed = [pack_episode(ep) for ep in episodes]
    extras = [{POSITION_IDS: r.position_ids, SEGMENT_IDS: r.segment_ids, TEACHER_MASK: r.teacher_mask} for r in packed]
    fields = [layout_fields(len(r.prompt_ids), len(r.response_ids), x, "flat", "row") for r, x in zip(packed, extras)]
    tokens = [torch.tensor(r.prompt_ids + r.response_ids) for r in packed]
    inputs, index = flat_history(tokens, [f[CALL_INDEX] for f in fields], SEP)
    layout = _separated(episodes)
    assert inputs["input_ids"][0].tolist() == layout.input_ids[layout.valid_mask].tolist()
    lengths = layout.valid_mask.sum(1).tolist()
    assert inputs["position_ids"][0].tolist() == [p for n in lengths for p in range(n)]
    assert torch.equal(inputs["input_ids"][0][index], torch.cat(tokens))
    meta = inputs[SEGMENTS]
    assert meta.keys_are_queries and meta.cu_seqlens_q.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    response = torch.cat([torch.tensor([0] * len(r.prompt_ids) + list(r.response_mask)) for r in packed]).bool()
    act = response.nonzero().squeeze(1)
    assert torch.equal(index[act - 1] + 1, index[act])


def test_rows_of_one_call_stream_as_they_are(episodes):
    tokens = [torch.tensor(r.prompt_ids + r.response_ids) for r in map(pack_episode, episodes)]
    calls = [torch.zeros(len(pack_episode(ep).response_ids), dtype=torch.long) for ep in episodes]
    inputs, index = flat_history(tokens, calls, SEP)  # one call per row (as verl's padding rows): no block t >= 1
    assert torch.equal(inputs["input_ids"][0], torch.cat(tokens)) and torch.equal(index, torch.arange(index.numel()))


# --- the option ------------------------------------------------------------------------------------
def test_the_separator_derives_from_the_chatml_template():
    tok = build_tokenizer()  # the tiny models' tokenizer: ChatML, <|im_end|>\n<|im_start|> between turns
    newline = tuple(tok.encode("\n", add_special_tokens=False))
    assert newline and chat_turn_separator(tok) == newline
    assert flat_separator_ids(None, tok, len(tok)) == newline
    assert flat_separator_ids([5, 6], tok, len(tok)) == (5, 6)
    assert flat_separator_ids([], tok, len(tok)) == ()


class _Template:
    """A tokenizer stand-in rendering ``template(role, content)`` per message, with ChatML-like specials."""

    all_special_tokens = ["<s>", "<eot>", "<bot>"]

    def __init__(self, template):
        self.chat_template, self.template = "set" if template else None, template

    def apply_chat_template(self, messages, tokenize):
        assert tokenize is False
        return "<s>" + "".join(self.template(m["role"], m["content"]) for m in messages)

    def encode(self, text, add_special_tokens):
        assert not add_special_tokens
        return [ord(c) for c in text]


def test_the_separator_is_the_text_between_end_of_turn_and_next_start():
    two_lines = _Template(lambda role, content: f"<bot>{role}\n{content}<eot>\n\n")
    assert chat_turn_separator(two_lines) == (10, 10)
    joined = _Template(lambda role, content: f"<bot>{role}\n{content}<eot>")
    assert chat_turn_separator(joined) == ()


def test_the_option_refuses_what_it_cannot_derive_or_place():
    with pytest.raises(MemopdConfigError, match="memopd.teacher.flat_separator_ids=null.*no chat template"):
        chat_turn_separator(_Template(None))
    plain = _Template(lambda role, content: f"{role}: {content}\n")
    with pytest.raises(MemopdConfigError, match="memopd.teacher.flat_separator_ids=null.*no turn boundary"):
        chat_turn_separator(plain)
    with pytest.raises(MemopdConfigError, match=r"flat_separator_ids=\[3, 10\]: ids \[10\] outside .*\[0, 10\)"):
        flat_separator_ids([3, 10], None, 10)
    for bad in ("\n", [1.5], [-1]):
        with pytest.raises(MemopdConfigError, match="memopd.teacher.flat_separator_ids=.*expected null"):
            MemopdConfig(teacher=TeacherConfig(flat_separator_ids=bad), distill=DistillConfig(coef=0.0))


# --- the trainer hands the ids to the flat passes only -----------------------------------------------
@pytest.mark.parametrize(
    "state, layout, audit, separated",
    [
        ("flat", "packed", False, [("flat", SEP)]),
        ("flat", "packed", True, [("flat", SEP), ("packed", ())]),
        ("aligned", "packed", True, [("packed", ()), ("flat", SEP)]),
        ("aligned", "flat", True, [("flat", ()), ("flat", ())]),  # the student's own flat rows stay as they are
    ],
)
def test_the_trainer_separates_the_teacher_flat_passes(tmp_path, monkeypatch, state, layout, audit, separated):
    (tmp_path / "config.json").write_text("{}")
    memopd = MemopdConfig(
        layout=layout, teacher=TeacherConfig(path=str(tmp_path), state=state), audit=AuditConfig(every_n_steps=1)
    )
    current, scored = {"layout": layout}, []
    monkeypatch.setattr(ppo, "restore_layout", lambda batch, name, *a: current.update(layout=name) or {})
    trainer = SimpleNamespace(memopd=memopd, timing_raw={}, flat_separator=SEP)
    trainer._restore_layout = lambda batch, name: ppo.MemopdTrainer._restore_layout(trainer, batch, name)
    trainer._score_with_teacher = lambda batch, output_key=None, separator=(): scored.append(
        (current["layout"], separator)
    )
    ppo.MemopdTrainer._teacher_step(trainer, batch=object(), audit=audit)
    assert scored == separated and current["layout"] == layout


def test_the_teacher_batch_carries_the_separator_for_its_pass_only(tmp_path, monkeypatch):
    class _Group:
        def __init__(self):
            self.seen = []

        def infer_batch(self, batch):
            self.seen.append(batch.extra_info.get(FLAT_SEPARATOR))
            return SimpleNamespace(futures=[])

    monkeypatch.setattr(ppo, "ray", SimpleNamespace(get=lambda futures: futures))  # no Ray here
    (tmp_path / "config.json").write_text("{}")
    memopd = MemopdConfig(teacher=TeacherConfig(path=str(tmp_path), state="flat"))
    config = SimpleNamespace(actor_rollout_ref=SimpleNamespace(rollout=SimpleNamespace(temperature=1.0)))
    trainer = SimpleNamespace(memopd=memopd, config=config, vocab_size=VOCAB, teacher_wg=_Group())
    batch = SimpleNamespace(extra_info={})
    ppo.MemopdTrainer._score_with_teacher(trainer, batch, separator=SEP)
    ppo.MemopdTrainer._score_with_teacher(trainer, batch)
    assert trainer.teacher_wg.seen == [SEP, None] and FLAT_SEPARATOR not in batch.extra_info
