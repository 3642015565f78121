"""The teacher worker group: a forward-only verl ``TrainingWorker`` on the packed layout.

It runs the teacher through verl's own worker/engine machinery (FSDP, the ``memopd_teacher``
engine of :mod:`verl_memopd.trainer.engine`), so it scores exactly the rows -- positions and
call-block visibility -- that the actor trains on (``memopd.teacher.state=aligned``), or the same
rows in the flat layout, the persistent history (``state=flat``; see :func:`teacher_passes`), and writes
its supervision at m_T positions to TransferQueue: ``memopd_teacher_hidden`` (the ``hidden``
transport: final hidden states, (B, A_b*, H)) or the ``topk`` transport's ids / log-probs / tail.
With ``hidden`` the actor turns the states into exact full-vocabulary teacher log-probs with a
frozen copy of the teacher's output head (``supervision.load_output_head``); no ``[tokens, vocab]``
logits cross workers.

In the flat layout the persistent history has its turns separated as the chat template writes them:
:func:`flat_separator_ids` resolves ``memopd.teacher.flat_separator_ids`` at start-up, and the trainer hands
the ids to the flat passes (``memopd_flat_separator``; ``verl_memopd.streams.flat_history``).
"""

from __future__ import annotations

import re
from copy import deepcopy
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig, TrainingWorkerConfig
from verl.workers.engine_workers import TrainingWorker

from verl_memopd.fields import TEACHER_HIDDEN, TEACHER_HIDDEN_ALIGNED, TEACHER_HIDDEN_FLAT
from verl_memopd.supervision import VocabSpec, check_vocab_agreement
from verl_memopd.trainer.config import MemopdConfig, MemopdConfigError

TEACHER_MODEL_TYPE = "memopd_teacher"


@dataclass(frozen=True)
class TeacherPass:
    """One teacher forward of a step: the layout the rows are laid out in, and where its output goes
    (``output_key`` None: the transport's supervision payload; else hidden states under that field)."""

    layout: str
    output_key: Optional[str] = None


def teacher_passes(memopd: MemopdConfig, audit: bool) -> list[TeacherPass]:
    """The teacher's forwards of one step, in order. The first is the supervision the loss consumes,
    under ``memopd.teacher_layout`` (the student's layout, or flat with ``teacher.state=flat``).
    On audit steps (``audit.teacher_flat_kl``) the teacher also gives its hidden states under the
    *other* layout, so the actor can report ``KL(p_T aligned || p_T flat)`` either way round::

        state    supervision          audit pass
        aligned  student layout       flat    -> memopd_teacher_hidden_flat
        flat     flat                 aligned -> memopd_teacher_hidden_aligned

    A transport other than ``hidden`` ships no hidden states, so an audit step adds a pass that gives
    the supervision layout's hidden states under ``memopd_teacher_hidden``.
    """
    passes = [TeacherPass(memopd.teacher_layout)]
    if not (audit and memopd.audit.teacher_flat_kl):
        return passes
    if memopd.distill.transport != "hidden":
        passes.append(TeacherPass(memopd.teacher_layout, TEACHER_HIDDEN))
    if memopd.teacher.state == "flat":
        passes.append(TeacherPass(memopd.layout, TEACHER_HIDDEN_ALIGNED))
    else:
        passes.append(TeacherPass("flat", TEACHER_HIDDEN_FLAT))
    return passes


class MemopdTeacherWorker(TrainingWorker):
    """Forward-only teacher (``infer_batch`` writes ``memopd_teacher_hidden``)."""


