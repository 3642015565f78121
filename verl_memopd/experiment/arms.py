"""The matched arms: MemOPD, persistent-history teacher scoring, PPO only, OPD only, and OPD's off-policy twin
kd_soft (RL: ``main_ppo``); KD and continued SFT (verl SFT, ``kd.py``).

Every arm starts from the chosen student SFT checkpoint and shares everything but its arm
overrides (:data:`config.ARMS`): data order (``data.seed``), rollout seeds (``rollout.seed``, one
vLLM seed per call), steps, batch, lr, alpha, beta, the teacher folder (the ``flat`` arm's own, trained on the flat
state, where the experiment has one: :func:`scoring_teacher`). verl validates on the val
split every ``val_every`` steps (and before step 1 unless ``val_before_train`` is off), checkpoints
every ``save_every`` steps (default: at the val steps) and resumes (``trainer.resume_mode=auto``);
after the last step the final actor is evaluated on the test split.
An arm is done when ``DONE.json`` exists; its metrics are re-read from its log by the report.

The sweep stage reruns arms at seed 0 with one setting changed (:class:`config.Variant`: lr, lambda),
validating on val only, to measure what moves the outcome without touching the test split.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from verl_memopd.experiment.config import (
    ARMS,
    CRITIC_FREE_OVERRIDES,
    REPLAY_ARMS,
    SFT_ARMS,
    ExperimentConfig,
    Paths,
    Variant,
)
from verl_memopd.experiment.evaluate import eval_model
from verl_memopd.experiment.launch import main_ppo
from verl_memopd.experiment.launching import cpu_env, prune_checkpoints
from verl_memopd.experiment.runner import attempts, heavy, heavy_wall_s, last_attempt, run_logged
from verl_memopd.experiment.sft import fp32_export, start_models

__all__ = ["scoring_teacher", "arm_command", "run_arm", "stage_arms", "stage_sweep", "check_arm_overrides"]


def scoring_teacher(cfg: ExperimentConfig, paths: Paths, arm: str, teacher) -> Path:
    """The teacher an arm's trainer scores with (``memopd.teacher.path``): for the ``flat`` arm of an experiment with
    a persistent-history teacher (``teacher_flat_sft``), that teacher's final export (``flat_sft.py``); else
    ``teacher``, the aligned one (every other arm, and the held-out KL of every arm, keep it)."""
    if arm == "flat" and cfg.teacher_flat_sft is not None:
        from verl_memopd.experiment.flat_sft import teacher_flat_export

        return teacher_flat_export(cfg, paths)
    return Path(teacher)


def arm_command(
    cfg: ExperimentConfig,
    paths: Paths,
    arm: str,
    seed: int,
    student,
    teacher,
    variant: Variant | None = None,
    train_file: Path | None = None,
) -> list[str]:
    """The arm's ``main_ppo`` command; ``teacher``: the aligned teacher (the flat arm's may differ:
    :func:`scoring_teacher`); ``variant`` changes the lr and/or appends overrides (sweep runs); ``train_file``
    replaces the split's train episodes (a replay arm's: :func:`kd.replay_file`)."""
    a = cfg.arms
    lr = variant.lr if variant is not None and variant.lr is not None else a.lr
    run_dir = paths.arm(arm, seed) if variant is None else paths.sweep_run(variant.name, arm, seed)
    return main_ppo(
        f"data.max_response_length={cfg.max_response_length}",
        f"actor_rollout_ref.model.path={student}",
        f"memopd.teacher.path={scoring_teacher(cfg, paths, arm, teacher)}",
        "ray_kwargs.ray_init.num_gpus=2",
        f"data.train_files={train_file or paths.data / 'train.parquet'}",
        f"data.val_files={paths.data / 'val.parquet'}",
        f"data.train_batch_size={a.episodes_per_step}",
        f"data.val_batch_size={cfg.n_val}",
        f"actor_rollout_ref.rollout.n={a.samples_per_episode}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={a.episodes_per_step}",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        f"critic.optim.lr={lr}",  # the value head starts random
        f"data.seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}",
        "actor_rollout_ref.rollout.enable_prefix_caching=false",
        f"trainer.total_training_steps={a.steps}",
        f"trainer.test_freq={a.val_every}",
        f"trainer.save_freq={a.checkpoint_every}",
        f"trainer.val_before_train={str(a.val_before_train).lower()}",
        "trainer.resume_mode=auto",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        f"memopd.audit.every_n_steps={a.val_every}",
        f"trainer.default_local_dir={run_dir / 'checkpoints'}",
        f"trainer.experiment_name={run_dir.name}",
        *cfg.arm_overrides,
        *arm_overrides(arm, a.critic_free),
        *(variant.overrides if variant is not None else ()),
    )


def arm_overrides(arm: str, critic_free: tuple[str, ...]) -> tuple[str, ...]:
    """The arm's own Hydra overrides (:data:`ARMS`), plus :data:`CRITIC_FREE_OVERRIDES` if it is in ``critic_free``."""
    return ARMS[arm] + (CRITIC_FREE_OVERRIDES if arm in critic_free else ())


