"""The actor loss MemOPD installs on verl's actor: ``c_PPO*(L_PPO - alpha*H) + lambda*L_OPD``.

A picklable callable (sent once to every actor worker with verl's ``set_loss_fn``) around
:func:`verl_memopd.losses.actor.memopd_actor_loss`. It holds the frozen teacher output head,
loaded lazily in the worker from the teacher's files, and asks the engine for the student's
full-vocabulary logits (``wants_student_logits``). On audit steps it also reports how far the
teacher's flat-layout distribution is from its aligned one (``verl_memopd.trainer.audit``), and
the gradient norm of the PPO and of the OPD term apart (``memopd/grad_norm_logits/{ppo,opd}``).
"""

from __future__ import annotations

from typing import Optional

import torch
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric

from verl_memopd.fields import (
    STUDENT_LOGITS_STREAM,
    TEACHER_HEAD,
    TEACHER_HIDDEN,
    TEACHER_HIDDEN_ALIGNED,
    TEACHER_HIDDEN_FLAT,
    TEACHER_NUM_TOKENS,
)
from verl_memopd.losses.actor import OPDLossConfig, memopd_actor_loss
from verl_memopd.supervision import load_output_head
from verl_memopd.trainer.audit import teacher_layout_kl


class MemopdActorLoss:
    """verl actor-loss hook: ``loss_fn(model_output=..., data=..., dp_group=...) -> (loss, metrics)``."""

    def __init__(self, actor_config, opd_config: OPDLossConfig, teacher_path: Optional[str], ppo_coef: float = 1.0):
        self.actor_config = actor_config
        self.opd_config = opd_config
        self.ppo_coef = ppo_coef
        self.teacher_path = teacher_path
        self.wants_student_logits = opd_config.coef > 0
        self._teacher_head: Optional[torch.Tensor] = None

    def __getstate__(self):
        return {**self.__dict__, "_teacher_head": None}  # ship the path, not the weight

    def teacher_head(self, device) -> torch.Tensor:
        """The frozen teacher head on ``device``: read once per worker, moved once (not per micro-batch)."""
        if self._teacher_head is None or self._teacher_head.device != torch.device(device):
            self._teacher_head = load_output_head(self.teacher_path).float().to(device).requires_grad_(False)
        return self._teacher_head

    def __call__(self, model_output: dict, data, dp_group=None):
        # consumed here, from the engine's own dict: verl concatenates every model-output key left after the loss
        logits_stream = model_output.pop(STUDENT_LOGITS_STREAM, None)
        audit_step = TEACHER_HIDDEN_FLAT in data.keys() or TEACHER_HIDDEN_ALIGNED in data.keys()
        if audit_step and logits_stream is not None:
            model_output = {**model_output, STUDENT_LOGITS_STREAM: logits_stream}
        if self.opd_config.coef > 0 and self.opd_config.transport == "hidden":
            model_output = {**model_output, TEACHER_HEAD: self.teacher_head(data["responses"].device)}
        loss, metrics = memopd_actor_loss(
            self.actor_config,
            self.opd_config,
            model_output,
            data,
            dp_group=dp_group,
            ppo_coef=self.ppo_coef,
            grad_norms=audit_step,
        )
        if audit_step:
            metrics.update(self.teacher_layout_metric(data))
        return loss, metrics

    def teacher_layout_metric(self, data) -> dict:
        """Audit steps: KL(p_T aligned || p_T flat) at this micro-batch's m_T tokens, as a partial sum
        of the global per-token mean (like the ``memopd/*`` loss metrics). ``memopd_teacher_hidden`` is
        the supervision's layout; the audit pass filled the other one (``trainer.teacher.teacher_passes``)."""
        if TEACHER_HIDDEN_ALIGNED in data.keys():  # teacher.state=flat: the supervision is the flat one
            aligned, flat = data[TEACHER_HIDDEN_ALIGNED].values(), data[TEACHER_HIDDEN].values()
        else:
            aligned, flat = data[TEACHER_HIDDEN].values(), data[TEACHER_HIDDEN_FLAT].values()
        kl = teacher_layout_kl(self.teacher_head(aligned.device), aligned, flat, self.opd_config.token_chunk_size)
        weight = tu.get_non_tensor_data(data, "dp_size", 1) / max(
            tu.get_non_tensor_data(data, TEACHER_NUM_TOKENS, 1), 1
        )
        return {"memopd/audit/teacher_aligned_vs_flat_kl": Metric(AggregationType.SUM, kl.sum() * weight)}
