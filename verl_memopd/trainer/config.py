"""The recipe's ``memopd:`` config tree, mirrored key by key (see hydra_configs/recipe/memopd.yaml).

Everything MemOPD adds to a verl run lives under the top-level ``memopd:`` key (verl's own config
nodes are dataclass-backed and reject unknown keys). ``from_config`` validates the tree and
refuses the silent failure mode of Hydra config groups: when the search-path plugin is not
installed, ``+recipe=memopd`` becomes the plain string ``recipe: memopd`` and verl would train
without MemOPD.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

if TYPE_CHECKING:
    from verl_memopd.losses.actor import OPDLossConfig

#: Layouts the trainer can execute: packed = MemOPD, per_call = the same rows run call by call
#: (packing's speed baseline, numerically equal), flat = every forward on the flat layout (diagnostic).
TRAINER_LAYOUTS = ("packed", "per_call", "flat")
#: The state the teacher scores: aligned = the student's rows (MemOPD), flat = the persistent history
#: (positions 0..L-1, one causal segment; the paper's persistent-history teacher scoring).
TEACHER_STATES = ("aligned", "flat")
TEACHER_PLACEMENTS = ("separate", "colocate")
#: m_T <= m_act: action = every sampled token (the paper's main setting); answer = the final (answer) call's
#: tokens only; memory = the memory calls' tokens only (ablations: where does the teacher's supervision act?)
TEACHER_MASK_POLICIES = ("action", "answer", "memory")
AUDIT_ON_FAILURE = ("raise", "warn")  # memopd.audit.on_failure (verl_memopd.trainer.audit.rce_check)
#: memopd.trainer.base: the verl V1 trainer MemOPD's additions compose onto (docs/async.md)
TRAINER_BASES = ("sync", "colocate_async", "separate_async")
#: verl's own trainer_mode names: with the memopd tree they would run verl's trainer without MemOPD
VERL_TRAINER_MODES = TRAINER_BASES


class MemopdConfigError(ValueError):
    """The ``memopd:`` tree (or its interplay with verl's config) is invalid."""


@dataclass(frozen=True)
class TeacherConfig:
    """``memopd.teacher``: the teacher model and where it runs.

    path: HF model folder of the teacher (shares the student's tokenizer / vocabulary).
    placement: ``separate`` -- its own resource pool of ``n_gpus_per_node x nnodes`` (GPUs; on the
        cpu platform logical GPUs = processes); ``colocate`` -- in the actor's processes, on the
        actor's GPUs (``trainer.n_gpus_per_node x trainer.nnodes``), like verl's reference/critic.
    n_gpus_per_node / nnodes: size of the teacher pool (``separate`` only; ``colocate`` refuses
        values other than 1 x 1: the teacher runs on the actor's GPUs).
    attn_implementation: attention for the teacher's packed forward (memopd_torch on CPU,
        memopd_fa2 with flash-attn on CUDA).
    state: the state the teacher scores each sampled token in. ``aligned`` (MemOPD): the student's
        rows, exactly as sampled. ``flat``: the persistent history -- call t's block after q and
        every earlier block, positions 0..L-1, one causal segment (the paper's matched control,
        "persistent-history teacher scoring"); student, reference and critic stay on the aligned rows.
    flat_separator_ids: ``state=flat``: the token ids between one call's block and the next in the
        persistent history, so its turns are separated as the chat template writes them (ChatML:
        ``<|im_end|>\\n<|im_start|>``, the ids of ``"\\n"``). ``None`` = derived at start-up from the
        student tokenizer's chat template (:func:`verl_memopd.trainer.teacher.flat_separator_ids`); a list of
        ids overrides; ``[]`` = blocks joined as they are (no separator). Checked against the vocabulary.
    """

    path: Optional[str] = None
    placement: str = "separate"
    n_gpus_per_node: int = 1
    nnodes: int = 1
    attn_implementation: str = "memopd_torch"
    state: str = "aligned"
    flat_separator_ids: Optional[list[int]] = None


@dataclass(frozen=True)
class DistillConfig:
    """``memopd.distill``: the teacher branch ``lambda * L_OPD`` (``verl_memopd.losses``).

    The keys the actor loss reads (``LOSS_KEYS``) are ``losses.actor.OPDLossConfig``'s fields of the same name
    (:meth:`MemopdConfig.opd_loss_config`); ``topk`` goes to the teacher's transport, ``teacher_mask`` to the rows.

    coef: lambda >= 0; 0 = PPO only (no teacher is started).
    divergence: reverse_kl (paper) | forward_kl | jsd.  jsd_beta: beta of ``jsd`` (0.5 = symmetric; only ``jsd``
    reads it, so another divergence refuses a value other than 0.5).  transport: hidden (exact) | topk.
    topk: tokens per position the ``topk`` transport ships (default null = 128); refused with ``hidden``.
    teacher_mask: which sampled tokens the teacher supervises (``TEACHER_MASK_POLICIES``): ``action`` = m_T = m_act
    (paper's main setting), ``answer`` = the final call's, ``memory`` = the memory calls'.
    token_clamp: optional cap on each token's divergence.  token_chunk_size: tokens per chunk.
    vocab_chunk_size: vocabulary columns per chunk (null = the whole vocabulary at once; set it when
    ``token_chunk_size x V`` fp32 logits do not fit).
    top_mass_tokens: the teacher's top tokens whose teacher / student probability mass is logged
    (``actor/memopd/{teacher,student}_top_mass``); 0 = not logged, and the divergence skips its top-k pass.
    """

    coef: float = 1.0
    divergence: str = "reverse_kl"
    jsd_beta: float = 0.5
    transport: str = "hidden"
    topk: Optional[int] = None
    teacher_mask: str = "action"
    token_clamp: Optional[float] = None
    token_chunk_size: int = 128
    vocab_chunk_size: Optional[int] = None
    top_mass_tokens: int = 8


#: the ``memopd.distill`` keys the actor loss reads: ``losses.actor.OPDLossConfig``'s fields but ``vocab_size``
LOSS_KEYS = (
    "coef",
    "divergence",
    "jsd_beta",
    "transport",
    "token_clamp",
    "token_chunk_size",
    "vocab_chunk_size",
    "top_mass_tokens",
)


@dataclass(frozen=True)
class AuditConfig:
    """``memopd.audit``: in-training checks of the layout, on every ``every_n_steps``-th step (0 = off).

    rce: Rollout Context Equivalence spot-check in the actor's old-log-prob forward: every call of
        every row is re-run alone (its own ``[q, x_t, a_t]``, positions 0..n-1) under the model's stock
        attention (sdpa; flash_attention_2 with flash-attn on CUDA), and its full-vocabulary logits at the action tokens
        are compared with the packed forward's (``memopd/audit/rce_max_abs_diff``, ``rce_pass``).
    on_failure: what a call above its RCE bound (the rule: ``verl_memopd.rce``'s docstring) does:
        ``raise`` (stop training with an error naming the row, call and difference) or ``warn``
        (log it; ``memopd/audit/rce_failed_calls`` counts the calls).
    teacher_flat_kl: the teacher also scores the step's rows under the flat layout (persistent
        history); the actor loss reports KL(p_T aligned || p_T flat) at m_T tokens
        (``actor/memopd/audit/teacher_aligned_vs_flat_kl``): how much the baseline's supervision differs.
    """

    every_n_steps: int = 10
    rce: bool = True
    teacher_flat_kl: bool = True
    on_failure: str = "raise"

    def __post_init__(self) -> None:
        if self.on_failure not in AUDIT_ON_FAILURE:
            raise MemopdConfigError(f"memopd.audit.on_failure={self.on_failure!r}: expected one of {AUDIT_ON_FAILURE}")


@dataclass(frozen=True)
class TrainerConfig:
    """``memopd.trainer``: which of verl's V1 trainers MemOPD's additions are composed onto (docs/async.md).

    base: ``sync`` (verl's ``PPOTrainerSync``: generate, then train, every sample on-policy), ``colocate_async``
        (``PPOTrainerColocateAsync``: rollout and training share the devices, partial rollouts paused at the
        step's end and resumed under the new weights, a warm-up batch in flight) or ``separate_async``
        (``PPOTrainerSeparateAsync``: a standalone rollout pool, weights sent every step through a checkpoint
        engine: ``actor_rollout_ref.rollout.checkpoint_engine.backend`` nccl / nixl / mooncake, GPUs only).
    """

    base: str = "sync"

    def __post_init__(self) -> None:
        if self.base not in TRAINER_BASES:
            raise MemopdConfigError(f"memopd.trainer.base={self.base!r}: expected one of {TRAINER_BASES}")


@dataclass(frozen=True)
class MemopdConfig:
    """``memopd``: layout, task-branch coefficients, teacher branch and audits; ``agent`` is read by
    the memory agent loop itself.

    layout: what every forward (actor, reference, critic, teacher) executes: ``packed`` (MemOPD:
        restored positions, block visibility), ``per_call`` (the same rows, every forward running each
        call alone with ``q`` repeated: the unpacked speed baseline) or ``flat`` (the flat layout for everyone,
        a diagnostic: positions 0..L-1 and plain causal attention for the student too, so its
        log-probs are not the rollout's; the blocks joined as they are, ``teacher.flat_separator_ids``
        unused). The paper's persistent-history baseline is ``teacher.state=flat``: the flat layout (turns
        separated) for the teacher only.
    entropy_coef: alpha in ``L = L_PPO - alpha*H + lambda*L_OPD``; the recipe points verl's
        ``actor_rollout_ref.actor.entropy_coeff`` at it.
    ppo_coef: weight of verl's PPO term ``L_PPO - alpha*H`` in the actor loss (1 = the method; 0 = on-policy
        distillation alone, the critic still trained for matched runs).
    kl_penalty_coef: beta of the reward's clipped KL penalty ``r - beta*[l_old - l_ref]_+``
        (``verl_memopd.trainer.reward``); > 0 starts verl's reference model; 0 = no penalty, no reference.
    share_prefix_across_group: packed layout: rows of one micro-batch with the same prompt (verl's uid,
        ``q`` token ids verified identical; e.g. the ``rollout.n`` samples) compute ``q`` once, every
        call block of the group attending to it (``verl_memopd.streams.share_prefix``); exact, outputs and
        gradients equal to fp32 noise. False = every row computes its own ``q``.
    """

    layout: str = "packed"
    share_prefix_across_group: bool = True
    entropy_coef: float = 0.0
    kl_penalty_coef: float = 0.001
    ppo_coef: float = 1.0
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    agent: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.share_prefix_across_group, bool):
            raise MemopdConfigError(
                f"memopd.share_prefix_across_group={self.share_prefix_across_group!r}: expected true or false"
            )
        if self.layout not in TRAINER_LAYOUTS:
            raise MemopdConfigError(f"memopd.layout={self.layout!r}: expected one of {TRAINER_LAYOUTS}")
        if self.teacher.placement not in TEACHER_PLACEMENTS:
            raise MemopdConfigError(
                f"memopd.teacher.placement={self.teacher.placement!r}: expected one of {TEACHER_PLACEMENTS}"
            )
        if self.teacher.placement == "separate" and min(self.teacher.n_gpus_per_node, self.teacher.nnodes) < 1:
            raise MemopdConfigError(
                f"memopd.teacher: placement=separate needs n_gpus_per_node >= 1 and nnodes >= 1, "
                f"got {self.teacher.n_gpus_per_node} x {self.teacher.nnodes}; or placement=colocate"
            )
        if self.teacher.placement == "colocate" and (self.teacher.n_gpus_per_node, self.teacher.nnodes) != (1, 1):
            raise MemopdConfigError(
                f"memopd.teacher: n_gpus_per_node={self.teacher.n_gpus_per_node}, nnodes="
                f"{self.teacher.nnodes} size a separate teacher pool; placement=colocate runs the "
                f"teacher on the actor's GPUs (leave them at 1 x 1, or placement=separate)"
            )
        self._check_teacher_state()
        self._check_transport()
        if self.distill.teacher_mask not in TEACHER_MASK_POLICIES:
            raise MemopdConfigError(
                f"memopd.distill.teacher_mask={self.distill.teacher_mask!r}: expected one of {TEACHER_MASK_POLICIES}"
            )
        for name in ("entropy_coef", "kl_penalty_coef", "ppo_coef"):
            if getattr(self, name) < 0:
                raise MemopdConfigError(f"memopd.{name}={getattr(self, name)} must be >= 0")
        if self.ppo_coef == 0 and self.distill.coef == 0:
            raise MemopdConfigError(
                "memopd.ppo_coef=0 and memopd.distill.coef=0: the actor loss would be empty "
                "(nothing trains); keep one of them > 0"
            )
        if self.audit.every_n_steps < 0:
            raise MemopdConfigError(f"memopd.audit.every_n_steps={self.audit.every_n_steps} must be >= 0 (0 = off)")
        if self.distill.coef < 0:
            raise MemopdConfigError(f"memopd.distill.coef={self.distill.coef} must be >= 0")
        if self.distill.top_mass_tokens < 0:
            raise MemopdConfigError(
                f"memopd.distill.top_mass_tokens={self.distill.top_mass_tokens} must be >= 0 (0 = no top-mass metrics)"
            )
        try:
            self.opd_loss_config(vocab_size=1)  # the loss's own checks (names, chunk sizes, jsd_beta); V comes later
        except ValueError as e:
            raise MemopdConfigError(f"memopd.distill: {e}") from None
        if self.distill.coef > 0:
            if not self.teacher.path:
                raise MemopdConfigError(
                    "memopd.teacher.path is not set but memopd.distill.coef > 0: set the teacher "
                    "model folder, or memopd.distill.coef=0 for PPO only"
                )
            if not (Path(self.teacher.path).expanduser() / "config.json").is_file():
                raise MemopdConfigError(f"memopd.teacher.path={self.teacher.path}: no model there (no config.json)")

    def _check_teacher_state(self) -> None:
        state = self.teacher.state
        if state not in TEACHER_STATES:
            raise MemopdConfigError(f"memopd.teacher.state={state!r}: expected one of {TEACHER_STATES}")
        if state == "flat" and self.distill.coef == 0:
            raise MemopdConfigError(
                "memopd.teacher.state=flat with memopd.distill.coef=0: there is no teacher to "
                "score the flat history (PPO only); drop the state or set coef > 0"
            )
        ids = self.teacher.flat_separator_ids
        if ids is not None and not (isinstance(ids, (list, tuple)) and all(type(i) is int and i >= 0 for i in ids)):
            raise MemopdConfigError(
                f"memopd.teacher.flat_separator_ids={ids!r}: expected null (from the chat template) or a list of "
                f"token ids >= 0 ([] = no separator)"
            )
        if state == "flat" and self.layout == "flat":
            raise MemopdConfigError(
                "memopd.teacher.state=flat with memopd.layout=flat: memopd.layout=flat already "
                "puts every forward on the flat layout; for the matched control (the teacher alone scores the "
                "persistent history) keep memopd.layout=packed"
            )

    def _check_transport(self) -> None:
        topk = self.distill.topk
        if topk is not None and self.distill.transport != "topk":
            raise MemopdConfigError(
                f"memopd.distill.topk={topk} is read by transport=topk only; "
                f"transport={self.distill.transport!r} ships the exact distribution"
            )
        if topk is not None and topk < 1:
            raise MemopdConfigError(f"memopd.distill.topk={topk} must be >= 1 (or null for 128)")

    def opd_loss_config(self, vocab_size: int) -> "OPDLossConfig":
        """The actor loss's teacher branch: the ``LOSS_KEYS`` of ``memopd.distill``, for a vocabulary of V."""
        from verl_memopd.losses.actor import OPDLossConfig

        return OPDLossConfig(vocab_size=vocab_size, **{key: getattr(self.distill, key) for key in LOSS_KEYS})

    def transport_options(self) -> dict:
        """Keyword options of ``supervision.get_transport(distill.transport, ...)`` on the teacher side."""
        if self.distill.transport != "topk":
            return {}
        return {
            "token_chunk_size": self.distill.token_chunk_size,
            **({"k": self.distill.topk} if self.distill.topk is not None else {}),
        }

    @property
    def teacher_layout(self) -> str:
        """The layout the teacher's supervision is scored under: the student's, or flat (teacher.state=flat)."""
        return "flat" if self.teacher.state == "flat" else self.layout

    @property
    def uses_teacher(self) -> bool:
        return self.distill.coef > 0

    @property
    def uses_reference(self) -> bool:
        return self.kl_penalty_coef > 0

    def audits_at(self, step: int) -> bool:
        """Whether ``step`` (verl's global step, from 1) runs the audits (packed layout only: per_call
        rows are the calls alone already, flat rows have no call blocks)."""
        every = self.audit.every_n_steps
        return self.layout == "packed" and every > 0 and step % every == 0


