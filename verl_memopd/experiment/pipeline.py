"""The experiment's stages, in order; each is skipped when its output exists.

    models        tokenizer + tiny student (2L/128) and teacher (4L/256), random init    models/tiny.json
                  (or a pretrained base for both roles, ``verl_memopd.experiment.models``)          models/base.json
    data          fresh episodes (train/val/test) + the oracle's calls as SFT chat rows   sft_data/train.parquet
                  (several presets: data/<preset>/, sft_data/<preset>/, mixed into sft_data/)
    sft_student   short SFT of the student (verl SFT trainer)                            sft/student/DONE.json
    sft_teacher   long SFT of the teacher (verl SFT trainer)                             sft/teacher/DONE.json
    sft_teacher_flat  the flat arm's teacher: the teacher's SFT continued on flat     sft/teacher_flat/DONE.json
                  (persistent-history) and per-call rows, only with ``teacher_flat_sft`` (``flat_sft.py``)
    eval          val F1 of SFT checkpoints (verl val_only, real agent loop), test F1     eval/*.json
                  of the chosen ones; picks the student checkpoint
    arms          memopd / flat / ppo x seeds of RL from the student, val F1 every K     arms/<arm>_seed<s>/DONE.json
                  steps, test F1 at the end
    diagnose      val evals of teacher, start and the arms' final actors (first seed)    diagnose/<model>_val.json
                  with the agent's memory diagnostics (answers kept in memory, truncation), and
                  their per-call accuracy from the oracle's state                        diagnose/<model>_calls.json
    report        results/<name>/metrics.csv (from every stage's outputs), f1.png,       always rerun
                  diagnostics.csv, call_accuracy.csv (and sensitivity.csv once a sweep ran)
    sweep         a follow-up, not in the default run (``--until sweep`` /     sweep/<variant>_<arm>_seed<s>/DONE.json
                  ``--only sweep``; ~40 min): sensitivity on val only, the arms rerun at seed 0
                  with one setting changed (lr, lambda, teacher mask), no test eval;
                  ends with the report (sensitivity.csv)

With several task presets (the horizon study), eval, arms, diagnose, report and sweep run once per
preset, each in its own scope (``data/<preset>``, ``eval/<preset>``, ``arms/<preset>``, ``results/<name>/<preset>``).

The student's SFT runs before the teacher's: it is short, and its checkpoints can be evaluated
while the teacher trains. verl runs its checkpoints itself (``trainer.resume_mode=auto``), so a
stage that died mid-way resumes from its newest checkpoint.
"""

from __future__ import annotations

import fcntl
import json
import sys
import time
from contextlib import contextmanager

from verl_memopd.experiment.config import ExperimentConfig, Paths
from verl_memopd.experiment.launching import cpu_env
from verl_memopd.experiment.runner import run_checked

__all__ = ["STAGES", "SHARED_STAGES", "EXPERIMENT_END", "run_pipeline"]

STAGES = (
    "models",
    "data",
    "sft_student",
    "sft_teacher",
    "sft_teacher_flat",
    "eval",
    "arms",
    "diagnose",
    "report",
    "sweep",
)
#: the stages whose outputs every preset shares (the others run once per preset, ``Paths.at``)
SHARED_STAGES = ("models", "data", "sft_student", "sft_teacher", "sft_teacher_flat")
#: the last stage of a default run: the experiment itself; the sweep after it is asked for by name
EXPERIMENT_END = "report"


