"""``metrics.csv`` from every stage's outputs, the summary table, and the report stage.

The CSV is rebuilt from scratch each time (eval JSONs, arm logs), so a resumed run never holds
duplicates. One row per (arm, seed, step, split):

    arm      teacher | student (SFT checkpoints; step = SFT step) | memopd | flat | ppo | opd | kd_soft (RL; step =
             RL step) | kd (SFT on the teacher's trajectories) | sft (SFT on the oracle's calls; step = optimizer step)
             | <model>@<state>_state: a teacher (``teacher``, or ``teacher_flat``, the flat arm's) acting alone in the
             aligned or the flat state (``heldout.state_f1``, Hugging Face agent, greedy; step = SFT step; f1 only)
    split    val | test: F1/EM of verl's greedy validation (the real agent loop) on that split;
             train: one RL step (f1 = mean F1 of the step's sampled episodes, ``critic/score/mean``);
             heldout: reverse_kl = KL(model || teacher) on the fixed held-out rollouts (``heldout.py``; step 0 =
             the start student, the same value for every arm)
    reverse_kl                    actor/memopd/reverse_kl of the step (train rows; empty for ppo)
    teacher_aligned_vs_flat_kl    actor/memopd/audit/teacher_aligned_vs_flat_kl (audited train rows)
    wall_s   train/val rows: training seconds so far (sum of timing_s/step); test and SFT-eval rows:
             wall seconds of the eval (test rows of arms: of the whole arm run, startup included)

``drift.csv``: held-out reverse KL by call index (:data:`DRIFT_COLUMNS`). ``episodes.csv``: one row per test
episode of every test eval (:data:`EPISODE_COLUMNS`), the input of the paired statistics (``horizon.py``). A
several-preset experiment also gets the combined ``metrics.csv`` / ``episodes.csv`` / ``drift.csv`` at the top of
its results folder (the preset and horizon first) and ``f1_vs_horizon.png``.
``handoff.csv`` (the eval stage, ``heldout.py``): val F1 when the teacher takes over from the start student at
call t. ``experiment.json``: the experiment's name, base model, arms, seeds and steps (the summary line's
``model=``), and each finished run's ``DONE.json`` record (``runs``: wall seconds, test F1, attempts, the step a
retry resumed from).
``sensitivity.csv`` (the sweep stage) has the same columns; its arm is ``<arm>@<variant>`` (e.g.
``memopd@lr3e-5``), its rows train and val only. ``diagnostics.csv`` (the diagnose stage): one row per
model (teacher, student, ``<arm>_seed<s>``), :data:`DIAGNOSTIC_COLUMNS`; ``call_accuracy.csv`` (also the
diagnose stage): one row per (model, call index), :data:`CALL_COLUMNS`.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

from verl_memopd.experiment.config import ARMS, SFT_ARMS, ExperimentConfig, Paths
from verl_memopd.experiment.launch import read_log, val_scores
from verl_memopd.experiment.launching import parse_steps

__all__ = [
    "COLUMNS",
    "EPISODE_COLUMNS",
    "HORIZON_COLUMNS",
    "HORIZON_EPISODE_COLUMNS",
    "DIAGNOSTIC_COLUMNS",
    "CALL_COLUMNS",
    "collect_rows",
    "collect_sweep_rows",
    "write_metrics",
    "read_metrics",
    "collect_episode_rows",
    "write_episodes",
    "read_episodes",
    "write_combined",
    "DRIFT_COLUMNS",
    "collect_drift_rows",
    "read_drift",
    "read_experiment",
    "summary_lines",
    "markdown_lines",
    "sensitivity_lines",
    "diagnostic_lines",
    "call_accuracy_lines",
    "state_lines",
    "stage_report",
]

COLUMNS = ("arm", "seed", "step", "split", "f1", "em", "reverse_kl", "teacher_aligned_vs_flat_kl", "wall_s")
#: episodes.csv: one row per test episode of every test eval (the start student and the teacher at seed 0, each arm
#: at each of its seeds), in the split's order; ``input_sha`` identifies the episode (``evaluate.episode_scores``)
EPISODE_COLUMNS = ("arm", "seed", "episode", "f1", "em", "input_sha")
#: a several-preset experiment's combined files at the top of its results folder: the preset and its horizon (memory
#: calls) first
HORIZON_PREFIX = ("preset", "horizon")
HORIZON_COLUMNS = (*HORIZON_PREFIX, *COLUMNS)
HORIZON_EPISODE_COLUMNS = (*HORIZON_PREFIX, *EPISODE_COLUMNS)
#: drift.csv: the held-out reverse KL by call index (``heldout.py``: KL(model || teacher) on the start student's fixed
#: val rollouts), for the start (arm ``student``, step 0) and each arm's saved steps
DRIFT_COLUMNS = ("arm", "seed", "step", "call", "reverse_kl")
HORIZON_DRIFT_COLUMNS = (*HORIZON_PREFIX, *DRIFT_COLUMNS)
Row = dict
DIAGNOSTIC_COLUMNS = ("model", "split", "f1", "em", "memory_recall", "memory_truncated")
#: call_accuracy.csv: per call index given the oracle's state (val traces; calls.py), exact replies and oracle lines
#: kept
CALL_COLUMNS = ("model", "call", "exact", "n", "accuracy", "lines", "lines_n", "line_recall")


def _row(
    arm: str, seed: int, step: int, split: str, f1=None, em=None, reverse_kl=None, flat_kl=None, wall_s=None
) -> Row:
    return {
        "arm": arm,
        "seed": seed,
        "step": step,
        "split": split,
        "f1": f1,
        "em": em,
        "reverse_kl": reverse_kl,
        "teacher_aligned_vs_flat_kl": flat_kl,
        "wall_s": wall_s,
    }


def _sft_rows(paths: Paths) -> list[Row]:
    rows = []
    for path in sorted(paths.evals().glob("*_step*_*.json")):
        r = json.loads(path.read_text())
        rows.append(_row(r["role"], 0, r["step"], r["split"], r["f1"], r["em"], wall_s=r["wall_s"]))
    return sorted(rows, key=lambda r: (r["arm"], r["step"], r["split"]))  # file names sort step 2000 before 500


def _state_rows(paths: Paths) -> list[Row]:
    """The state evals' rows (``eval/state_<model>_<split>.json``): arm ``<model>@<state>_state``, one per state."""
    rows = []
    for path in sorted(paths.evals().glob("state_*.json")):
        if path.name.endswith(".partial.json"):
            continue  # a state eval under way
        r = json.loads(path.read_text())
        for state, f1 in r["f1"].items():
            rows.append(_row(f"{r['model']}@{state}_state", 0, r["step"], r["split"], f1, wall_s=r["wall_s"]))
    return rows


