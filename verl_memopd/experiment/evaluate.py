"""F1 of a checkpoint under the real agent loop, measured by verl's own validation.

One eval = ``main_ppo ... trainer.val_only=true`` on the checkpoint as the actor: vLLM-CPU rollouts of
``memopd_memory_agent`` over every episode of the split, greedy, scored by the benchmark's F1/EM
(no teacher, no reference, no critic are started). Each eval is a heavy job (Ray + vLLM, ~11 GB):
``MEMOPD_HEAVY_LOCK`` serialises it with other heavy jobs on the machine.

The eval stage measures the SFT checkpoints the experiment needs: the student at
``student_eval_steps`` (val; latest first, until one is in the band) to choose the RL start, the
teacher's final checkpoint (val), and both chosen models on the test split. Results:
``eval/<role>_step<N>_<split>.json``.

The diagnose stage evaluates, on val, the models whose difference the table reports (the final teacher,
the RL start, each arm's final actor at the first seed) with the agent's memory diagnostics: how many
answers the final memory still holds (``memory_recall``) and how often a memory call hits its budget
(``memory_truncated``), so a drop in F1 can be traced to the memory or to the answer call; and each
model's accuracy per call given the oracle's state (``calls.py``), so it can be traced to a call.
Results: ``diagnose/<model>_val.json``, ``diagnose/<model>_calls.json``.

With a persistent-history teacher (``ExperimentConfig.teacher_flat_sft``) the eval stage also reports both teachers'
F1 acting in the aligned and in the flat state (:func:`state_evals`, ``eval/state_<model>_<split>.json``).

Every eval also keeps its per-episode scores (``episodes`` in its JSON: one ``{"f1", "em", "input_sha"}`` per
episode, in the split's order), read from verl's own validation dump (``trainer.validation_data_dir``): the paired
statistics of the report (``report.paired_difference``) compare arms episode by episode.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from verl_memopd.experiment.config import ExperimentConfig, Paths
from verl_memopd.experiment.launch import main_ppo, read_log, val_scores
from verl_memopd.experiment.launching import cpu_env, parse_steps
from verl_memopd.experiment.runner import heavy, heavy_wall_s, run_logged
from verl_memopd.experiment.sft import hf_export, start_models

__all__ = [
    "eval_command",
    "eval_model",
    "eval_sft_checkpoint",
    "stage_eval",
    "chosen_student",
    "diagnose_names",
    "stage_diagnose",
    "state_evals",
    "EvalResult",
]

EvalResult = dict  # {"role", "step", "split", "f1", "em", "wall_s", "model", "episodes"} (+ memory diagnostics)


def eval_command(model: Path, val_file: Path, workdir: Path, val_batch: int, max_response_length: int) -> list[str]:
    """verl validation of ``model`` on ``val_file`` (greedy, the memory agent), nothing trained."""
    return main_ppo(
        f"data.max_response_length={max_response_length}",
        f"actor_rollout_ref.model.path={model}",
        "memopd.distill.coef=0",
        "memopd.kl_penalty_coef=0",
        "algorithm.adv_estimator=grpo",
        "ray_kwargs.ray_init.num_gpus=1",
        f"data.train_files={val_file}",
        f"data.val_files={val_file}",
        "data.train_batch_size=2",
        f"data.val_batch_size={val_batch}",
        "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.val_only=true",
        "trainer.val_before_train=true",
        "trainer.total_training_steps=1",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        f"trainer.default_local_dir={workdir / 'checkpoints'}",
        f"trainer.validation_data_dir={workdir / 'generations'}",
        f"trainer.experiment_name=eval_{workdir.name}",
    )


def episode_scores(dump_dir: Path, n: int) -> list[dict]:
    """The per-episode scores of one validation from verl's dump (``<step>.jsonl`` under ``dump_dir``, one line per
    sample: ``input`` (the decoded prompt), ``score`` and the agent's reward_extra_info ``f1``, ``em``): one
    ``{"f1", "em", "input_sha"}`` per episode, in the dump's order (the split's: verl's validation does not shuffle).
    ``input_sha`` (the first 16 hex digits of the input's SHA-256) lets a paired comparison check that two evals
    list the same episodes in the same order. Raises unless there is exactly one dump of ``n`` samples."""
    dumps = sorted(dump_dir.glob("*.jsonl"))
    if len(dumps) != 1:
        raise RuntimeError(f"{dump_dir}: expected one validation dump (<step>.jsonl), found {[d.name for d in dumps]}")
    lines = [json.loads(line) for line in dumps[0].read_text().splitlines() if line.strip()]
    if len(lines) != n:
        raise RuntimeError(
            f"{dumps[0]}: {len(lines)} samples, the split has {n} episodes: verl's validation leaves out an episode "
            "the agent refused (e.g. 'packed episode needs ... response_length'; see the run's main_ppo.log)"
        )
    return [
        {
            "f1": float(x["f1"]),
            "em": float(x["em"]),
            "input_sha": hashlib.sha256(x["input"].encode()).hexdigest()[:16],
        }
        for x in lines
    ]


def eval_model(
    model: Path, split_file: Path, out_json: Path, cfg: ExperimentConfig, paths: Paths, meta: dict
) -> EvalResult:
    """Run one eval (or read it back if ``out_json`` exists); ``meta`` is stored with the scores. A test eval cached
    from before per-episode scores were kept is measured again (the paired comparisons need them)."""
    if out_json.is_file():
        cached = json.loads(out_json.read_text())
        if "episodes" in cached or "test" not in split_file.name:
            return cached
        print(f"[experiment] eval {out_json.stem}: cached without per-episode scores; measuring it again", flush=True)
    workdir = out_json.with_suffix("")
    n = cfg.n_val if "val" in split_file.name else cfg.n_test
    for stale in (workdir / "generations").glob("*.jsonl"):
        stale.unlink()  # a dump of an interrupted attempt
    print(
        f"[experiment {time.strftime('%H:%M:%S')}] eval {out_json.stem}: {n} episodes of {split_file.name}, "
        f"{model} (ETA ~{60 + 3 * n:.0f} s alone, after the heavy lock)",
        flush=True,
    )
    log = workdir / "main_ppo.log"
    run_logged(
        heavy(eval_command(model, split_file, workdir, n, cfg.max_response_length), cfg.timeout_s),
        log,
        cpu_env(paths.root, threads=cfg.worker_threads),
        None,
        cwd=paths.root,
    )
    wall = heavy_wall_s(log)
    scores = val_scores(parse_steps(read_log(log)).get(0, {}))
    if scores is None:
        raise RuntimeError(f"{log}: verl printed no validation F1 (val-*/memopd_memory/*/f1/mean@1) at step 0")
    episodes = episode_scores(workdir / "generations", n)
    mean = sum(e["f1"] for e in episodes) / n
    if abs(mean - scores["f1"]) > 1e-4:
        raise RuntimeError(f"{workdir}: the dumped episodes' mean F1 {mean:.6f} is not verl's logged {scores['f1']}")
    result = {**meta, **scores, "wall_s": round(wall, 1), "model": str(model), "episodes": episodes}
    out_json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"[experiment] eval {out_json.stem}: F1={scores['f1']:.4f} EM={scores['em']:.4f} ({wall:.0f}s)", flush=True)
    return result


def eval_sft_checkpoint(cfg: ExperimentConfig, paths: Paths, role: str, step: int, split: str) -> EvalResult:
    """F1 of the SFT checkpoint ``role`` at ``step`` on ``split`` (val or test)."""

    model = hf_export(paths.sft(role), step)
    out = paths.evals() / f"{role}_step{step}_{split}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    return eval_model(
        model, paths.data / f"{split}.parquet", out, cfg, paths, {"role": role, "step": step, "split": split}
    )


def chosen_student(cfg: ExperimentConfig, paths: Paths) -> int:
    """The SFT step the RL arms start from: the latest of ``cfg.student_eval_steps`` whose val F1 is in the band.

    Chosen on val only, latest step first: the evals stop at the first step in the band (an earlier one could
    not be chosen). Raises with every measured F1 if none is in ``cfg.student_f1_band``; without a band
    (smoke) the final SFT step, not evaluated.
    """
    if cfg.student_f1_band is None:
        return cfg.student_sft.steps
    lo, hi = cfg.student_f1_band
    measured = {}
    for step in sorted(cfg.student_eval_steps, reverse=True):
        measured[step] = eval_sft_checkpoint(cfg, paths, "student", step, "val")["f1"]
        if lo <= measured[step] <= hi:
            return step
    raise RuntimeError(
        f"student SFT: no checkpoint with val F1 in [{lo}, {hi}]: {measured}; change "
        "student_sft / student_eval_steps in verl_memopd/experiment/config.py"
    )


def stage_eval(cfg: ExperimentConfig, paths: Paths) -> None:
    """Evaluate what the arms and the report need; every eval is cached in ``eval/``. The F1s come first (minutes,
    and they decide whether the teacher is competent), the hand-off curve and the held-out KL after (an hour at a
    long horizon)."""
    step = chosen_student(cfg, paths)
    paths.evals().mkdir(parents=True, exist_ok=True)
    (paths.evals() / "student_choice.json").write_text(json.dumps({"step": step}) + "\n")
    if cfg.final_evals:
        eval_sft_checkpoint(cfg, paths, "student", step, "test")
        teacher = eval_sft_checkpoint(cfg, paths, "teacher", cfg.teacher_sft.steps, "val")
        eval_sft_checkpoint(cfg, paths, "teacher", cfg.teacher_sft.steps, "test")
        if teacher["f1"] < cfg.teacher_f1_target:
            print(
                f"[experiment] WARNING: teacher val F1 {teacher['f1']:.3f} < target {cfg.teacher_f1_target} "
                "(the arms still run; the report shows it)",
                flush=True,
            )
    if cfg.heldout:
        from verl_memopd.experiment.heldout import heldout_kl, teacher_handoff

        student, teacher = start_models(cfg, paths)
        teacher_handoff(cfg, paths, student, teacher)
        heldout_kl(
            cfg,
            paths,
            student,
            teacher,
            paths.evals() / "heldout_kl_student.json",
            {"arm": "student", "seed": 0, "step": 0},
        )
    if cfg.teacher_flat_sft is not None:
        state_evals(cfg, paths)


def state_evals(cfg: ExperimentConfig, paths: Paths) -> None:
    """Each teacher's F1 acting in the aligned and in the flat state (``heldout.state_f1``) on
    ``cfg.state_eval_splits``: the flat arm's teacher first (the control is fair only if it acts competently in the
    state it scores in), then the aligned teacher (what training on flat rows changed)."""
    from verl_memopd.experiment.flat_sft import teacher_flat_export
    from verl_memopd.experiment.heldout import state_f1

    teacher = start_models(cfg, paths)[1]
    for split in cfg.state_eval_splits:
        state_f1(paths, "teacher_flat", teacher_flat_export(cfg, paths), cfg.teacher_flat_sft.steps, split)
        state_f1(paths, "teacher", teacher, cfg.teacher_sft.steps, split)


def _diagnosed_arms(cfg: ExperimentConfig, paths: Paths) -> list[tuple[str, Path]]:
    """(name, DONE.json) of each finished arm at the first seed."""
    seed = cfg.arms.seeds[0]
    done = [(f"{arm}_seed{seed}", paths.arm(arm, seed) / "DONE.json") for arm in cfg.arms.arms]
    return [(name, path) for name, path in done if path.is_file()]


def diagnose_names(cfg: ExperimentConfig, paths: Paths) -> list[str]:
    """The models the diagnose stage evaluates, in order: the final teacher, the RL start and each arm's
    final actor at the first seed (arms that are not done are left out); ``diagnose/<name>_val.json``."""
    return ["teacher", "student", *(name for name, _ in _diagnosed_arms(cfg, paths))]


def stage_diagnose(cfg: ExperimentConfig, paths: Paths) -> None:
    if not cfg.diagnose:
        return print("[experiment] diagnose: off", flush=True)
    student, teacher = start_models(cfg, paths)
    models = [("teacher", teacher), ("student", student)]
    models += [(name, Path(json.loads(done.read_text())["final_actor"])) for name, done in _diagnosed_arms(cfg, paths)]
    from verl_memopd.experiment.calls import call_accuracy
    from verl_memopd.experiment.launch import AGENT_TOKENS

    budget = AGENT_TOKENS["memory_tokens"]  # a memory call's budget in every run of the experiment (64)
    paths.diagnose.mkdir(parents=True, exist_ok=True)
    for name, model in models:
        out = paths.diagnose / f"{name}_val.json"
        r = eval_model(model, paths.data / "val.parquet", out, cfg, paths, {"role": name, "split": "val"})
        if "memory_recall" not in r:
            raise RuntimeError(
                f"{out}: no memory diagnostics; the agent loop that ran predates them (delete the file to rerun)"
            )
        calls = paths.diagnose / f"{name}_calls.json"
        if not calls.is_file():
            print(
                f"[experiment {time.strftime('%H:%M:%S')}] diagnose {name}: per-call accuracy from the oracle's "
                f"state ({paths.sft_data / 'val.parquet'}, ETA ~{cfg.n_val // 2} s)",
                flush=True,
            )
        call_accuracy(model, paths.sft_data / "val.parquet", calls, budget)