def _say(msg: str) -> None:
    print(f"[experiment {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stage_models(cfg: ExperimentConfig, paths: Paths) -> None:
    if cfg.base_model == "tiny":
        if (paths.models / "tiny.json").is_file():
            return _say(f"models: done ({paths.models})")
        _say("models: tokenizer + student + teacher (ETA ~10 s)")
        return run_checked([sys.executable, "-m", "verl_memopd.bench.tiny", "--out", str(paths.models), "--seed", "0"])
    marker = paths.models / "base.json"
    if marker.is_file():
        return _say(f"models: done ({paths.models}, {cfg.base_model})")
    base = paths.models / cfg.base_model
    _say(f"models: {cfg.base_model} GGUF -> Hugging Face folder {base} (ETA ~30 s); student and teacher start from it")
    run_checked([sys.executable, "-m", "verl_memopd.experiment.models", cfg.base_model, "--out", str(base)])
    for role in ("student", "teacher"):
        link = paths.models / role
        if not link.exists():
            link.symlink_to(base.name)
    marker.write_text(json.dumps({"base_model": cfg.base_model, "folder": str(base)}) + "\n")


def _build_preset(cfg: ExperimentConfig, paths: Paths, preset: str) -> None:
    """``paths.data`` episodes of ``preset`` and their oracle traces in ``paths.sft_data``."""
    from verl_memopd.experiment.sft import build_sft_data

    run_checked(
        [
            sys.executable,
            "-m",
            "verl_memopd.tasks",
            "build",
            "--out",
            str(paths.data),
            "--preset",
            preset,
            "--seed",
            str(cfg.data_seed),
            "--n-train",
            str(cfg.n_train),
            "--n-val",
            str(cfg.n_val),
            "--n-test",
            str(cfg.n_test),
        ]
    )
    build_sft_data(paths.data, paths.sft_data)


def stage_data(cfg: ExperimentConfig, paths: Paths) -> None:
    """Episodes + oracle traces; with several presets, each under its own scope, and the SFT data (unscoped)
    is every preset's traces concatenated (``sft_data.mix_traces``)."""
    if (paths.sft_data / "train.parquet").is_file():
        return _say(f"data: done ({paths.data}, {paths.sft_data})")
    _say(
        f"data: {cfg.n_train}/{cfg.n_val}/{cfg.n_test} episodes x {len(cfg.presets)} preset(s) {cfg.presets} + "
        f"oracle traces (ETA ~{len(cfg.presets) * (5 + cfg.n_train // 1000)} s)"
    )
    if len(cfg.presets) == 1:
        return _build_preset(cfg, paths, cfg.presets[0])
    from verl_memopd.experiment.sft import mix_traces

    for preset in cfg.presets:
        if not (paths.at(preset).sft_data / "train.parquet").is_file():
            _build_preset(cfg, paths.at(preset), preset)
    mix_traces([paths.at(p).sft_data for p in cfg.presets], list(cfg.presets), paths.sft_data)


def _stage_sft(role: str, cfg: ExperimentConfig, paths: Paths) -> None:
    from verl_memopd.experiment.sft import continuable_sft, finished_sft, record_sft_model, run_sft

    run_dir = paths.sft(role)
    sft = cfg.teacher_sft if role == "teacher" else cfg.student_sft
    done = continuable_sft(run_dir, sft, f"sft_{role}")
    if done is None or done["steps"] != sft.steps:
        start = 0 if done is None else done["steps"]
        _say(
            f"sft_{role}: {'' if done is None else f'extending {start} -> '}{sft.steps} steps x {sft.batch} "
            f"calls, lr {sft.lr}, checkpoint every {sft.save_every} (ETA ~{(sft.steps - start) * sft.step_s / 60:.0f} "
            f"min alone; progress: tail -f {run_dir / 'sft.log'})"
        )
        env = cpu_env(paths.root, threads=cfg.worker_threads)
        run_sft(paths.models / role, paths.sft_data, run_dir, sft, f"sft_{role}", env)
    done = finished_sft(run_dir)
    record_sft_model(paths.results, role, done)
    _say(f"sft_{role}: done ({done['hf']})")


def _later(module: str, function: str):
    """A stage function imported when it runs (plotting and verl launch code load only if needed)."""

    def stage(cfg: ExperimentConfig, paths: Paths) -> None:
        import importlib

        getattr(importlib.import_module(f"verl_memopd.experiment.{module}"), function)(cfg, paths)

    return stage


@contextmanager
def _stage_lock(paths: Paths, name: str):
    """Hold ``locks/<stage>.lock`` while a stage runs: a second pipeline (e.g. ``--only sft_teacher`` started
    by hand next to a full run) waits, then finds the stage done and skips it."""
    lock_dir = paths.root / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"{name}: another process is running this stage; waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def run_pipeline(
    cfg: ExperimentConfig,
    paths: Paths,
    until: str = EXPERIMENT_END,
    only: str | None = None,
    presets: tuple[str, ...] | None = None,
) -> None:
    """Run every stage up to and including ``until`` (or just ``only``), skipping finished ones.

    ``presets``: the presets the per-preset stages run on, in this order (default: all of ``cfg.presets``); the
    shared stages always cover every preset (the mixed SFT data does not depend on which ones run now)."""
    for stage in (until, only):
        if stage is not None and stage not in STAGES:
            raise ValueError(f"stage {stage!r}; valid: {STAGES}")
    unknown = [p for p in presets or () if p not in cfg.presets]
    if unknown or (presets is not None and len(set(presets)) != len(presets)):
        raise ValueError(f"presets {presets!r}: each must be one of the experiment's presets {cfg.presets}, once")
    steps = {
        "models": stage_models,
        "data": stage_data,
        "sft_student": lambda c, p: _stage_sft("student", c, p),
        "sft_teacher": lambda c, p: _stage_sft("teacher", c, p),
        "sft_teacher_flat": _later("flat_sft", "run_teacher_flat"),
        "eval": _later("evaluate", "stage_eval"),
        "arms": _later("arms", "stage_arms"),
        "sweep": _later("arms", "stage_sweep"),
        "diagnose": _later("evaluate", "stage_diagnose"),
        "report": _later("report", "stage_report"),
    }
    paths.root.mkdir(parents=True, exist_ok=True)
    for name in [only] if only else STAGES[: STAGES.index(until) + 1]:
        start = time.monotonic()
        with _stage_lock(paths, name):
            for scoped in _scopes(cfg, paths, name, presets or cfg.presets):
                steps[name](cfg, scoped)
        _say(f"stage {name}: {time.monotonic() - start:.0f}s")


def _scopes(cfg: ExperimentConfig, paths: Paths, stage: str, presets: tuple[str, ...]) -> list[Paths]:
    """The paths a stage runs on: once, unscoped, for one preset or a shared stage; once per preset of
    ``presets``, in order, for the per-preset stages of a several-preset experiment."""
    if len(cfg.presets) == 1 or stage in SHARED_STAGES:
        return [paths]
    return [paths.at(preset) for preset in presets]