def state_lines(rows: list[Row]) -> list[str]:
    """Each teacher's F1 by the state it acts in, per split (the ``@<state>_state`` rows); [] without them."""
    states = {}
    for r in rows:
        model, _, state = r["arm"].partition("@")
        if state.endswith("_state"):
            states.setdefault((model, r["split"]), {})[state.removesuffix("_state")] = r["f1"]
    return [
        f"{model} ({split}) F1 acting in the "
        + ", ".join(f"{s} state {_fmt(f1)}" for s, f1 in sorted(by_state.items()))
        for (model, split), by_state in sorted(states.items())
    ]


def _test_rows(arm: str, seed: int, run_dir: Path) -> list[Row]:
    """The run's test eval (``test.json``) with the wall seconds of its ``DONE.json``; [] before the test eval."""
    if not (run_dir / "test.json").is_file():
        return []
    t = json.loads((run_dir / "test.json").read_text())
    done = json.loads((run_dir / "DONE.json").read_text()) if (run_dir / "DONE.json").is_file() else {}
    return [_row(arm, seed, t["step"], "test", t["f1"], t["em"], wall_s=done.get("wall_s"))]


def _arm_rows(arm: str, seed: int, run_dir: Path) -> list[Row]:
    steps = parse_steps(read_log(run_dir / "main_ppo.log"))
    rows, wall = [], 0.0
    for step in sorted(steps):
        m = steps[step]
        if step > 0 and "timing_s/step" in m:
            wall += m["timing_s/step"]
            rows.append(
                _row(
                    arm,
                    seed,
                    step,
                    "train",
                    m.get("critic/score/mean"),
                    None,
                    m.get("actor/memopd/reverse_kl"),
                    m.get("actor/memopd/audit/teacher_aligned_vs_flat_kl"),
                    round(wall, 1),
                )
            )
        scores = val_scores(m)
        if scores:
            rows.append(_row(arm, seed, step, "val", scores["f1"], scores["em"], wall_s=round(wall, 1)))
    return rows + _test_rows(arm, seed, run_dir)


