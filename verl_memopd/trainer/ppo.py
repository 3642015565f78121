"""The ``memopd`` trainer: one of verl's V1 PPO trainers plus the teacher branch.

Registered with verl's trainer registry; the recipe selects it with ``trainer.v1.trainer_mode=memopd``.
MemOPD's additions are a mixin (:class:`MemopdMixin`) composed onto the verl trainer that
``memopd.trainer.base`` names (:func:`trainer_class`): ``sync`` (``PPOTrainerSync``, the default),
``colocate_async`` (``PPOTrainerColocateAsync``) or ``separate_async`` (``PPOTrainerSeparateAsync``); the
base's own classes run the loop, weight sync and partial rollouts (docs/async.md). One step, in verl's order,
with MemOPD's additions marked::

    rollout (memory agent, vLLM)      rows = episodes (one verl row each)
    reward (final-answer F1)
    + restore each row's layout: positions, segments, teacher mask                  (rows.py)
    old log-probs (actor, packed;     + teacher scoring: its supervision at m_T            (teacher.py)
      the rollout's own under verl's bypass mode, recomputed on audit steps)
                                        (teacher.state=flat: the rows laid out flat for the teacher
                                        alone, turns separated, then the student's layout restored)
    ref log-probs / values (packed)
    + reward r - beta*[l_old - l_ref]_+ per action token                                 (reward.py)
    advantages (GAE over the row's action tokens, or GRPO)
    critic update (packed), actor update: PPO - alpha*H + lambda*OPD                   (loss.py)

Every ``memopd.audit.every_n_steps``: RCE spot-check in the old-log-prob forward and the teacher's
aligned-vs-flat KL (audit.py).

Every step also logs ``memopd/staleness/*`` from the episodes' records (``verl_memopd.staleness``; 0 on ``sync``).

Checkpoints, resume, logging and validation are verl's (the base trainer's).
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache

import ray
import transfer_queue as tq
from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup, ResourcePoolManager
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.debug import marked_timer

from verl_memopd.agent import errors as agent_errors
from verl_memopd.fields import (
    FLAT_SEPARATOR,
    RCE_FIELD,
    RCE_FLAG,
    RCE_TOLERANCE_FIELD,
    TEACHER_OUTPUT_KEY,
    TEACHER_TRANSPORT,
)
from verl_memopd.trainer.audit import put_rce_records, rce_check, rce_metrics
from verl_memopd.trainer.config import TRAINER_BASES, MemopdConfigError, from_config
from verl_memopd.trainer.critic import MemopdCriticWorker
from verl_memopd.trainer.loss import MemopdActorLoss
from verl_memopd.trainer.offpolicy import batch_staleness_metrics, use_rollout_log_probs
from verl_memopd.trainer.reward import penalise_in_place
from verl_memopd.trainer.rows import restore_layout
from verl_memopd.trainer.teacher import (
    MemopdTeacherWorker,
    check_teacher_compatible,
    flat_separator_ids,
    teacher_passes,
    teacher_worker_config,
)
from verl_memopd.trainer.watchdog import NodeWatchdog, pool_nodes

TEACHER_POOL = "memopd_teacher_pool"
TEACHER_ROLE = "memopd_teacher"


#: memopd.trainer.base -> verl's V1 trainer class
BASES = {
    "sync": PPOTrainerSync,
    "colocate_async": PPOTrainerColocateAsync,
    "separate_async": PPOTrainerSeparateAsync,
}
assert tuple(BASES) == TRAINER_BASES


class MemopdMixin:
    """MemOPD's additions to a verl V1 trainer: a teacher worker group scoring the packed, state-aligned rows,
    the layout restore, the combined loss, the audits and the metrics. Composed before the base class
    (:func:`trainer_class`), so every ``super()`` call reaches the base's own step (e.g. separate_async's
    version-aware old log-probs)."""

    def __init__(self, config):
        self.memopd = from_config(config)  # fail before any worker starts
        self.teacher_wg = None
        self.vocab_size = None
        self.flat_separator: tuple[int, ...] = ()  # the teacher's flat passes' turn separator (_init_tokenizer)
        if self.memopd.uses_teacher:
            self.vocab_size = check_teacher_compatible(config.actor_rollout_ref.model.path, self.memopd.teacher.path)
            k = self.memopd.transport_options().get("k")
            if k is not None and k > self.vocab_size:
                raise MemopdConfigError(f"memopd.distill.topk={k} exceeds the vocabulary size {self.vocab_size}")
        super().__init__(config)
        # verl starts a reference only for its own KL terms; MemOPD's reward penalty needs one too
        self.use_reference_policy = self.use_reference_policy or self.memopd.uses_reference

    def _init_tokenizer(self):
        """verl's tokenizer; then ``memopd.teacher.flat_separator_ids`` resolved against it (start-up refusals
        name the option): the separator of the persistent history the teacher's flat passes score."""
        super()._init_tokenizer()
        if self.memopd.uses_teacher:
            option = self.memopd.teacher.flat_separator_ids
            self.flat_separator = flat_separator_ids(option, self.tokenizer, self.vocab_size)
            print(f"[verl-memopd] teacher flat history: turn separator ids {list(self.flat_separator)}")

    def _build_replay_buffer(self):
        # verl 0.9.1 keys its behaviour on ``trainer_mode`` (sync: its replay buffer, whole-batch dataloader
        # fetches, no TransferQueue state in checkpoints; the async modes: ReplayBufferAsync, single-prompt
        # fetches, in-flight prompts checkpointed) and reads ``trainer.v1.<mode>``; this trainer runs under its
        # own registry name, so it reports its base's mode from here on (PPOTrainer.__init__ calls this first).
        base = self.memopd.trainer.base
        self.trainer_mode = base
        self.parameter_sync_step = self.config.trainer.v1.get(base, {}).get("parameter_sync_step", 1)
        # verl reports rollouts that all failed without their cause; the agent loop recorded it
        return agent_errors.surface_in(super()._build_replay_buffer())

    # --- workers ----------------------------------------------------------------------------
    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        if self.memopd.uses_reference:
            self._add_reference_role()
        if Role.Critic in self.role_worker_mapping:
            self.role_worker_mapping[Role.Critic] = ray.remote(MemopdCriticWorker)
        if self.memopd.uses_teacher and self.memopd.teacher.placement == "separate":
            teacher = self.memopd.teacher
            spec = dict(self.resource_pool_manager.resource_pool_spec)
            spec[TEACHER_POOL] = [teacher.n_gpus_per_node] * teacher.nnodes
            self.mapping[TEACHER_ROLE] = TEACHER_POOL
            self.resource_pool_manager = ResourcePoolManager(resource_pool_spec=spec, mapping=self.mapping)

    def _add_reference_role(self):
        """The reference model for ``r - beta*[l_old - l_ref]_+``, placed as verl places its own:
        inside the hybrid actor worker (ActorRolloutRef), or as a RefPolicy worker next to a
        standalone actor. LoRA actors keep verl's reference-in-actor (adapters disabled)."""
        model = self.config.actor_rollout_ref.model
        lora_rank = model.get("lora", {}).get("rank", 0) or model.get("lora_rank", 0)
        if lora_rank > 0 or model.get("lora_adapter_path") is not None:
            return
        if Role.ActorRollout in self.role_worker_mapping:
            self.role_worker_mapping[Role.ActorRolloutRef] = self.role_worker_mapping.pop(Role.ActorRollout)
            self.mapping[Role.ActorRolloutRef] = self.mapping.pop(Role.ActorRollout)
        elif Role.Actor in self.role_worker_mapping and Role.RefPolicy not in self.role_worker_mapping:
            self.role_worker_mapping[Role.RefPolicy] = self.role_worker_mapping[Role.Actor]
            self.mapping[Role.RefPolicy] = self.mapping[Role.Actor]

    def _setup(self):
        super()._setup()
        # a lost node ends the run, naming it, instead of leaving verl waiting on its workers (watchdog.py)
        pools = self.resource_pool_manager.resource_pool_dict.values()
        self.node_watchdog = NodeWatchdog(pool_nodes(pg for pool in pools for pg in pool.pgs or ()))
        self.node_watchdog.start()
        actor_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
        opd = self.memopd.opd_loss_config(vocab_size=self.vocab_size or 1)
        self.actor_rollout_wg.set_loss_fn(
            MemopdActorLoss(actor_config, opd, self.memopd.teacher.path, ppo_coef=self.memopd.ppo_coef)
        )
        if self._teacher_colocated:
            # the teacher lives in the actor's fused Ray actors (added to its pool's classes below);
            # spawn gives it its own worker group view with verl's method names
            self.teacher_wg = self.actor_rollout_wg.spawn(prefix_set={TEACHER_ROLE})[TEACHER_ROLE]
        elif self.memopd.uses_teacher:
            pool = self.resource_pool_manager.get_resource_pool(TEACHER_ROLE)
            self.teacher_wg = RayWorkerGroup(
                resource_pool=pool, ray_cls_with_init=self._teacher_class(), device_name=self.config.trainer.device
            )
        if self.teacher_wg is not None:
            self.teacher_wg.reset()
            print(
                f"[verl-memopd] teacher worker group initialized ({self.memopd.teacher.placement}, "
                f"{self.teacher_wg.world_size} workers)"
            )  # console, like verl's own start-up lines

    def _teacher_class(self) -> RayClassWithInitArgs:
        return RayClassWithInitArgs(
            cls=ray.remote(MemopdTeacherWorker), config=teacher_worker_config(self.config, self.memopd)
        )

    @property
    def _teacher_colocated(self) -> bool:
        return self.memopd.uses_teacher and self.memopd.teacher.placement == "colocate"

    # verl 0.9.1's ``_setup`` assigns this dict once (pool -> {role: worker class}), fills it and
    # spawns every pool's roles as one fused Ray actor per GPU, with no hook in between. Assigning
    # through this property adds the teacher to the actor's pool, so ``placement: colocate`` runs it
    # in the same processes as actor, reference and critic (like verl's own colocated roles).
    @property
    def resource_pool_to_cls(self):
        return self._pool_classes

    @resource_pool_to_cls.setter
    def resource_pool_to_cls(self, value):
        self._pool_classes = value
        if self._teacher_colocated:
            actor_role = next(r for r in (Role.Actor, Role.ActorRolloutRef, Role.ActorRollout) if r in self.mapping)
            value[self.resource_pool_manager.get_resource_pool(actor_role)][TEACHER_ROLE] = self._teacher_class()

    # --- one step ---------------------------------------------------------------------------
    def _restore_layout(self, batch, layout: str) -> dict[str, float]:
        return restore_layout(batch, layout, self.memopd.share_prefix_across_group, self.memopd.distill.teacher_mask)

    def _compute_old_log_prob(self, batch, metrics):
        """verl's old-log-prob stage, extended: restore the layout, (audit steps) the actor's recompute and the RCE
        check, then the teacher pass. verl 0.9.1 times the whole call as ``timing_s/old_log_prob``, so that figure
        includes ``timing_s/memopd_layout`` and the teacher's own timer even in bypass mode, where the actor's
        forward pass is skipped (an h12 step: old_log_prob ~36 s ~= the teacher pass)."""
        with marked_timer("memopd_layout", self.timing_raw, color="white"):
            metrics.update(self._restore_layout(batch, self.memopd.layout))
        audit = self.memopd.audits_at(self.global_steps)
        rce = audit and self.memopd.audit.rce
        if rce:
            put_rce_records(batch)  # each row's invocation records: the alone pass is built from them
            batch.extra_info[RCE_FLAG] = True  # the actor engine re-runs every call alone (audit.py)
        meta = batch
        with self._recompute_old_log_probs(audit) as recomputed:
            batch = super()._compute_old_log_prob(batch, metrics)
        if recomputed:
            use_rollout_log_probs(batch)  # bypass's ratio pi_theta / pi_v on audit steps too (offpolicy.py)
        if rce:
            meta.extra_info.pop(RCE_FLAG, None)  # not for the reference / critic forwards
            batch.extra_info.pop(RCE_FLAG, None)
            rows = tq.kv_batch_get(
                keys=batch.keys, partition_id=batch.partition_id, select_fields=[RCE_FIELD, RCE_TOLERANCE_FIELD]
            )
            diffs, tolerances = rows[RCE_FIELD].unbind(), rows[RCE_TOLERANCE_FIELD].unbind()
            metrics.update(rce_metrics(diffs))
            metrics.update(rce_check(diffs, tolerances, [str(k) for k in batch.keys], self.memopd.audit.on_failure))
        if self.teacher_wg is not None:
            self._teacher_step(batch, audit)
        return batch

    @contextmanager
    def _recompute_old_log_probs(self, audit: bool):
        """verl's bypass mode (``algorithm.rollout_correction.bypass_mode=true``) takes the rollout's log-probs as
        the old ones and skips the actor's forward pass. The audits ride on that pass (the RCE spot-check, the
        rollout vs trainer log-prob match), so audit steps still run it, with bypass off for that call only;
        yields whether it did (the caller then writes the rollout log-probs back as the old ones)."""
        corr = self.config.algorithm.get("rollout_correction", None)
        if not (audit and corr is not None and corr.get("bypass_mode", False)):
            yield False
            return
        corr.bypass_mode = False
        try:
            yield True
        finally:
            corr.bypass_mode = True

    def _teacher_step(self, batch, audit: bool) -> None:
        """The teacher's passes of the step (:func:`teacher_passes`): the supervision under the teacher's
        state, then on audit steps the other layout. Rows are laid out for each pass and handed back in
        the student's layout, which the reference, the critic and the actor update read. A flat pass under
        another student layout scores the separated persistent history (``self.flat_separator``); with
        ``memopd.layout=flat`` teacher and student share the rows as they are, unseparated."""
        layout = self.memopd.layout
        for i, teacher_pass in enumerate(teacher_passes(self.memopd, audit)):
            name = "teacher" if i == 0 else "memopd_audit_teacher"
            with marked_timer(name, self.timing_raw, color="purple"):
                if teacher_pass.layout != layout:
                    layout = teacher_pass.layout
                    self._restore_layout(batch, layout)
                separate = layout == "flat" and self.memopd.layout != "flat"
                separator = self.flat_separator if separate else ()
                self._score_with_teacher(batch, output_key=teacher_pass.output_key, separator=separator)
        if layout != self.memopd.layout:
            with marked_timer("memopd_layout", self.timing_raw, color="white"):
                self._restore_layout(batch, self.memopd.layout)

    def _score_with_teacher(self, batch, output_key=None, separator: tuple[int, ...] = ()):
        """The teacher worker group scores the rows' current layout into TransferQueue: the transport's
        payload, or (``output_key``) its hidden states under that field; flat rows with ``separator``
        inserted before every call block t >= 1 (``memopd_flat_separator``)."""
        batch.extra_info.update(
            {
                "compute_loss": False,
                "temperature": self.config.actor_rollout_ref.rollout.temperature,
                TEACHER_TRANSPORT: {
                    "name": self.memopd.distill.transport,
                    "vocab_size": self.vocab_size,
                    **self.memopd.transport_options(),
                },
            }
        )
        if output_key is not None:
            batch.extra_info[TEACHER_OUTPUT_KEY] = output_key
        if separator:
            batch.extra_info[FLAT_SEPARATOR] = tuple(separator)
        output = self.teacher_wg.infer_batch(batch)
        ray.get(output.futures)
        for key in (TEACHER_OUTPUT_KEY, TEACHER_TRANSPORT, FLAT_SEPARATOR):
            batch.extra_info.pop(key, None)

    def _compute_advantage(self, batch, metrics):
        """verl's advantage step on ``r - beta*[l_old - l_ref]_+`` (``memopd.kl_penalty_coef``)."""
        if not self.memopd.uses_reference:
            return super()._compute_advantage(batch, metrics)
        after, penalty_metrics = penalise_in_place(batch, self.memopd.kl_penalty_coef)
        metrics.update(penalty_metrics)
        batch = super()._compute_advantage(batch, metrics)
        # task scores back under rm_scores (critic/score = F1); the penalised ones under token_level_rewards
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=after)
        return batch

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        """verl's step metrics, plus ``memopd/staleness/*`` from the episodes' invocation records."""
        super()._compute_metrics(batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)
        metrics.update(batch_staleness_metrics(batch, global_steps))


