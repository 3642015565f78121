"""Sizes, steps and paths of the CPU experiment (``recipes/experiment_cpu.sh``), full and smoke.

Everything the stages read is here, so the full run and the smoke run (``EXPERIMENT_SMOKE=1``)
differ only in the numbers below. Paths are fixed functions of the output folder: a stage is
done when its output exists, so a rerun resumes where the last one stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from verl_memopd.tasks.generator import HORIZONS

__all__ = [
    "SftConfig",
    "ArmsConfig",
    "Variant",
    "SweepConfig",
    "ExperimentConfig",
    "ARMS",
    "SFT_ARMS",
    "REPLAY_ARMS",
    "EXPERIMENTS",
    "full_config",
    "smoke_config",
    "smollm2_config",
    "smollm2_horizon_config",
    "Paths",
]

#: arm name -> Hydra overrides on top of the shared arm command (everything else matched); the arms of
#: :data:`SFT_ARMS` are verl SFT runs instead (``experiment/kd.py``), every other arm is one ``main_ppo`` run
ARMS: dict[str, tuple[str, ...]] = {
    "memopd": ("memopd.teacher.state=aligned", "memopd.layout=packed"),
    "flat": ("memopd.teacher.state=flat", "memopd.layout=packed"),
    "ppo": ("memopd.distill.coef=0",),
    # on-policy distillation alone: the aligned teacher's reverse KL, no PPO term (the critic runs unless the
    # experiment lists the arm in ArmsConfig.critic_free)
    "opd": ("memopd.teacher.state=aligned", "memopd.layout=packed", "memopd.ppo_coef=0"),
    # OPD's off-policy twin: the same trainer and loss on the teacher's own greedy trajectories of the same episodes,
    # replayed by memopd_replay_agent (agent/replay.py) in verl's order of them (data.shuffle=false on a file already
    # in that order, kd.py); the replayed tokens have no rollout log-probs, so the actor recomputes the old ones
    "kd_soft": (
        "memopd.teacher.state=aligned",
        "memopd.layout=packed",
        "memopd.ppo_coef=0",
        "algorithm.rollout_correction.bypass_mode=false",
        "data.shuffle=false",
    ),
    # off-policy KD: verl's SFT trainer on the teacher's own greedy trajectories of the same episodes (kd.py)
    "kd": (),
    # continued SFT: verl's SFT trainer on the oracle's calls of the same episodes (kd.py)
    "sft": (),
}
#: the arms that are verl SFT runs, not RL (``experiment/kd.py``): the data each trains on
SFT_ARMS = {"kd": "the teacher's greedy trajectories", "sft": "the oracle's calls"}
#: the RL arms whose training episodes are replayed trajectories (their train file: ``kd.replay_file``)
REPLAY_ARMS = ("kd_soft",)
#: what an arm of ``ArmsConfig.critic_free`` adds: no critic worker (verl's ``critic.enable``) and an advantage
#: estimator that needs none. Only for arms without a PPO term (``memopd.ppo_coef=0``): their actor loss never
#: reads the advantage (``losses.actor.memopd_actor_loss`` multiplies the PPO term by 0), so dropping the critic
#: changes the step's cost (~1/3 of an h12 step: values + update_critic), not the actor's update. GRPO over one
#: sample per episode is finite (verl: a group of one has mean 0, std 1), so the unused advantage stays finite
CRITIC_FREE_OVERRIDES = ("critic.enable=false", "algorithm.adv_estimator=grpo")


@dataclass(frozen=True)
class SftConfig:
    """One run of verl's SFT trainer (``verl.trainer.sft_trainer``) on the oracle's calls.

    ``steps`` optimizer steps of ``batch`` rows (one row = one agent call), lr warmed up over
    ``warmup_steps`` then cosine-decayed to ``min_lr_ratio * lr``; a checkpoint (verl format plus
    a Hugging Face export) every ``save_every`` steps, a validation loss every ``val_every`` (None: ``save_every``;
    over the whole val split, minutes a time for SmolLM2: it does not touch training). ``step_s`` is the measured wall
    time of one step alone on 2 cores, used only for the ETA the stage prints. ``max_length``: verl's
    ``data.max_length``, the longest row in tokens (a longer one is refused, ``data.truncation=error``).
    """

    steps: int
    batch: int
    lr: float
    save_every: int
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    step_s: float = 1.5
    max_length: int = 512
    val_every: int | None = None

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch < 1 or self.save_every < 1 or self.max_length < 1:
            raise ValueError(f"SftConfig: steps, batch, save_every and max_length must be >= 1, got {self}")
        if self.val_every is not None and (self.val_every < 1 or self.steps % self.val_every):
            raise ValueError(
                f"SftConfig: steps={self.steps} must be a multiple of val_every={self.val_every} (>= 1; the final "
                "model's val loss is always measured)"
            )
        if self.steps % self.save_every:
            raise ValueError(
                f"SftConfig: steps={self.steps} must be a multiple of save_every={self.save_every} "
                "(the final model is a saved checkpoint)"
            )

    @property
    def validate_every(self) -> int:
        """Steps between validation losses (``val_every``, else ``save_every``)."""
        return self.save_every if self.val_every is None else self.val_every


@dataclass(frozen=True)
class ArmsConfig:
    """The matched RL arms: same data order, rollout seeds, steps, batch, lr, alpha, beta for each.

    ``lr`` is the actor's and the critic's (verl's critic default, 1e-5, leaves the random value head near
    its start for the whole run). verl validates on val every ``val_every`` steps (and before step 1 if
    ``val_before_train``), with an RCE audit step and the held-out KL at the same steps; a checkpoint every
    ``save_every`` steps (None: ``val_every``), so a run cut off resumes from its latest checkpoint.
    ``critic_free``: arms without a PPO term that run without a critic (:data:`CRITIC_FREE_OVERRIDES`)."""

    steps: int
    val_every: int
    episodes_per_step: int
    samples_per_episode: int
    lr: float
    seeds: tuple[int, ...]
    arms: tuple[str, ...] = tuple(ARMS)
    save_every: int | None = None
    val_before_train: bool = True
    critic_free: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown:
            raise ValueError(f"ArmsConfig.arms: unknown {unknown}; valid: {sorted(ARMS)}")
        with_ppo = [a for a in self.critic_free if a not in self.arms or "memopd.ppo_coef=0" not in ARMS[a]]
        if with_ppo:
            raise ValueError(
                f"ArmsConfig.critic_free: {with_ppo} are not arms of this config without a PPO term "
                "(memopd.ppo_coef=0); only those may drop the critic (CRITIC_FREE_OVERRIDES)"
            )
        for name in ("val_every", "checkpoint_every"):
            every = getattr(self, name)
            if every < 1 or self.steps % every:
                raise ValueError(f"ArmsConfig: steps={self.steps} must be a multiple of {name}={every} (>= 1)")

    @property
    def checkpoint_every(self) -> int:
        """Steps between checkpoints (``save_every``, else ``val_every``)."""
        return self.val_every if self.save_every is None else self.save_every

    def checkpoint_steps(self) -> range:
        """The steps with a checkpoint (the last one included)."""
        return range(self.checkpoint_every, self.steps + 1, self.checkpoint_every)

    def val_steps(self) -> range:
        """The steps verl validates after (the last one included)."""
        return range(self.val_every, self.steps + 1, self.val_every)


@dataclass(frozen=True)
class Variant:
    """One sensitivity setting: the matched arms' command with ``lr`` (actor and critic; None = the arms'
    lr) and ``overrides`` (Hydra, appended after the arm's own; keys the arm does not set) changed, nothing
    else; run for ``only`` of the sweep's arms (None: all of them)."""

    name: str
    lr: float | None = None
    overrides: tuple[str, ...] = ()
    only: tuple[str, ...] | None = None


@dataclass(frozen=True)
class SweepConfig:
    """Why an arm does what it does, on val only: each variant x each of ``arms`` at ``seed``, same steps,
    batch and validation schedule as the arms, no test eval (nothing is tuned on test)."""

    variants: tuple[Variant, ...]
    arms: tuple[str, ...]
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [a for a in self.arms + tuple(a for v in self.variants for a in v.only or ()) if a not in ARMS]
        names = [v.name for v in self.variants]
        if (
            unknown
            or len(set(names)) != len(names)
            or any(not n.replace(".", "").replace("-", "").isalnum() for n in names)
        ):
            raise ValueError(
                f"SweepConfig: arms {self.arms} (and each variant's only; valid {sorted(ARMS)}), "
                f"variant names {names} must be unique and alphanumeric (with . or -)"
            )

    def runs(self) -> list[tuple[Variant, str]]:
        """(variant, arm) in run order: variant-major."""
        return [(v, arm) for v in self.variants for arm in self.arms if v.only is None or arm in v.only]


@dataclass(frozen=True)
class ExperimentConfig:
    """The whole experiment; ``n_train`` fresh episodes feed the SFT data and the RL arms."""

    name: str
    data_seed: int
    n_train: int
    n_val: int
    n_test: int
    teacher_sft: SftConfig
    student_sft: SftConfig
    arms: ArmsConfig
    #: student SFT steps evaluated on val; the RL start is the latest one with val F1 in the band
    student_eval_steps: tuple[int, ...] = ()
    #: (low, high) val F1 the RL start must have; None = start from the final SFT step without a separate
    #: eval (smoke: the arms' own step-0 validation measures the start, one verl launch less in CI)
    student_f1_band: tuple[float, float] | None = (0.05, 0.5)
    #: the teacher's val F1 aim (a warning, not a failure: the report shows what was reached)
    teacher_f1_target: float = 0.8
    #: evaluate the teacher's final checkpoint (val) and every model of the table on the test split;
    #: False only in the smoke run (CI time), which keeps the student's val evals and the arms' own validation
    final_evals: bool = True
    #: per-command bound (seconds) for one eval or one arm; a hung verl run cannot stall the pipeline
    timeout_s: int = 5400
    #: where student and teacher start: "tiny" (random-init models built locally, ``verl_memopd.bench.tiny``) or a
    #: pretrained model provisioned offline (``verl_memopd.experiment.models``, e.g. "smollm2"; both roles start
    #: from it)
    base_model: str = "tiny"
    #: Hydra overrides every RL run of this experiment shares (arms, sweep), before each arm's own
    arm_overrides: tuple[str, ...] = ()
    #: the val-only sensitivity runs of the sweep stage (None: no sweep)
    sweep: SweepConfig | None = None
    #: the diagnose stage: val evals of teacher, start and the arms' final actors with memory diagnostics
    diagnose: bool = True
    #: the teacher's supervision checked with Hugging Face runs of the agent (``experiment/heldout.py``): F1 when the
    #: teacher takes over from the student at call t (eval stage), and each arm's reverse KL to the teacher on one
    #: fixed set of the start student's rollouts at every saved step
    heldout: bool = False
    #: ``data.max_response_length`` of every run (evals and arms): a packed episode's calls must fit in it, or the
    #: agent refuses the episode (and verl's validation leaves it out of the F1); h12's longest need ~2.2k tokens
    max_response_length: int = 2048
    #: the task presets (``python -m verl_memopd.tasks build --preset``) the experiment runs on. One preset: the
    #: stages read and write the unscoped paths. Several (the horizon study): each gets its own episodes, evals,
    #: arms and results (``Paths.at``), ``n_train/n_val/n_test`` episodes each, while the models and the two SFT
    #: runs are shared -- both SFTs train on the oracle's calls of every preset, mixed
    presets: tuple[str, ...] = ("tiny",)
    #: torch threads of every verl run's Ray workers (``OMP_NUM_THREADS``; ``launching.cpu_env``). None: Ray's
    #: default, one thread per worker (verl's worker groups start without ``num_cpus``), which cpu_tiny and cpu_smollm2
    #: were measured with; ``python -m verl_memopd.bench threads`` measures what more threads gain
    worker_threads: int | None = None
    #: the persistent-history control's own teacher, the ``flat`` arm's ``memopd.teacher.path`` (stage
    #: ``sft_teacher_flat``, ``experiment/flat_sft.py``): verl's SFT continued from the final aligned teacher on the
    #: oracle's episodes as flat rows (the flat state the arm's teacher scores in) mixed with per-call rows (the aligned
    #: state); ``batch`` counts rows of either kind. None: no such stage, the flat arm scores with the aligned teacher
    teacher_flat_sft: SftConfig | None = None
    #: with ``teacher_flat_sft``: the splits on which the eval stage reports each teacher's F1 acting in the aligned
    #: and in the flat state (``heldout.state_f1``: the Hugging Face agent, greedy), ``eval/state_<model>_<split>.json``
    state_eval_splits: tuple[str, ...] = ("val",)

    def __post_init__(self) -> None:
        from verl_memopd.tasks.generator import get_preset

        if self.teacher_flat_sft is not None and not isinstance(self.teacher_flat_sft, SftConfig):
            raise ValueError(
                f"ExperimentConfig.teacher_flat_sft must be an SftConfig or None, got {self.teacher_flat_sft!r}"
            )
        bad = [s for s in self.state_eval_splits if s not in ("val", "test")]
        if bad or len(set(self.state_eval_splits)) != len(self.state_eval_splits):
            raise ValueError(
                f"ExperimentConfig.state_eval_splits={self.state_eval_splits}: each of 'val', 'test', at most once"
            )

        if self.worker_threads is not None and self.worker_threads < 1:
            raise ValueError(f"ExperimentConfig.worker_threads must be >= 1 or None, got {self.worker_threads}")
        if not self.presets or len(set(self.presets)) != len(self.presets):
            raise ValueError(f"ExperimentConfig.presets must be distinct and non-empty, got {self.presets}")
        for preset in self.presets:
            get_preset(preset)  # KeyError naming the valid presets
        saved = range(self.student_sft.save_every, self.student_sft.steps + 1, self.student_sft.save_every)
        missing = [s for s in self.student_eval_steps if s not in saved]
        if (self.student_f1_band is not None and not self.student_eval_steps) or missing:
            raise ValueError(
                f"student_eval_steps={self.student_eval_steps}: each must be a saved SFT step "
                f"(multiples of {self.student_sft.save_every} up to {self.student_sft.steps})"
            )


def full_config() -> ExperimentConfig:
    """The measured experiment: a 4-layer/256 teacher SFT'd on 4k steps of the oracle's calls (~2 epochs), a
    2-layer/128 student after a short SFT, 3 arms x 3 seeds of RL from that student (sizes: a plain-PyTorch probe
    of the task)."""
    return ExperimentConfig(
        name="cpu_tiny",
        data_seed=0,
        n_train=16384,
        n_val=64,
        n_test=64,
        # 4000 steps, one cosine from peak lr 5e-4 to a floor of 1e-4 (run 5, to fit the 3 h budget: val loss 0.039,
        # val F1 0.801, test 0.754, SFT 93 min; runs/cpu_tiny_r5). Why a lower peak: at equal steps the run whose
        # lr had been lower over the last ~1000 steps had the lower val loss (run 3: 2000-step cosines at 1e-3 with
        # warm restarts at 5.5e-4 and 3.3e-4, val loss 0.055 / 0.039 and val F1 0.723 / 0.832 at 4000 / 6000;
        # run 4: one 4500-step cosine at 1e-3, val loss 0.056, F1 0.707; peak 3e-3: val loss 0.56 vs 0.37 at
        # step 250). Run 3 is runs/cpu_tiny/sft/teacher, run 4 under its archive/.
        teacher_sft=SftConfig(steps=4000, batch=32, lr=5e-4, save_every=250, warmup_steps=40, min_lr_ratio=0.2),
        student_sft=SftConfig(steps=300, batch=32, lr=1e-3, save_every=50, step_s=1.2),
        student_eval_steps=(100, 200, 300),
        # RL lr = the student SFT's final lr (cosine floor 0.1 x 1e-3): the arms continue at the rate the
        # student was last trained with (1e-5 would move this 2-layer model ~1% in 30 Adam steps)
        arms=ArmsConfig(
            steps=30,
            val_every=10,
            episodes_per_step=4,
            samples_per_episode=2,
            lr=1e-4,
            seeds=(0, 1, 2),
            arms=("memopd", "flat", "ppo"),
        ),
        # no arm beat the student at lr 1e-4: is the step too large, or the distillation term too strong?
        # "base" reruns the arms' own settings under the sweep's code (its reference if the code has moved on)
        sweep=SweepConfig(
            variants=(
                Variant("base"),
                Variant("lr3e-5", lr=3e-5),
                Variant("lr1e-5", lr=1e-5),
                Variant("lambda0.1", overrides=("memopd.distill.coef=0.1",), only=("memopd",)),
                # which calls' supervision moves the memory: the answer call's or the memory calls'
                Variant("mask-answer", overrides=("memopd.distill.teacher_mask=answer",), only=("memopd",)),
                Variant("mask-memory", overrides=("memopd.distill.teacher_mask=memory",), only=("memopd",)),
            ),
            arms=("memopd", "ppo"),
        ),
    )


def smoke_config() -> ExperimentConfig:
    """Minutes, for CI: a few SFT steps, one RL step per arm (the KD and replay arms included), one seed; checks
    the plumbing only."""
    full = full_config()
    two_steps = SftConfig(steps=2, batch=4, lr=1e-3, save_every=2, warmup_steps=0)
    return replace(
        full,
        name="cpu_tiny_smoke",
        n_train=64,
        n_val=4,
        n_test=4,
        timeout_s=900,
        teacher_sft=two_steps,
        student_sft=two_steps,
        student_eval_steps=(),
        student_f1_band=None,
        final_evals=False,
        # one arm per code path (CI time): memopd (the on-policy RL arms; flat, ppo and opd are the same launch with
        # other overrides, unit-tested in tests/test_experiment.py, the flat teacher end to end in
        # tests/test_memopd_e2e.py), kd_soft (the replay agent) and kd (verl's SFT trainer; sft shares its code path)
        arms=replace(
            full.arms, steps=1, val_every=1, episodes_per_step=2, seeds=(0,), arms=("memopd", "kd_soft", "kd")
        ),
        sweep=None,
        diagnose=False,
        heldout=True,
    )


def smollm2_config() -> ExperimentConfig:
    """The evidence run on a pretrained model: student and teacher both start from SmolLM2-135M-Instruct
    (``python -m verl_memopd.experiment.models smollm2``), the student after a short SFT on the oracle's calls (val F1
    in [0.2, 0.5]), the teacher after a longer one (aim >= 0.8); then 5 arms x 3 seeds of 10 RL steps.

    Sizes from a plain-PyTorch probe of the same task and model on 2 cores (student 20 SFT steps x 8 calls at lr
    3e-5: val F1 0.18-0.36; teacher 150 x 8 at 5e-5: 0.81; reverse-KL OPD at Adam lr 2e-5 from that student moved
    val F1 0.18 -> 0.65 in 15 steps of 8 episodes). Every arm (matched) runs without the reference model
    (``kl_penalty_coef=0``) and takes the rollout's log-probs as the old ones (verl's bypass mode; they match the
    trainer's to ~1e-5, and audit steps still recompute and check them), which saves two forward passes a step.
    """
    return ExperimentConfig(
        name="cpu_smollm2",
        data_seed=0,
        n_train=2048,
        n_val=32,
        n_test=64,
        base_model="smollm2",
        # step_s: 22 s a step of 8 calls (the horizon teacher's 300 steps took 6637 s alone on 2 cores, fp32)
        teacher_sft=SftConfig(
            steps=150, batch=8, lr=5e-5, save_every=50, warmup_steps=2, min_lr_ratio=0.1, step_s=22.0
        ),
        # student step_s: 2302 s for 20 steps (measured 2026-12-07): a checkpoint + HF export every 5 steps dominates
        student_sft=SftConfig(steps=20, batch=8, lr=3e-5, save_every=5, warmup_steps=2, min_lr_ratio=0.1, step_s=115.0),
        student_eval_steps=(10, 15, 20),
        student_f1_band=(0.2, 0.5),
        arms=ArmsConfig(
            steps=10,
            val_every=5,
            episodes_per_step=8,
            samples_per_episode=1,
            lr=2e-5,
            seeds=(0, 1, 2),
            arms=("memopd", "flat", "ppo", "opd", "kd"),
        ),
        arm_overrides=(
            "memopd.kl_penalty_coef=0",
            "algorithm.rollout_correction.bypass_mode=true",
            # 2 episodes per micro-batch (less padding); activation recomputation stays on (verl's
            # default): without it the colocated actor + critic + teacher process peaked past the
            # machine's 24 GB on the first audit step (measured: Ray's OOM kill at 22.0 GB, step 5)
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "critic.ppo_micro_batch_size_per_gpu=2",
        ),
        timeout_s=4 * 3600,
        sweep=None,
        heldout=True,
    )


def smollm2_horizon_config() -> ExperimentConfig:
    """On-policy vs off-policy distillation as the number of memory calls grows: SmolLM2 at T = 3, 6, 12 calls (the
    ``h<T>`` presets: the answer's facts sit in the first 2 chunks, so they must survive T - 2 rewrites).

    Shared across T: one student SFT and one teacher SFT on the oracle's calls of all three horizons, mixed (the
    teacher must be competent at the longest T, so its SFT is twice :func:`smollm2_config`'s); the student starts
    from its final SFT step at every T (one start; its F1 per T is measured, not chosen). Per T: 2048 / 32 / 128
    episodes; the pre-study (eval stage: teacher and start F1, the hand-off curve, the start's held-out KL) runs
    before any arm. Precision: fp32 (the bf16 CPU profile is not yet audited in a full arm). The ``flat`` arm scores
    with its own teacher, the teacher's SFT continued on flat and per-call rows (``teacher_flat_sft``), whose F1 in
    either state the eval stage reports next to the aligned teacher's (val).
    """
    base = smollm2_config()
    return replace(
        base,
        name="cpu_smollm2_horizon",
        presets=tuple(f"h{t}" for t in HORIZONS),
        n_test=128,
        # one val loss at the end of the student's SFT, two in the teacher's: a val pass over the mixed val split took
        # 5.1-6.8 min alone, 9.8 min next to the test suite (measured 2026-12-07, the student's 4 vals), most of the
        # student SFT's 2076-2302 s with a val every 5 steps; it does not change training (a slow test). Student
        # step_s: ~16 s a step alone + the one val, spread (estimate)
        teacher_sft=replace(base.teacher_sft, steps=300, warmup_steps=4, val_every=150),
        student_sft=replace(base.student_sft, val_every=20, step_s=50.0),
        student_eval_steps=(),
        student_f1_band=None,
        # h12's packed episodes reach ~2.2k response tokens (22 of 128 test episodes exceeded 2048, measured)
        max_response_length=4096,
        # the summary line's arms (horizon.SUMMARY_ARMS); PPO alone is settled at T=3 (results/cpu_smollm2). Val
        # once, after the last step: verl's val is greedy, so a val before training repeats the same start episodes
        # in every arm and seed, and a mid-run one costs ~9 min at h12 (32 episodes) for a curve the summary does not
        # use (the audit and the held-out KL run at the val step too). A checkpoint every 2 steps: an arm at h12 takes
        # longer than a 3-hour session (a step is ~4x T=3's ~5 min), so a cut-off run must lose little
        arms=replace(
            base.arms,
            arms=("memopd", "opd", "kd_soft", "kd", "sft", "flat"),
            val_every=base.arms.steps,
            save_every=2,
            val_before_train=False,
            # the "OPD alone ... no critic" and its off-policy twin: the critic is unused by their loss
            critic_free=("opd", "kd_soft"),
        ),
        # 2 torch threads per Ray worker (python -m verl_memopd.bench threads --model smollm2, T=3 shape, measured
        # next to other jobs, one steady step: whole step 1.12x, forward passes 1.5x, updates 1.14-1.27x, vLLM
        # generation 0.77x; docs/measurements.md). Every arm of this study runs with it (matched)
        worker_threads=2,
        # the flat arm's own teacher (issue 38: a fair persistent-history control), from the final teacher: 40 steps x
        # 8 rows, ~2.4 of them flat (experiment/flat_sft.py; ~490 tokens a row over the 3 presets, h12's flat rows
        # ~1.85k, the longest 2274 of 512 episodes). step_s: the teacher SFT's ~90 tokens/s (1.75k-token steps in
        # ~20 s) at ~3.9k tokens a step, plus ~15% for attention over the longer rows; ETA ~33 min of steps + 2
        # checkpoints and validations (~5 min) + the rows (~2.5 min). lr: peak 3e-5, below the teacher SFT's 5e-5 (it
        # continues a converged model on a new layout of the same calls), cosine to 0.1 of it as the teacher's own
        teacher_flat_sft=SftConfig(
            steps=40, batch=8, lr=3e-5, save_every=20, warmup_steps=2, min_lr_ratio=0.1, step_s=50.0, max_length=3072
        ),
    )


#: experiment name -> its config (``python -m verl_memopd.experiment run --experiment NAME``)
EXPERIMENTS = {"cpu_tiny": full_config, "cpu_smollm2": smollm2_config, "cpu_smollm2_horizon": smollm2_horizon_config}


@dataclass(frozen=True)
class Paths:
    """Where each stage writes, under ``root`` (big, gitignored) and ``results`` (small, committed).

    ``scope`` (a task preset, see :meth:`at`) puts everything that belongs to one preset -- its episodes, its
    oracle traces, evals, arms, diagnostics and results -- in a subfolder named after it; the models and the SFT
    runs stay shared. ``sft_data`` unscoped is the SFT runs' data (every preset's traces, mixed).
    """

    root: Path
    results_root: Path
    scope: str | None = None

    def at(self, preset: str) -> "Paths":
        """These paths scoped to ``preset``."""
        return replace(self, scope=preset)

    def _scoped(self, path: Path) -> Path:
        return path if self.scope is None else path / self.scope

    @property
    def results(self) -> Path:
        return self._scoped(self.results_root)

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def data(self) -> Path:
        return self._scoped(self.root / "data")

    @property
    def sft_data(self) -> Path:
        return self._scoped(self.root / "sft_data")

    def sft(self, role: str) -> Path:
        return self.root / "sft" / role

    def evals(self) -> Path:
        return self._scoped(self.root / "eval")

    def arm(self, arm: str, seed: int) -> Path:
        return self._scoped(self.root / "arms") / f"{arm}_seed{seed}"

    def teacher_trajectories(self, seed: int) -> Path:
        """The teacher's greedy trajectories of the arms' training episodes at ``seed`` (kd and kd_soft train on
        them)."""
        return self._scoped(self.root / "teacher_trajectories") / f"seed{seed}"

    def sweep_run(self, variant: str, arm: str, seed: int) -> Path:
        return self._scoped(self.root / "sweep") / f"{variant}_{arm}_seed{seed}"

    @property
    def sensitivity_csv(self) -> Path:
        return self.results / "sensitivity.csv"

    @property
    def diagnose(self) -> Path:
        return self._scoped(self.root / "diagnose")

    @property
    def diagnostics_csv(self) -> Path:
        return self.results / "diagnostics.csv"

    @property
    def call_accuracy_csv(self) -> Path:
        return self.results / "call_accuracy.csv"

    @property
    def metrics_csv(self) -> Path:
        return self.results / "metrics.csv"

    @property
    def plot(self) -> Path:
        return self.results / "f1.png"
