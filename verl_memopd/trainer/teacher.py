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
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass
from typing import Optional

from omegaconf import DictConfig, OmegaConf, open_dict
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig, TrainingWorkerConfig
from verl.workers.engine_workers import TrainingWorker

from verl_memopd.fields import TEACHER_HIDDEN, TEACHER_HIDDEN_ALIGNED, TEACHER_HIDDEN_FLAT
from verl_memopd.supervision import VocabSpec, check_vocab_agreement
from verl_memopd.trainer.config import MemopdConfig

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