def _build(cls, node: Any, where: str):
    known = {f.name: f for f in fields(cls)}
    data = dict(node or {})
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise MemopdConfigError(f"{where}: unknown key(s) {unknown}; valid keys: {sorted(known)}")
    kwargs = {}
    for name, value in data.items():
        sub = (
            {"teacher": TeacherConfig, "distill": DistillConfig, "audit": AuditConfig, "trainer": TrainerConfig}.get(
                name
            )
            if cls is MemopdConfig
            else None
        )
        kwargs[name] = _build(sub, value, f"{where}.{name}") if sub else value
    return cls(**kwargs)


def from_config(config: DictConfig) -> MemopdConfig:
    """Validate and return ``config.memopd``; refuse a recipe that did not resolve."""
    recipe = config.get("recipe") if isinstance(config, DictConfig) else None
    if isinstance(recipe, str):
        raise MemopdConfigError(
            f"`+recipe={recipe}` became the plain string key `recipe: {recipe}`: Hydra did not find "
            f"recipe/{recipe}.yaml. Is verl-memopd installed in this environment (pip show verl-memopd), "
            f"with its Hydra plugin (hydra_plugins/verl_memopd)?"
        )
    node = config.get("memopd")
    if node is None:
        raise MemopdConfigError("trainer.v1.trainer_mode=memopd needs the memopd: tree; add +recipe=memopd")
    memopd = _build(MemopdConfig, OmegaConf.to_container(node, resolve=True), "memopd")
    _check_agent(memopd.agent)
    _check_data_needs(config)
    _check_trainer_base(config, memopd.trainer.base)
    actor = (config.get("actor_rollout_ref") or {}).get("actor") or {}
    if actor.get("use_prefix_grouper", False):
        raise MemopdConfigError(
            "actor_rollout_ref.actor.use_prefix_grouper=true: verl's PrefixGrouper shares a prompt "
            "across the n samples of a group in its legacy trainer only (the V1 engines that "
            "MemOPD runs on never read the key), and its position ids / attention would replace "
            "MemOPD's packed call blocks; set it to false (packing already stores q once per episode)"
        )
    algorithm = config.get("algorithm") or {}
    if memopd.uses_reference and algorithm.get("use_kl_in_reward", False):
        raise MemopdConfigError(
            "algorithm.use_kl_in_reward=true and memopd.kl_penalty_coef > 0 would penalise the "
            "reward twice: MemOPD applies its clipped penalty itself; set "
            "algorithm.use_kl_in_reward=false (or memopd.kl_penalty_coef=0 for verl's own)"
        )
    return memopd


