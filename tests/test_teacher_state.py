"""``memopd.teacher.state``: the matched persistent-history control.

With ``state=flat`` only the teacher scores the flattened history; the student, reference and
critic keep the packed rows. Checked here without Ray:
  * the trainer's teacher step lays the rows out flat for the teacher alone and hands them back in
    the student's layout (what the reference, critic and actor update read);
  * on the same rows, through the trainer's row layout (``rows.layout_fields``), the engines'
    attention metadata (``engine.micro_batch_segments``), the teacher engine's encoding
    (``supervision.encode_teacher_rows``) and the actor loss (``losses.actor.opd_loss``), the
    teacher distributions the loss receives under ``flat`` equal the aligned ones on call 1 (its
    block already follows q with positions continuing from |q|) and differ on every later call;
  * the same with the turn separator the teacher engine inserts (``streams.flat_history``,
    ``memopd.teacher.flat_separator_ids``): call 1 unchanged, later calls in a history of their own.
The in-loop check that the student stays aligned (``training/rollout_probs_diff_max`` at fp32
noise with ``state=flat``) is the slow run in tests/test_memopd_e2e.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict
from transformers import Qwen2ForCausalLM
from verl.utils import tensordict_utils as tu
from verl.utils.metric import Metric

from verl_memopd.attention import hf_name
from verl_memopd.bench.tiny import student_config, teacher_config
from verl_memopd.fields import (
    CALL_INDEX,
    EPISODE,
    POSITION_IDS,
    SEGMENT_IDS,
    STUDENT_LOGITS,
    TEACHER_HEAD,
    TEACHER_HIDDEN,
    TEACHER_HIDDEN_ALIGNED,
    TEACHER_HIDDEN_FLAT,
    TEACHER_MASK,
)
from verl_memopd.losses.actor import OPDLossConfig, assign_global_teacher_counts, opd_loss
from verl_memopd.packing import pack_episode
from verl_memopd.rce import EpisodeShape, random_episodes
from verl_memopd.streams import flat_history
from verl_memopd.supervision import encode_teacher_rows, get_transport
from verl_memopd.trainer import ppo
from verl_memopd.trainer.audit import teacher_layout_kl
from verl_memopd.trainer.config import AuditConfig, DistillConfig, MemopdConfig, MemopdConfigError, TeacherConfig
from verl_memopd.trainer.engine import micro_batch_segments
from verl_memopd.trainer.rows import layout_fields
from verl_memopd.trainer.teacher import TeacherPass, teacher_passes

VOCAB = 256
CALLS = 4
SEPARATOR = (VOCAB - 1,)  # a turn separator id (memopd.teacher.flat_separator_ids)
SHAPE = EpisodeShape(prefix_len=(6, 12), calls=(CALLS, CALLS), chunk_len=(2, 6), response_len=(3, 6))


def _memopd(teacher_dir, **kw) -> MemopdConfig:
    teacher = TeacherConfig(path=str(teacher_dir), state=kw.pop("state", "aligned"))
    distill = DistillConfig(transport=kw.pop("transport", "hidden"), teacher_mask=kw.pop("teacher_mask", "action"))
    return MemopdConfig(teacher=teacher, distill=distill, audit=AuditConfig(every_n_steps=1), **kw)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A folder with a config.json (MemopdConfig checks that the teacher path holds a model)."""
    path = tmp_path_factory.mktemp("teacher")
    (path / "config.json").write_text("{}")
    return path