def _sft_arm_rows(arm: str, seed: int, run_dir: Path) -> list[Row]:
    """An SFT arm's val evals at its saved steps and its test eval (``kd.py``)."""
    rows = []
    for path in sorted(run_dir.glob("val_step*.json"), key=lambda f: int(f.stem.removeprefix("val_step"))):
        r = json.loads(path.read_text())
        rows.append(_row(arm, seed, r["step"], "val", r["f1"], r["em"], wall_s=r["wall_s"]))
    return rows + _test_rows(arm, seed, run_dir)


def _heldout_rows(arm: str, seed: int, run_dir: Path, start: Path) -> list[Row]:
    """Held-out reverse KL of the arm at step 0 (the start student) and at each saved step."""
    files = ([start] if start.is_file() else []) + sorted(
        run_dir.glob("heldout_kl_step*.json"), key=lambda f: int(f.stem.removeprefix("heldout_kl_step"))
    )
    rows = []
    for path in files:
        r = json.loads(path.read_text())
        rows.append(_row(arm, seed, r["step"], "heldout", reverse_kl=r["heldout_reverse_kl"], wall_s=r["wall_s"]))
    return rows


def collect_rows(cfg: ExperimentConfig, paths: Paths) -> list[Row]:
    """Every row the run folder's outputs give, plus the rows already in the results CSV of each (arm, seed) this run
    folder has nothing for: the run on a fresh machine (``--arms`` / ``--seeds`` of what is left), or a subset of
    arms, keeps what earlier machines committed. To drop a run's rows, delete them from the CSV."""
    rows = _sft_rows(paths) + _state_rows(paths)
    for seed in cfg.arms.seeds:
        for arm in cfg.arms.arms:
            run_dir = paths.arm(arm, seed)
            rows += _sft_arm_rows(arm, seed, run_dir) if arm in SFT_ARMS else _arm_rows(arm, seed, run_dir)
            if run_dir.is_dir():
                rows += _heldout_rows(arm, seed, run_dir, paths.evals() / "heldout_kl_student.json")
    produced = {(r["arm"], r["seed"]) for r in rows}
    committed = read_metrics(paths.metrics_csv) if paths.metrics_csv.is_file() else []
    return rows + [r for r in committed if (r["arm"], r["seed"]) not in produced]


def collect_sweep_rows(cfg: ExperimentConfig, paths: Paths) -> list[Row]:
    """The sweep's rows (arm ``<arm>@<variant>``), runs that have started; [] without a sweep."""
    rows: list[Row] = []
    for variant, arm in cfg.sweep.runs() if cfg.sweep is not None else []:
        run_dir = paths.sweep_run(variant.name, arm, cfg.sweep.seed)
        if run_dir.is_dir():
            rows += _arm_rows(f"{arm}@{variant.name}", cfg.sweep.seed, run_dir)
    return rows


def _cell(x) -> str:
    return "" if x is None else (f"{x:.6g}" if isinstance(x, float) else x)


def write_metrics(rows: list[Row], path: Path) -> None:
    _write(rows, path, COLUMNS)