def _on_cpu(config: DictConfig) -> bool:
    import os

    return os.environ.get("VERL_PLATFORM") == "cpu" or (config.get("trainer") or {}).get("device") == "cpu"


def _check_trainer_base(config: DictConfig, base: str) -> None:
    """``memopd.trainer.base`` against verl's config: refuse, before Ray starts, what would run without MemOPD,
    train stale samples against the wrong behaviour policy, or fail minutes later inside verl's async trainer."""
    v1 = (config.get("trainer") or {}).get("v1") or {}
    mode = v1.get("trainer_mode")
    if mode in VERL_TRAINER_MODES:
        raise MemopdConfigError(
            f"trainer.v1.trainer_mode={mode} runs verl's own trainer, without MemOPD's teacher, layouts and audits; "
            f"keep trainer.v1.trainer_mode=memopd and select verl's trainer with memopd.trainer.base={mode}"
        )
    if base == "sync":
        return
    algorithm = config.get("algorithm") or {}
    corr = algorithm.get("rollout_correction") or {}
    if not (corr.get("bypass_mode", False) or corr.get("rollout_is")):
        raise MemopdConfigError(
            f"memopd.trainer.base={base} trains samples drawn by older weights (partial rollouts even span an "
            f"update inside a call), so PPO's ratio must use the log-probs of the version that sampled each token: "
            f"set algorithm.rollout_correction.bypass_mode=true (old log-probs = the recorded rollout log-probs) "
            f"or algorithm.rollout_correction.rollout_is=token|sequence (importance weights against them)"
        )
    rollout = (config.get("actor_rollout_ref") or {}).get("rollout") or {}
    if not rollout.get("calculate_log_probs", False):
        raise MemopdConfigError(
            f"memopd.trainer.base={base} needs actor_rollout_ref.rollout.calculate_log_probs=true: the rollout "
            f"log-probs are the behaviour policy of stale samples"
        )
    if base != "separate_async":
        return
    backend = (rollout.get("checkpoint_engine") or {}).get("backend", "naive")
    if _on_cpu(config):
        raise MemopdConfigError(
            "memopd.trainer.base=separate_async on the cpu platform: verl 0.9.1's separate trainer sends weights "
            "to its standalone rollout pool through a checkpoint engine (actor_rollout_ref.rollout.checkpoint_engine"
            ".backend: nccl needs CUDA and cupy, nixl and mooncake their transfer libraries and device buffers, "
            "kimi_ckpt_engine and delta_sharded NCCL); none runs on CPU, and 'naive' (in-process) is refused by "
            "verl there. Use memopd.trainer.base=colocate_async on CPU; separate_async on GPUs (docs/async.md)"
        )
    if backend == "naive":
        raise MemopdConfigError(
            "memopd.trainer.base=separate_async needs actor_rollout_ref.rollout.checkpoint_engine.backend=nccl (or "
            "nixl / mooncake): 'naive' only updates colocated replicas, not the standalone rollout pool"
        )
    if min(int(rollout.get("nnodes", 0) or 0), int(rollout.get("n_gpus_per_node", 0) or 0)) < 1:
        raise MemopdConfigError(
            "memopd.trainer.base=separate_async needs a standalone rollout pool: actor_rollout_ref.rollout.nnodes "
            "and actor_rollout_ref.rollout.n_gpus_per_node >= 1"
        )
    data = config.get("data") or {}
    mini = ((config.get("actor_rollout_ref") or {}).get("actor") or {}).get("ppo_mini_batch_size")
    sync_step = (v1.get("separate_async") or {}).get("parameter_sync_step", 1)
    if mini is not None and data.get("train_batch_size") != sync_step * mini:
        raise MemopdConfigError(
            f"memopd.trainer.base=separate_async: verl requires data.train_batch_size "
            f"({data.get('train_batch_size')}) == trainer.v1.separate_async.parameter_sync_step ({sync_step}) x "
            f"actor_rollout_ref.actor.ppo_mini_batch_size ({mini})"
        )