# --- which layout the teacher scores ------------------------------------------------------------
def test_teacher_passes_score_the_supervision_under_the_teacher_state(teacher_dir):
    aligned, flat = _memopd(teacher_dir), _memopd(teacher_dir, state="flat")
    assert (aligned.teacher_layout, flat.teacher_layout) == ("packed", "flat")
    assert teacher_passes(aligned, audit=False) == [TeacherPass("packed")]
    assert teacher_passes(flat, audit=False) == [TeacherPass("flat")]
    # audit steps: the other layout's hidden states, so KL(aligned || flat) is reported either way
    assert teacher_passes(aligned, audit=True) == [TeacherPass("packed"), TeacherPass("flat", TEACHER_HIDDEN_FLAT)]
    assert teacher_passes(flat, audit=True) == [TeacherPass("flat"), TeacherPass("packed", TEACHER_HIDDEN_ALIGNED)]
    per_call = _memopd(teacher_dir, state="flat", layout="per_call")
    assert teacher_passes(per_call, audit=False) == [TeacherPass("flat")]
    # topk ships no hidden states: an audit step adds the supervision layout's hidden states
    topk = _memopd(teacher_dir, state="flat", transport="topk")
    assert teacher_passes(topk, audit=True) == [
        TeacherPass("flat"),
        TeacherPass("flat", TEACHER_HIDDEN),
        TeacherPass("packed", TEACHER_HIDDEN_ALIGNED),
    ]


def test_teacher_state_is_validated(teacher_dir):
    with pytest.raises(MemopdConfigError, match=r"memopd.teacher.state='persistent'.*\('aligned', 'flat'\)"):
        _memopd(teacher_dir, state="persistent")
    with pytest.raises(MemopdConfigError, match="memopd.layout=flat already puts every forward on the flat layout"):
        _memopd(teacher_dir, state="flat", layout="flat")
    with pytest.raises(MemopdConfigError, match="no teacher to score the flat history"):
        MemopdConfig(teacher=TeacherConfig(state="flat"), distill=DistillConfig(coef=0.0))


class _Recorder:
    """A stand-in for the trainer's TransferQueue rows: the layout they are in, and every teacher call."""

    def __init__(self):
        self.layout, self.policy, self.scored = None, None, []

    def restore_layout(self, batch, layout, share_prefix=False, teacher_mask_policy="action"):
        self.layout, self.policy = layout, teacher_mask_policy
        return {}


@pytest.mark.parametrize(
    "state, audit, scored",
    [
        ("aligned", False, [("packed", None)]),
        ("flat", False, [("flat", None)]),
        ("flat", True, [("flat", None), ("packed", TEACHER_HIDDEN_ALIGNED)]),
        ("aligned", True, [("packed", None), ("flat", TEACHER_HIDDEN_FLAT)]),
    ],
)
def test_trainer_teacher_step_hands_the_rows_back_in_the_student_layout(teacher_dir, monkeypatch, state, audit, scored):
    rows = _Recorder()
    monkeypatch.setattr(ppo, "restore_layout", rows.restore_layout)
    trainer = SimpleNamespace(memopd=_memopd(teacher_dir, state=state), timing_raw={}, flat_separator=())
    trainer._restore_layout = lambda batch, layout: ppo.MemopdTrainer._restore_layout(trainer, batch, layout)
    trainer._score_with_teacher = lambda batch, output_key=None, separator=(): rows.scored.append(
        (rows.layout or "packed", output_key)
    )
    rows.layout = "packed"  # _compute_old_log_prob restored the student's layout before the actor's forward
    ppo.MemopdTrainer._teacher_step(trainer, batch=object(), audit=audit)
    assert rows.scored == scored
    assert rows.layout == "packed"  # reference, critic and the actor update see the aligned rows


@pytest.mark.parametrize("policy", ["answer", "memory"])
def test_trainer_lays_rows_out_with_the_configured_teacher_mask(teacher_dir, monkeypatch, policy):
    rows = _Recorder()
    monkeypatch.setattr(ppo, "restore_layout", rows.restore_layout)
    trainer = SimpleNamespace(
        memopd=_memopd(teacher_dir, state="flat", teacher_mask=policy), timing_raw={}, flat_separator=()
    )
    trainer._restore_layout = lambda batch, layout: ppo.MemopdTrainer._restore_layout(trainer, batch, layout)
    trainer._score_with_teacher = lambda batch, output_key=None, separator=(): None
    ppo.MemopdTrainer._teacher_step(trainer, batch=object(), audit=False)
    assert (rows.layout, rows.policy) == ("packed", policy)


