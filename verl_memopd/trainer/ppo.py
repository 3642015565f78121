"""The ``memopd`` trainer: verl's synchronous V1 PPO trainer plus the teacher branch.

Registered with verl's trainer registry; the recipe selects it with
``trainer.v1.trainer_mode=memopd``. One step, in verl's order, with MemOPD's additions marked::

    rollout (memory agent, vLLM)      rows = episodes (one verl row each)
    reward (final-answer F1)
    + restore each row's layout: positions, segments, teacher mask                  (rows.py)
    old log-probs (actor, packed)     + teacher scoring: memopd_teacher_hidden at m_T     (teacher.py)
    ref log-probs / values (packed)
    advantages (GAE over the row's action tokens, or GRPO)
    critic update (packed), actor update: PPO - alpha*H + lambda*OPD                   (loss.py)

Checkpoints, resume, logging and validation are verl's (``PPOTrainerSync``).
"""

from __future__ import annotations

import logging

import ray
from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup, ResourcePoolManager
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.debug import marked_timer

from verl_memopd.losses.actor import OPDLossConfig
from verl_memopd.trainer.config import from_config
from verl_memopd.trainer.loss import MemopdActorLoss
from verl_memopd.trainer.rows import restore_layout
from verl_memopd.trainer.teacher import (
    MemopdCriticWorker,
    MemopdTeacherWorker,
    check_teacher_compatible,
    teacher_worker_config,
)

logger = logging.getLogger(__name__)

TEACHER_POOL = "memopd_teacher_pool"
TEACHER_ROLE = "memopd_teacher"


@register_trainer("memopd")
class MemopdTrainer(PPOTrainerSync):
    """Synchronous PPO with a teacher worker group scoring the packed, state-aligned rows."""

    def __init__(self, config):
        self.memopd = from_config(config)  # fail before any worker starts
        self.teacher_wg = None
        self.vocab_size = None
        if self.memopd.uses_teacher:
            self.vocab_size = check_teacher_compatible(config.actor_rollout_ref.model.path, self.memopd.teacher.path)
        super().__init__(config)

    # --- workers ----------------------------------------------------------------------------
    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        if Role.Critic in self.role_worker_mapping:
            self.role_worker_mapping[Role.Critic] = ray.remote(MemopdCriticWorker)
        if self.memopd.uses_teacher:
            teacher = self.memopd.teacher
            spec = dict(self.resource_pool_manager.resource_pool_spec)
            spec[TEACHER_POOL] = [teacher.n_gpus_per_node] * teacher.nnodes
            self.mapping[TEACHER_ROLE] = TEACHER_POOL
            self.resource_pool_manager = ResourcePoolManager(resource_pool_spec=spec, mapping=self.mapping)

    def _setup(self):
        super()._setup()
        actor_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
        distill = self.memopd.distill
        opd = OPDLossConfig(vocab_size=self.vocab_size or 1, coef=distill.coef, divergence=distill.divergence,
                            transport=distill.transport, token_clamp=distill.token_clamp,
                            token_chunk_size=distill.token_chunk_size)
        self.actor_rollout_wg.set_loss_fn(MemopdActorLoss(actor_config, opd, self.memopd.teacher.path))
        if self.memopd.uses_teacher:
            pool = self.resource_pool_manager.get_resource_pool(TEACHER_ROLE)
            worker = RayClassWithInitArgs(cls=ray.remote(MemopdTeacherWorker),
                                          config=teacher_worker_config(self.config, self.memopd))
            self.teacher_wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=worker,
                                             device_name=self.config.trainer.device)
            self.teacher_wg.reset()
            logger.info("memopd teacher worker group initialized (%d workers)", self.teacher_wg.world_size)

    # --- one step ---------------------------------------------------------------------------
    def _compute_old_log_prob(self, batch, metrics):
        with marked_timer("memopd_layout", self.timing_raw, color="white"):
            metrics.update(restore_layout(batch, self.memopd.layout))
        batch = super()._compute_old_log_prob(batch, metrics)
        if self.teacher_wg is not None:
            with marked_timer("teacher", self.timing_raw, color="purple"):
                batch.extra_info.update({"compute_loss": False,
                                         "temperature": self.config.actor_rollout_ref.rollout.temperature})
                output = self.teacher_wg.infer_batch(batch)
                ray.get(output.futures)
        return batch