def _check_agent(agent: dict) -> None:
    """``memopd.agent`` is read by the memory agent loop in the rollout workers; refuse a bad key here,
    before Ray starts."""
    from verl_memopd.agent.loop import MemoryAgentConfig

    try:
        MemoryAgentConfig.from_mapping(agent)
    except (TypeError, ValueError) as e:
        raise MemopdConfigError(str(e)) from None


def _check_data_needs(config: DictConfig) -> None:
    """Converted data files record the prompt / response lengths their rows need (``tasks.needs``);
    refuse shorter rollout lengths here, before Ray starts, rather than in the agent loop minutes later."""
    from verl_memopd.agent.loop import MemoryAgentConfig
    from verl_memopd.tasks.needs import check_lengths

    data = config.get("data") or {}
    rollout = (config.get("actor_rollout_ref") or {}).get("rollout") or {}
    node = (config.get("memopd") or {}).get("agent") or {}
    agent = MemoryAgentConfig.from_mapping(node)
    problems = check_lengths(
        {key: data.get(key) for key in ("train_files", "val_files")},
        rollout.get("prompt_length"),
        rollout.get("response_length"),
        agent.memory_tokens,
        agent.answer_tokens,
        default_call_prompts=not dict(node).get("prompts"),
    )
    if problems:
        raise MemopdConfigError("; ".join(problems))


class RecipeCheck(Callback):
    """Hydra callback (``hydra.callbacks`` in the recipe): validate ``memopd:`` before Ray starts.

    Hydra 1.3 turns exceptions raised by callbacks into warnings, so a failed check exits the
    process (``SystemExit`` carries the message to stderr, status 1).
    """

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            from_config(config)
        except MemopdConfigError as e:
            raise SystemExit(f"[verl-memopd] {e}") from None