def check_arm_overrides(
    arms: tuple[str, ...], variants: tuple[tuple[Variant, str], ...] = (), critic_free: tuple[str, ...] = ()
) -> None:
    """Compose every arm's config (Hydra, no run) so a key the recipe lacks fails before any arm starts.

    E.g. ``memopd.teacher.state`` (the persistent-history control) on a recipe without it: Hydra's
    "Could not override" error names the key. ``variants``: (variant, arm) pairs of the sweep, composed
    with the variant's overrides after the arm's; an arm of ``critic_free`` with :data:`CRITIC_FREE_OVERRIDES`.
    """
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    for arm, overrides in [(a, arm_overrides(a, critic_free)) for a in arms] + [
        (f"{a} ({v.name})", arm_overrides(a, critic_free) + v.overrides) for v, a in variants
    ]:
        GlobalHydra.instance().clear()
        with initialize_config_module(config_module="verl.trainer.config", version_base=None):
            try:
                compose("ppo_trainer", overrides=["+profile=cpu", "+recipe=memopd", *overrides])
            except Exception as err:
                raise RuntimeError(f"arm {arm}: the memopd recipe does not accept {list(overrides)}: {err}") from err
    GlobalHydra.instance().clear()


def _train(cfg: ExperimentConfig, paths: Paths, run_dir: Path, what: str, command: list[str]) -> Path:
    """Run one arm's ``main_ppo`` into ``run_dir``; returns its final actor export (fp32 config)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    a = cfg.arms
    print(
        f"[experiment {time.strftime('%H:%M:%S')}] {what}: {a.steps} steps x "
        f"{a.episodes_per_step} episodes x {a.samples_per_episode} samples, val every {a.val_every} "
        f"(progress: grep '^step:' {run_dir / 'main_ppo.log'})",
        flush=True,
    )
    run_logged(
        heavy(command, cfg.timeout_s),
        run_dir / "main_ppo.log",
        cpu_env(paths.root, threads=cfg.worker_threads),
        None,
        cwd=paths.root,
    )
    final = run_dir / "checkpoints" / f"global_step_{a.steps}" / "actor" / "huggingface"
    if not (final / "config.json").is_file():
        raise RuntimeError(f"{what}: no final actor export at {final}; see {run_dir / 'main_ppo.log'}")
    fp32_export(final)
    return final


#: what verl's trainer prints when ``trainer.resume_mode=auto`` finds a checkpoint (verl 0.9 ``ray_trainer.py``)
RESUMED = re.compile(r"Load from checkpoint folder: \S*global_step_(\d+)")


def _done(run_dir: Path, final: Path) -> dict:
    """The run's ``DONE.json`` record: the final actor export; ``wall_s``, seconds of the last attempt (after the
    heavy lock); ``attempts``, how many times the arm was started (retries included); ``resumed_from_step``, the
    checkpoint the last attempt resumed from (0: it trained every step, and ``wall_s`` is the whole arm's)."""
    log = run_dir / "main_ppo.log"
    resumed = RESUMED.search(last_attempt(log))
    return {
        "wall_s": round(heavy_wall_s(log), 1),
        "final_actor": str(final),
        "attempts": attempts(log),
        "resumed_from_step": int(resumed.group(1)) if resumed else 0,
    }


def run_arm(cfg: ExperimentConfig, paths: Paths, arm: str, seed: int, student, teacher) -> None:
    run_dir = paths.arm(arm, seed)
    if (run_dir / "DONE.json").is_file():
        return print(f"[experiment] arm {arm} seed {seed}: done", flush=True)
    a = cfg.arms
    train_file = None
    if arm in REPLAY_ARMS:
        from verl_memopd.experiment.kd import replay_file

        train_file = replay_file(cfg, paths, seed, teacher)
    command = arm_command(cfg, paths, arm, seed, student, teacher, train_file=train_file)
    final = _train(cfg, paths, run_dir, f"arm {arm} seed {seed}", command)
    done = _done(run_dir, final)
    if cfg.heldout:
        from verl_memopd.experiment.heldout import arm_heldout_kl

        exports = {
            step: fp32_export(run_dir / "checkpoints" / f"global_step_{step}" / "actor" / "huggingface")
            for step in a.val_steps()
        }
        arm_heldout_kl(cfg, paths, arm, seed, exports, teacher)
    if cfg.final_evals:
        done["test_f1"] = eval_model(
            final,
            paths.data / "test.parquet",
            run_dir / "test.json",
            cfg,
            paths,
            {"role": arm, "seed": seed, "step": a.steps, "split": "test"},
        )["f1"]
    (run_dir / "DONE.json").write_text(json.dumps(done) + "\n")
    prune_checkpoints(run_dir / "checkpoints")


def stage_arms(cfg: ExperimentConfig, paths: Paths) -> None:
    from verl_memopd.experiment.kd import run_sft_arm

    check_arm_overrides(tuple(a for a in cfg.arms.arms if a not in SFT_ARMS), critic_free=cfg.arms.critic_free)
    student, teacher = start_models(cfg, paths)
    from verl_memopd.experiment.report import stage_report

    for seed in cfg.arms.seeds:  # seed-major: a partial run has every arm at the same seeds
        for arm in cfg.arms.arms:
            if (paths.arm(arm, seed) / "DONE.json").is_file():
                print(f"[experiment] arm {arm} seed {seed}: done", flush=True)
                continue
            if arm in SFT_ARMS:
                run_sft_arm(cfg, paths, arm, seed, student, teacher)
            else:
                run_arm(cfg, paths, arm, seed, student, teacher)
            stage_report(cfg, paths)  # the results folder holds every finished arm's rows as soon as it is done


def stage_sweep(cfg: ExperimentConfig, paths: Paths) -> None:
    """The sensitivity runs (:class:`config.SweepConfig`): val F1 every ``val_every`` steps, no test eval; then
    the report again, which writes their ``sensitivity.csv``."""
    if cfg.sweep is None:
        return print("[experiment] sweep: none configured", flush=True)
    runs = cfg.sweep.runs()
    check_arm_overrides((), tuple(runs), critic_free=cfg.arms.critic_free)
    student, teacher = start_models(cfg, paths)
    seed = cfg.sweep.seed
    for variant, arm in runs:
        run_dir = paths.sweep_run(variant.name, arm, seed)
        if (run_dir / "DONE.json").is_file():
            print(f"[experiment] sweep {variant.name} {arm} seed {seed}: done", flush=True)
            continue
        final = _train(
            cfg,
            paths,
            run_dir,
            f"sweep {variant.name} {arm} seed {seed}",
            arm_command(cfg, paths, arm, seed, student, teacher, variant),
        )
        (run_dir / "DONE.json").write_text(json.dumps(_done(run_dir, final)) + "\n")
    from verl_memopd.experiment.report import stage_report

    stage_report(cfg, paths)  # sensitivity.csv; the sweep runs after the default run's report