def read_metrics(path: Path) -> list[Row]:
    """The CSV back as rows with numbers (empty cells -> None); checks the header."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise ValueError(f"{path}: columns {reader.fieldnames}, expected {list(COLUMNS)}")
        rows = []
        for r in reader:
            out = {"arm": r["arm"], "split": r["split"], "seed": int(r["seed"]), "step": int(r["step"])}
            for k in COLUMNS[4:]:
                out[k] = float(r[k]) if r[k] != "" else None
            rows.append(out)
    return rows


def _eval_episodes(path: Path, arm: str, seed: int) -> list[dict]:
    """The per-episode rows of one eval JSON (``evaluate.eval_model``); [] if absent or from before they were kept."""
    if not path.is_file():
        return []
    result = json.loads(path.read_text())
    return [
        {"arm": arm, "seed": seed, "episode": i, "f1": e["f1"], "em": e["em"], "input_sha": e["input_sha"]}
        for i, e in enumerate(result.get("episodes", []))
    ]


def collect_episode_rows(cfg: ExperimentConfig, paths: Paths) -> list[dict]:
    """Every test eval's episodes in this run folder (the final teacher and the RL start at seed 0, each arm at each
    seed), plus the committed ``episodes.csv`` rows of each (arm, seed) this folder has nothing for (as
    ``report.collect_rows`` keeps committed metrics)."""
    rows = []
    for role in ("student", "teacher"):
        for path in sorted(paths.evals().glob(f"{role}_step*_test.json")):
            rows += _eval_episodes(path, role, 0)
    for seed in cfg.arms.seeds:
        for arm in cfg.arms.arms:
            rows += _eval_episodes(paths.arm(arm, seed) / "test.json", arm, seed)
    produced = {(r["arm"], r["seed"]) for r in rows}
    committed = read_episodes(paths.results / "episodes.csv") if (paths.results / "episodes.csv").is_file() else []
    for line in reproduction_lines(rows, committed):
        print(f"[experiment] report: {line}", flush=True)
    return rows + [r for r in committed if (r["arm"], r["seed"]) not in produced]


def reproduction_lines(rows: list[dict], committed: list[dict]) -> list[str]:
    """For each (arm, seed) both measured here and committed: whether this folder's test episodes reproduce the
    committed ones (same episodes, F1 and EM, episode by episode), e.g. after a fresh machine rebuilt the models.
    The committed rows are replaced by the new ones either way; this says whether that changed anything."""

    def keyed(rs: list[dict]) -> dict[tuple, list[tuple]]:
        out: dict[tuple, list[tuple]] = {}
        for r in rs:
            out.setdefault((r["arm"], int(r["seed"])), []).append(
                (int(r["episode"]), r["input_sha"], round(float(r["f1"]), 6), round(float(r["em"]), 6))
            )
        return out

    new, old = keyed(rows), keyed(committed)
    lines = []
    for key in sorted(new.keys() & old.keys()):
        a, b = sorted(new[key]), sorted(old[key])
        same = sum(x == y for x, y in zip(a, b))
        f1_new, f1_old = (sum(e[2] for e in es) / len(es) for es in (a, b))
        verdict = "reproduce" if a == b else "differ from"
        lines.append(
            f"{key[0]} seed {key[1]}: the test episodes {verdict} the committed episodes.csv ({same} of "
            f"{len(b)} episodes equal; F1 {f1_new:.4f} here, {f1_old:.4f} committed)"
        )
    return lines


def _drift_rows(path: Path, arm: str, seed: int) -> list[dict]:
    if not path.is_file():
        return []
    r = json.loads(path.read_text())
    by_call = r.get("heldout_reverse_kl_by_call", {})
    return [
        {"arm": arm, "seed": seed, "step": r["step"], "call": int(c), "reverse_kl": kl}
        for c, kl in sorted(by_call.items(), key=lambda kv: int(kv[0]))
    ]


def collect_drift_rows(cfg: ExperimentConfig, paths: Paths) -> list[dict]:
    """drift.csv's rows (:data:`DRIFT_COLUMNS`) from this run folder's held-out KL files, plus the committed rows of
    each (arm, seed) the folder has nothing for."""
    rows = _drift_rows(paths.evals() / "heldout_kl_student.json", "student", 0)
    for seed in cfg.arms.seeds:
        for arm in cfg.arms.arms:
            for path in sorted(paths.arm(arm, seed).glob("heldout_kl_step*.json")):
                rows += _drift_rows(path, arm, seed)
    produced = {(r["arm"], r["seed"]) for r in rows}
    committed = _read(paths.results / "drift.csv", DRIFT_COLUMNS) if (paths.results / "drift.csv").is_file() else []
    return rows + [r for r in committed if (r["arm"], r["seed"]) not in produced]


#: the text and integer columns of the CSVs :func:`_read` reads back (every other column is a float, empty = None)
_TEXT_COLUMNS = ("arm", "preset", "input_sha")
_INT_COLUMNS = ("seed", "step", "episode", "call", "horizon")


def _read(path: Path, columns: tuple[str, ...]) -> list[dict]:
    """A CSV of ``columns`` (or with the preset prefix) back as rows, each column as its type; checks the header."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header = tuple(reader.fieldnames or ())
        if header not in (columns, (*HORIZON_PREFIX, *columns)):
            raise ValueError(f"{path}: columns {list(header)}, expected {list(columns)} (or with preset, horizon)")
        return [{k: _typed(k, v) for k, v in r.items()} for r in reader]