# --- what the loss receives on the same rows ------------------------------------------------------
def _model(config, seed):
    torch.manual_seed(seed)
    config.initializer_range = 0.05  # sharper than the 0.02 default (an untrained model is near-uniform)
    model = Qwen2ForCausalLM(config).eval()
    model.set_attn_implementation(hf_name("torch"))
    return model


def _extra(ep) -> dict:
    row = pack_episode(ep)
    return {
        EPISODE: ep.to_dict(),
        POSITION_IDS: list(row.position_ids),
        SEGMENT_IDS: list(row.segment_ids),
        TEACHER_MASK: list(row.teacher_mask),
    }


def _nested(tensors):
    return torch.nested.as_nested_tensor(list(tensors), layout=torch.jagged)


def _micro_batch(episodes, layout: str) -> TensorDict:
    """The rows as a verl NO_PADDING micro-batch, laid out by the trainer's own ``layout_fields``."""
    packed = [pack_episode(ep) for ep in episodes]
    fields = [
        layout_fields(len(r.prompt_ids), len(r.response_ids), _extra(ep), layout, ep.episode_id)
        for r, ep in zip(packed, episodes)
    ]
    td = TensorDict(
        {
            "prompts": _nested(torch.tensor(r.prompt_ids) for r in packed),
            "responses": _nested(torch.tensor(r.response_ids) for r in packed),
            "input_ids": _nested(torch.tensor(r.prompt_ids + r.response_ids) for r in packed),
            "response_mask": _nested(torch.tensor(r.response_mask) for r in packed),
            **{k: _nested(f[k] for f in fields) for k in ("position_ids", SEGMENT_IDS, TEACHER_MASK, CALL_INDEX)},
        },
        batch_size=[len(episodes)],
    )
    tu.assign_non_tensor(td, temperature=1.0, dp_size=1)
    return td


@torch.no_grad()
def _forward(model, td):
    """The engines' remove-padding forward -> (logits (N, V_rows), final hidden states (N, H))."""
    meta = micro_batch_segments(td, use_remove_padding=True)
    out = model(
        input_ids=td["input_ids"].values()[None],
        position_ids=td["position_ids"].values()[None],
        memopd_segments=meta,
        use_cache=False,
        output_hidden_states=True,
    )
    return out.logits[0], out.hidden_states[-1][0]


def _teacher_rows(hidden, td) -> list[torch.Tensor]:
    """The teacher engine's gather: per row, the states at the positions predicting its m_T tokens."""
    rows = []
    for h, m in zip(hidden.split(td["input_ids"].offsets().diff().tolist()), td[TEACHER_MASK].unbind()):
        rows.append(h[h.shape[0] - m.shape[0] - 1 + torch.nonzero(m, as_tuple=True)[0]])
    return rows


@torch.no_grad()
def _forward_separated(model, td, separator):
    """The teacher engine's flat pass with a turn separator (``streams.flat_history``): final hidden states
    read back in the rows' token order, (N, H)."""
    inputs, index = flat_history(td["input_ids"].unbind(), td[CALL_INDEX].unbind(), separator)
    out = model(**inputs, use_cache=False, output_hidden_states=True)
    return out.hidden_states[-1][0][index]


@pytest.fixture(scope="module")
def scored():
    """Student (packed) and teacher (packed = aligned, flat joined, flat separated) forwards of the same 6
    episodes."""
    episodes = random_episodes(6, VOCAB, seed=3, shape=SHAPE)
    student, teacher = _model(student_config(VOCAB), 0), _model(teacher_config(VOCAB), 1)
    aligned, flat = _micro_batch(episodes, "packed"), _micro_batch(episodes, "flat")
    student_logits, _ = _forward(student, aligned)
    (_, t_aligned), (_, t_flat) = _forward(teacher, aligned), _forward(teacher, flat)
    return SimpleNamespace(
        batch=aligned,
        student_logits=student_logits,
        head=teacher.lm_head.weight.detach(),
        aligned=_teacher_rows(t_aligned, aligned),
        flat=_teacher_rows(t_flat, flat),
        separated=_teacher_rows(_forward_separated(teacher, flat, SEPARATOR), flat),
    )