def teacher_worker_config(config: DictConfig, memopd: MemopdConfig) -> TrainingWorkerConfig:
    """verl's worker config for the teacher: the actor's model settings with the teacher's path,
    the reference model's forward-only FSDP engine settings, no optimizer."""
    model_node = deepcopy(config.actor_rollout_ref.model)
    with open_dict(model_node):
        model_node.path = memopd.teacher.path
        model_node.tokenizer_path = None
        model_node.model_type = TEACHER_MODEL_TYPE
        model_node.override_config = OmegaConf.merge(
            model_node.get("override_config", {}), {"attn_implementation": memopd.teacher.attn_implementation}
        )
        model_node.lora_rank = 0  # the teacher is frozen: no adapters
        if model_node.get("lora") is not None:
            model_node.lora.rank = 0
    model_config = omega_conf_to_dataclass(model_node, dataclass_type=HFModelConfig)
    engine_config = omega_conf_to_dataclass(config.actor_rollout_ref.ref.fsdp_config)
    engine_config.forward_only = True
    engine_config.use_remove_padding = bool(config.actor_rollout_ref.model.get("use_remove_padding", False))
    engine_config.infer_micro_batch_size_per_gpu = config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
    engine_config.infer_max_token_len_per_gpu = config.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu
    engine_config.use_dynamic_bsz = bool(config.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz)
    return TrainingWorkerConfig(
        model_type=TEACHER_MODEL_TYPE,
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=None,
        checkpoint_config=None,
    )


def _vocab_spec(name: str, path: str) -> VocabSpec:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(path)
    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:
        generation = None
    return VocabSpec.from_hf(name, tokenizer, AutoConfig.from_pretrained(path), generation)


def check_teacher_compatible(student_path: str, teacher_path: str) -> int:
    """Start-up check: student and teacher share tokenizer length and special ids; returns V."""
    return check_vocab_agreement(_vocab_spec("student", student_path), _vocab_spec("teacher", teacher_path))


#: stand-ins for two turns' contents while rendering the chat template (private-use characters)
_TURNS = ("\ue000memopd-turn-1\ue000", "\ue000memopd-turn-2\ue000")


def chat_turn_separator(tokenizer: Any) -> tuple[int, ...]:
    """The ids the chat template writes between one turn's end-of-turn token and the next turn's start token
    (ChatML ``<|im_end|>\\n<|im_start|>``: the ids of ``"\\n"``), from a rendered user/assistant exchange;
    the text is tokenized without special tokens. Refuses (naming the option) a tokenizer without a chat
    template or one whose turns are not bounded by special tokens."""
    where = "memopd.teacher.flat_separator_ids=null (derive the turn separator from the chat template)"
    if not getattr(tokenizer, "chat_template", None):
        raise MemopdConfigError(f"{where}: the tokenizer has no chat template; set the ids, or [] for none")
    messages = [{"role": "user", "content": _TURNS[0]}, {"role": "assistant", "content": _TURNS[1]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    first, second = text.find(_TURNS[0]), text.find(_TURNS[1])
    specials = sorted({str(t) for t in tokenizer.all_special_tokens if str(t)}, key=len, reverse=True)
    between = text[first + len(_TURNS[0]) : second] if 0 <= first < second else ""
    marks = list(re.finditer("|".join(map(re.escape, specials)), between)) if specials else []
    if len(marks) < 2:
        raise MemopdConfigError(
            f"{where}: no turn boundary (an end-of-turn token, then the next turn's start token) between two "
            f"rendered turns: {between!r}; set the ids, or [] for none"
        )
    return tuple(tokenizer.encode(between[marks[0].end() : marks[1].start()], add_special_tokens=False))


def flat_separator_ids(option: Optional[Sequence[int]], tokenizer: Any, vocab_size: int) -> tuple[int, ...]:
    """``memopd.teacher.flat_separator_ids`` resolved: the ids as given, or (``None``) the student tokenizer's
    :func:`chat_turn_separator`; every id must lie in ``[0, vocab_size)``."""
    ids = chat_turn_separator(tokenizer) if option is None else tuple(int(i) for i in option)
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise MemopdConfigError(
            f"memopd.teacher.flat_separator_ids={list(ids)}: ids {bad} outside the vocabulary [0, {vocab_size})"
        )
    return ids