def _typed(column: str, text: str):
    if column in _TEXT_COLUMNS:
        return text
    if text == "":
        return None
    return int(text) if column in _INT_COLUMNS else float(text)


def _write(rows: list[dict], path: Path, columns: tuple[str, ...]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({k: _cell(r[k]) for k in columns})


def read_drift(path: Path) -> list[dict]:
    """drift.csv (one preset's or the combined one) back as rows."""
    return _read(path, DRIFT_COLUMNS)


def write_episodes(rows: list[dict], path: Path) -> None:
    _write(rows, path, EPISODE_COLUMNS)


def read_episodes(path: Path) -> list[dict]:
    """``episodes.csv`` (one preset's, :data:`EPISODE_COLUMNS`) or the combined one (:data:`HORIZON_EPISODE_COLUMNS`)
    back as rows with numbers; checks the header."""
    return _read(path, EPISODE_COLUMNS)


def preset_horizon(preset: str) -> int:
    """The number of memory calls of a task preset."""
    from verl_memopd.tasks.generator import get_preset

    return get_preset(preset).config.n_chunks


def write_combined(cfg: ExperimentConfig, paths: Paths) -> tuple[Path, Path]:
    """The experiment's combined ``metrics.csv``, ``episodes.csv`` and ``drift.csv`` (every preset's, with its preset
    and horizon first) and an ``experiment.json`` (name, base model, presets) at the top of the results folder;
    ``paths`` may be scoped to any preset. Presets without results yet are left out."""
    top = Paths(paths.root, paths.results_root)
    metrics, episodes, drift = [], [], []
    for preset in cfg.presets:
        scoped = top.at(preset)
        extra = {"preset": preset, "horizon": preset_horizon(preset)}
        if scoped.metrics_csv.is_file():
            metrics += [{**extra, **r} for r in read_metrics(scoped.metrics_csv)]
        if (scoped.results / "episodes.csv").is_file():
            episodes += [{**extra, **r} for r in read_episodes(scoped.results / "episodes.csv")]
        if (scoped.results / "drift.csv").is_file():
            drift += [{**extra, **r} for r in _read(scoped.results / "drift.csv", DRIFT_COLUMNS)]
    _write(metrics, top.metrics_csv, HORIZON_COLUMNS)
    _write(episodes, top.results / "episodes.csv", HORIZON_EPISODE_COLUMNS)
    _write(drift, top.results / "drift.csv", HORIZON_DRIFT_COLUMNS)
    meta = {"name": cfg.name, "base_model": cfg.base_model, "presets": list(cfg.presets)}
    (top.results / "experiment.json").write_text(json.dumps(meta, indent=1) + "\n")
    return top.metrics_csv, top.results / "episodes.csv"


def _final(rows: list[Row], arm: str, split: str) -> dict[int, Row]:
    """Per seed, the row of ``arm`` on ``split`` at the largest step."""
    out: dict[int, Row] = {}
    for r in rows:
        if r["arm"] == arm and r["split"] == split and (r["seed"] not in out or r["step"] > out[r["seed"]]["step"]):
            out[r["seed"]] = r
    return out


def _fmt(x: float | None) -> str:
    return "na" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


def summary_lines(rows: list[Row], model: str = "na") -> list[str]:
    """The final test-split table; the last line is the machine-readable ``experiment ...`` line (``model``: the
    experiment's base model, from ``experiment.json``)."""
    teacher, student = _final(rows, "teacher", "test"), _final(rows, "student", "test")
    lines = [f"{'arm':8} {'seeds':>5} {'steps':>5} {'test F1 mean':>12} {'std':>7} {'test EM':>8} {'wall_s/seed':>11}"]
    means, seeds, steps = {}, set(), set()
    for arm in ARMS:
        final = _final(rows, arm, "test")
        f1s = [r["f1"] for r in final.values()]
        means[arm] = statistics.fmean(f1s) if f1s else None
        seeds |= set(final)
        steps |= {r["step"] for r in final.values()}
        std = statistics.stdev(f1s) if len(f1s) > 1 else 0.0 if f1s else None
        walls = [r["wall_s"] for r in final.values() if r["wall_s"] is not None]
        ems = [r["em"] for r in final.values()]
        lines.append(
            f"{arm:8} {len(final):>5} {max((r['step'] for r in final.values()), default=0):>5} "
            f"{_fmt(means[arm]):>12} {_fmt(std):>7} {_fmt(statistics.fmean(ems) if ems else None):>8} "
            f"{(f'{statistics.fmean(walls):.0f}' if walls else 'na'):>11}"
        )
    t = teacher[max(teacher)]["f1"] if teacher else None
    f0 = student[max(student)]["f1"] if student else None
    lines.append(f"teacher (SFT) test F1 {_fmt(t)}; student start (SFT) test F1 {_fmt(f0)}")
    lines.append(
        f"experiment model={model} seeds={len(seeds)} steps={max(steps, default=0)} teacher_f1={_fmt(t)} "
        f"start_f1={_fmt(f0)} memopd_f1={_fmt(means['memopd'])} flat_f1={_fmt(means['flat'])} "
        f"ppo_f1={_fmt(means['ppo'])} kd_f1={_fmt(means['kd'])} opd_f1={_fmt(means['opd'])}"
    )
    return lines


#: the arms as the markdown table names them (their Hydra overrides: :data:`ARMS`)
ARM_LABELS = {
    "memopd": "MemOPD",
    "flat": "persistent-history teacher (`memopd.teacher.state=flat`)",
    "ppo": "PPO alone (`memopd.distill.coef=0`)",
    "opd": "OPD alone (`memopd.ppo_coef=0`)",
    "kd_soft": "off-policy OPD (the same loss on the teacher's greedy trajectories, replayed)",
    "kd": "off-policy KD (verl SFT on the teacher's greedy trajectories)",
    "sft": "continued SFT (verl SFT on the oracle's calls)",
}


def _mean_std(xs: list[float]) -> str:
    if not xs:
        return "na"
    return f"{xs[0]:.3f}" if len(xs) == 1 else f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs):.3f}"