def _loss_metrics(s, teacher_rows) -> dict:
    """The actor loss on the student's packed rows with the teacher's supervision ``teacher_rows``."""
    data = s.batch.clone()
    for key, value in encode_teacher_rows(get_transport("hidden"), teacher_rows, None, VOCAB, 1.0).items():
        data[key] = value
    assign_global_teacher_counts(data)
    offsets = data["input_ids"].offsets()
    model_output = {
        STUDENT_LOGITS: torch.nested.nested_tensor_from_jagged(s.student_logits, offsets),
        TEACHER_HEAD: s.head,
    }
    _, metrics = opd_loss(OPDLossConfig(vocab_size=VOCAB), model_output, data)
    return {k: float(Metric.aggregate_dp([v])) for k, v in metrics.items()}


def test_flat_teacher_supervision_differs_from_aligned_on_later_calls_only(scored):
    """Per call t (1-based), the mean KL(p_T aligned || p_T flat) over its teacher tokens: 0 for
    t = 1, clearly > 0 for t >= 2. The loss's per-call reverse KL (same student logits) follows."""
    kl = teacher_layout_kl(scored.head, torch.cat(scored.aligned), torch.cat(scored.flat))
    calls = scored.batch[CALL_INDEX].values()[scored.batch[TEACHER_MASK].values().bool()]
    per_call = [float(kl[calls == t].mean()) for t in range(CALLS)]
    print("teacher KL(aligned || flat) per call t=1..%d: %s" % (CALLS, ", ".join(f"{v:.3e}" for v in per_call)))
    assert per_call[0] < 1e-6
    assert min(per_call[1:]) > 1e-2
    aligned, flat = _loss_metrics(scored, scored.aligned), _loss_metrics(scored, scored.flat)
    print(
        "loss reverse_kl_call aligned / flat: "
        + ", ".join(
            f"t={t + 1} {aligned[f'memopd/reverse_kl_call/{t}']:.4f}/{flat[f'memopd/reverse_kl_call/{t}']:.4f}"
            for t in range(CALLS)
        )
    )
    assert aligned["memopd/reverse_kl_call/0"] == pytest.approx(flat["memopd/reverse_kl_call/0"], rel=1e-5)
    for t in range(1, CALLS):  # fp32 noise is ~1e-7 here
        assert abs(aligned[f"memopd/reverse_kl_call/{t}"] - flat[f"memopd/reverse_kl_call/{t}"]) > 1e-4


def _per_call_kl(s, p, q) -> list[float]:
    kl = teacher_layout_kl(s.head, torch.cat(p), torch.cat(q))
    calls = s.batch[CALL_INDEX].values()[s.batch[TEACHER_MASK].values().bool()]
    return [float(kl[calls == t].mean()) for t in range(CALLS)]


def test_separated_flat_supervision_keeps_call_one_and_changes_the_later_history(scored):
    """With the turn separator (inserted before every call block t >= 2, 1-based) call 1's supervision is
    still the aligned one; every later call is scored in a different history than aligned, and than the
    joined (unseparated) flat rows: the separator is part of its state."""
    vs_aligned, vs_joined = (
        _per_call_kl(scored, scored.aligned, scored.separated),
        _per_call_kl(scored, scored.flat, scored.separated),
    )
    print("teacher KL(aligned || separated flat) per call: " + ", ".join(f"{v:.3e}" for v in vs_aligned))
    assert vs_aligned[0] < 1e-6 and vs_joined[0] < 1e-6
    assert min(vs_aligned[1:]) > 1e-2
    assert min(vs_joined[1:]) > 1e-4