@lru_cache(maxsize=None)
def trainer_class(base: str) -> type:
    """MemOPD on verl's V1 trainer ``base`` (``memopd.trainer.base``): ``MemopdMixin`` composed before it."""
    if base not in BASES:
        raise MemopdConfigError(f"memopd.trainer.base={base!r}: expected one of {TRAINER_BASES}")
    if base == "sync":
        return MemopdTrainer
    name = "Memopd" + "".join(part.title() for part in base.split("_")) + "Trainer"
    return type(name, (MemopdMixin, BASES[base]), {"__module__": __name__, "__qualname__": name})


@register_trainer("memopd")
class MemopdTrainer(MemopdMixin, PPOTrainerSync):
    """MemOPD on verl's synchronous trainer; constructed with ``memopd.trainer.base`` set to an async base, it
    builds that base's composition instead (verl's registry maps one name to one class, and main_ppo
    constructs ``get_trainer_cls(trainer_mode)(config=...)``: ``__new__`` is the one place to choose)."""

    def __new__(cls, config, *args, **kwargs):
        base = (config.get("memopd") or {}).get("trainer", {}).get("base", "sync")
        if cls is MemopdTrainer and base != "sync":
            return trainer_class(base)(config, *args, **kwargs)  # not a MemopdTrainer: Python skips __init__
        return super().__new__(cls)