def markdown_lines(rows: list[Row]) -> list[str]:
    """The arms' final rows as a markdown table (the README's): test F1 mean ± std over seeds with each seed's value,
    val F1 and held-out KL at the final step, and the mean wall seconds of a seed's training run (the test rows'
    ``wall_s``, from ``DONE.json``; a KD run's is its SFT alone)."""
    start_kl = [r["reverse_kl"] for r in rows if r["split"] == "heldout" and r["step"] == 0]
    steps = max((r["step"] for arm in ARMS for r in _final(rows, arm, "test").values()), default=0)
    kl_head = f"held-out KL at step {steps}" + (f" (start {start_kl[0]:.3f})" if start_kl else "")
    lines = [
        f"| arm | seeds | test F1, mean ± std (each seed) | val F1 at step {steps} | {kl_head} | wall / seed |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for arm in ARMS:
        test = _final(rows, arm, "test")
        if not test:
            continue
        seeds = sorted(test)
        f1s = [test[s]["f1"] for s in seeds]
        val = [r["f1"] for r in _final(rows, arm, "val").values()]
        kl = [r["reverse_kl"] for r in _final(rows, arm, "heldout").values() if r["reverse_kl"] is not None]
        walls = [test[s]["wall_s"] for s in seeds if test[s]["wall_s"] is not None]
        per_seed = f"seeds {', '.join(map(str, seeds))}: " + " / ".join(f"{x:.3f}" for x in f1s)
        wall = f"{statistics.fmean(walls):,.0f} s" if walls else "na"
        lines.append(
            f"| {ARM_LABELS.get(arm, arm)} | {len(seeds)} | {_mean_std(f1s)} ({per_seed}) | "
            f"{_mean_std(val)} | {_mean_std(kl)} | {wall} |"
        )
    return lines


def sensitivity_lines(sweep: list[Row], arms: list[Row], seed: int) -> list[str]:
    """Val F1 at each validated step: the matched arms at ``seed`` (``<arm>@arms``), then each sweep run."""
    base = [dict(r, arm=f"{r['arm']}@arms") for r in arms if r["arm"] in ARMS and r["seed"] == seed]
    series: dict[str, dict[int, float]] = {}
    for r in base + sweep:
        if r["split"] == "val":
            series.setdefault(r["arm"], {})[r["step"]] = r["f1"]
    steps = sorted({s for v in series.values() for s in v})
    lines = [f"{'run (seed ' + str(seed) + ')':22} " + " ".join(f"{f'val F1 @{s}':>10}" for s in steps)]
    for name in sorted(series, key=lambda n: (n.split("@")[0], n.split("@")[1] != "arms", n)):
        lines.append(f"{name:22} " + " ".join(f"{_fmt(series[name].get(s)):>10}" for s in steps))
    return lines


def diagnostic_lines(results: list[dict]) -> list[str]:
    """A table of the diagnose stage's evals (``diagnose/*.json``), in the given order."""
    lines = [f"{'model (val)':16} {'F1':>7} {'EM':>7} {'answers in final memory':>24} {'memory calls truncated':>23}"]
    for r in results:
        lines.append(
            f"{r['role']:16} {_fmt(r['f1']):>7} {_fmt(r['em']):>7} {_fmt(r['memory_recall']):>24} "
            f"{_fmt(r['memory_truncated']):>23}"
        )
    return lines


def _write_diagnostics(cfg: ExperimentConfig, paths: Paths) -> list[dict]:
    from verl_memopd.experiment.evaluate import diagnose_names

    files = [paths.diagnose / f"{name}_val.json" for name in diagnose_names(cfg, paths)]
    results = [json.loads(f.read_text()) for f in files if f.is_file()]
    if results:
        with open(paths.diagnostics_csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(DIAGNOSTIC_COLUMNS)
            for r in results:
                w.writerow([r["role"], r["split"], *(f"{r[k]:.6g}" for k in DIAGNOSTIC_COLUMNS[2:])])
    return results


def call_accuracy_lines(results: dict[str, list[dict]]) -> list[str]:
    """Per-call exact match and line recall (``{model: [{"call", "exact", "n", "lines", "lines_n"}, ...]}``),
    one ``exact/lines`` column per call."""
    calls = sorted({c["call"] for scores in results.values() for c in scores})
    lines = [f"{'model (val, oracle state)':26} " + " ".join(f"{f'call {c} exact/lines':>20}" for c in calls)]
    for model, scores in results.items():
        by_call = {c["call"]: f"{_fmt(c['exact'] / c['n'])}/{_fmt(c['lines'] / c['lines_n'])}" for c in scores}
        lines.append(f"{model:26} " + " ".join(f"{by_call.get(c, 'na'):>20}" for c in calls))
    return lines


def _write_call_accuracy(cfg: ExperimentConfig, paths: Paths) -> dict[str, list[dict]]:
    from verl_memopd.experiment.evaluate import diagnose_names

    files = {name: paths.diagnose / f"{name}_calls.json" for name in diagnose_names(cfg, paths)}
    results = {name: json.loads(f.read_text())["calls"] for name, f in files.items() if f.is_file()}
    if results:
        with open(paths.call_accuracy_csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(CALL_COLUMNS)
            for model, scores in results.items():
                for c in scores:
                    w.writerow(
                        [
                            model,
                            c["call"],
                            c["exact"],
                            c["n"],
                            f"{c['exact'] / c['n']:.6g}",
                            c["lines"],
                            c["lines_n"],
                            f"{c['lines'] / c['lines_n']:.6g}",
                        ]
                    )
    return results


def read_experiment(results: Path) -> dict:
    """The ``experiment.json`` in the results folder ``results`` ({} without one)."""
    path = results / "experiment.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _write_handoff(paths: Paths) -> list[str]:
    """``handoff.csv`` from ``eval/handoff.json``; the lines of its table ([] before the eval stage ran it)."""
    source = paths.evals() / "handoff.json"
    if not source.is_file():
        return []
    f1 = json.loads(source.read_text())["f1_by_switch"]
    with open(paths.results / "handoff.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("teacher_from_call", "val_f1"))
        for t, v in f1.items():
            w.writerow((t, f"{v:.6g}"))
    return [
        "teacher takes over at call (val F1): " + " ".join(f"{t}:{_fmt(v)}" for t, v in f1.items()),
        f"  (0 = the teacher alone, {max(map(int, f1))} = the student alone)",
    ]


def _experiment_meta(cfg: ExperimentConfig, paths: Paths) -> dict:
    """``experiment.json``: the experiment's settings, its arms and seeds, and each finished run's ``DONE.json`` less
    its local path (``runs``, ``<arm>_seed<s>``: wall_s, test_f1, attempts, resumed_from_step), so a reader knows which
    runs were retried or resumed. Arms, seeds and runs this run folder does not have are kept from the committed file
    (as :func:`collect_rows` keeps their rows): a run of a subset (``--arms`` / ``--seeds``) narrows nothing."""
    committed = read_experiment(paths.results)
    runs = committed.get("runs", {})
    for seed in cfg.arms.seeds:
        for arm in cfg.arms.arms:
            done = paths.arm(arm, seed) / "DONE.json"
            if done.is_file():
                record = json.loads(done.read_text())
                runs[f"{arm}_seed{seed}"] = {k: v for k, v in record.items() if k != "final_actor"}
    arms = list(dict.fromkeys([*committed.get("arms", []), *cfg.arms.arms]))
    return {
        "name": cfg.name,
        "base_model": cfg.base_model,
        "arms": arms,
        "seeds": sorted({*committed.get("seeds", []), *cfg.arms.seeds}),
        "steps": cfg.arms.steps,
        "episodes_per_step": cfg.arms.episodes_per_step,
        "lr": cfg.arms.lr,
        "arm_overrides": list(cfg.arm_overrides),
        "runs": runs,
    }


def stage_report(cfg: ExperimentConfig, paths: Paths) -> None:
    from verl_memopd.experiment.plot import plot_metrics

    paths.results.mkdir(parents=True, exist_ok=True)
    (paths.results / "experiment.json").write_text(json.dumps(_experiment_meta(cfg, paths), indent=1) + "\n")
    write_metrics(collect_rows(cfg, paths), paths.metrics_csv)
    rows = read_metrics(paths.metrics_csv)
    handoff_json = paths.evals() / "handoff.json"
    handoff = (
        {int(t): v for t, v in json.loads(handoff_json.read_text())["f1_by_switch"].items()}
        if handoff_json.is_file()
        else None
    )
    plot_metrics(rows, paths.plot, handoff)
    print(f"[experiment] report: {paths.metrics_csv} ({len(rows)} rows), {paths.plot}")
    sweep = collect_sweep_rows(cfg, paths)
    if sweep:
        write_metrics(sweep, paths.sensitivity_csv)
        print(f"[experiment] sensitivity (val only): {paths.sensitivity_csv}")
        print("\n".join(sensitivity_lines(read_metrics(paths.sensitivity_csv), rows, cfg.sweep.seed)))
    diagnostics = _write_diagnostics(cfg, paths) if cfg.diagnose else []
    if diagnostics:
        print(f"[experiment] diagnostics (val): {paths.diagnostics_csv}")
        print("\n".join(diagnostic_lines(diagnostics)))
    calls = _write_call_accuracy(cfg, paths) if cfg.diagnose else {}
    if calls:
        print(f"[experiment] per-call accuracy from the oracle's state (val): {paths.call_accuracy_csv}")
        print("\n".join(call_accuracy_lines(calls)))
    handoff = _write_handoff(paths)
    if handoff:
        print("\n".join(handoff))
    states = state_lines(rows)
    if states:
        print("\n".join(states))
    write_episodes(collect_episode_rows(cfg, paths), paths.results / "episodes.csv")
    _write(collect_drift_rows(cfg, paths), paths.results / "drift.csv", DRIFT_COLUMNS)
    print("\n".join(summary_lines(rows, cfg.base_model)), flush=True)
    if len(cfg.presets) > 1:
        from verl_memopd.experiment.horizon import horizon_summary_lines
        from verl_memopd.experiment.plot import plot_horizon

        metrics, episodes = write_combined(cfg, paths)
        top = Paths(paths.root, paths.results_root)
        figure = plot_horizon(
            read_episodes(episodes), read_drift(top.results / "drift.csv"), top.results / "f1_vs_horizon.png"
        )
        print(f"[experiment] every preset: {metrics}, {episodes}, {figure}")
        print("\n".join(horizon_summary_lines(read_episodes(episodes), cfg.base_model)), flush=True)
