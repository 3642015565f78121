"""The horizon study's statistics and its off-policy arms' data: per-episode eval scores from verl's validation dump,
episodes.csv, the paired bootstrap, the one-line-per-horizon summary (its exact shape), replay and oracle rows."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from verl_memopd.experiment.config import ARMS, SFT_ARMS, Paths, smollm2_horizon_config
from verl_memopd.experiment.evaluate import episode_scores
from verl_memopd.experiment.horizon import SUMMARY_ARMS, horizon_summary_lines, paired_difference
from verl_memopd.experiment.report import (
    HORIZON_EPISODE_COLUMNS,
    read_episodes,
    write_combined,
    write_episodes,
    write_metrics,
)

REPO = Path(__file__).resolve().parents[1]

#: the acceptance line of the horizon issue, as a pattern (numbers or na)
NUM = r"(-?\d+\.\d{4}|na)"
SUMMARY_LINE = re.compile(
    rf"experiment horizon=\d+ model=\S+ seeds=\d+ test_episodes=\d+ teacher_f1={NUM} start_f1={NUM} "
    rf"memopd_f1={NUM} opd_f1={NUM} kd_soft_f1={NUM} kd_f1={NUM} sft_f1={NUM} flat_f1={NUM} "
    rf"opd_minus_kd_soft={NUM} opd_minus_kd_soft_ci={NUM},{NUM} memopd_minus_kd={NUM} memopd_minus_kd_ci={NUM},{NUM}"
)


def _dump(tmp_path: Path, f1s: list[float]) -> Path:
    d = tmp_path / "generations"
    d.mkdir()
    lines = [{"input": f"q{i}", "output": "a", "score": f, "f1": f, "em": float(f == 1.0)} for i, f in enumerate(f1s)]
    (d / "0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


def test_episode_scores_read_verls_validation_dump_in_order(tmp_path):
    d = _dump(tmp_path, [1.0, 0.5, 0.0])
    scores = episode_scores(d, 3)
    assert [s["f1"] for s in scores] == [1.0, 0.5, 0.0] and [s["em"] for s in scores] == [1.0, 0.0, 0.0]
    assert len({s["input_sha"] for s in scores}) == 3
    with pytest.raises(RuntimeError, match="3 samples, the split has 4 episodes"):
        episode_scores(d, 4)
    (d / "1.jsonl").write_text("")
    with pytest.raises(RuntimeError, match="expected one validation dump"):
        episode_scores(d, 3)


def _episodes(arm: str, seeds, f1s, sha="e"):
    return [
        {"arm": arm, "seed": s, "episode": i, "f1": f, "em": 0.0, "input_sha": f"{sha}{i}"}
        for s in seeds
        for i, f in enumerate(f1s(s) if callable(f1s) else f1s)
    ]


def test_paired_difference_is_the_mean_gap_with_an_interval_around_it():
    rows = _episodes("opd", (0, 1, 2), lambda s: [0.6 + 0.01 * s, 0.8, 0.4, 0.7]) + _episodes(
        "kd_soft", (0, 1, 2), [0.5, 0.7, 0.4, 0.5]
    )
    mean, lo, hi, seeds = paired_difference(rows, "opd", "kd_soft")
    assert seeds == 3 and mean == pytest.approx((0.11 + 0.1 + 0.0 + 0.2) / 4, abs=1e-9)
    assert lo <= mean <= hi and lo >= 0.0 and hi <= 0.21  # every paired gap is in [0, 0.2 + 0.02]
    same = paired_difference(_episodes("a", (0,), [0.3] * 5) + _episodes("b", (0,), [0.3] * 5), "a", "b")
    assert same[:3] == (0.0, 0.0, 0.0)
    assert paired_difference(rows, "opd", "sft") is None  # no seed in common


def test_paired_difference_refuses_evals_of_other_episodes():
    rows = _episodes("opd", (0,), [0.5, 0.5]) + _episodes("kd_soft", (0,), [0.4, 0.4], sha="other")
    with pytest.raises(ValueError, match="kd_soft seed 0 was evaluated on other test episodes"):
        paired_difference(rows, "opd", "kd_soft")


def test_horizon_summary_has_the_issues_line_per_horizon():
    rows = []
    for horizon in (3, 12):
        one = _episodes("teacher", (0,), [0.9, 0.8]) + _episodes("student", (0,), [0.2, 0.3])
        for arm in SUMMARY_ARMS:
            one += _episodes(arm, (0, 1, 2), [0.5, 0.4 if arm != "opd" else 0.6])
        rows += [{**r, "horizon": horizon} for r in one]
    rows = [r for r in rows if not (r["horizon"] == 12 and r["arm"] == "sft" and r["seed"] == 2)]  # a missing run
    lines = horizon_summary_lines(rows, "smollm2")
    assert len(lines) == 2 and all(SUMMARY_LINE.fullmatch(line) for line in lines), lines
    assert lines[0].startswith("experiment horizon=3 model=smollm2 seeds=3 test_episodes=2 teacher_f1=0.8500 ")
    assert "opd_f1=0.5500" in lines[0] and "opd_minus_kd_soft=0.1000 opd_minus_kd_soft_ci=0.0000,0.2000" in lines[0]
    assert "memopd_minus_kd=0.0000 memopd_minus_kd_ci=0.0000,0.0000" in lines[0]
    assert lines[1].startswith("experiment horizon=12 model=smollm2 seeds=2 ")  # the fewest seeds of any arm
    empty = horizon_summary_lines([{**r, "horizon": 6} for r in _episodes("teacher", (0,), [1.0])], "m")
    assert SUMMARY_LINE.fullmatch(empty[0]) and "seeds=0" in empty[0] and "opd_minus_kd_soft=na" in empty[0]


def test_combined_files_and_the_summary_command(tmp_path):
    cfg = smollm2_horizon_config()
    paths = Paths(tmp_path / "runs", tmp_path / "results" / "cpu_smollm2_horizon")
    for preset in ("h3", "h12"):
        scoped = paths.at(preset)
        one = _episodes("teacher", (0,), [0.9, 0.7]) + _episodes("student", (0,), [0.2, 0.2])
        for arm in SUMMARY_ARMS:
            one += _episodes(arm, (0, 1, 2), [0.5, 0.5])
        write_episodes(one, scoped.results / "episodes.csv")
        write_metrics([], scoped.metrics_csv)
    metrics, episodes = write_combined(cfg, paths.at("h3"))
    assert metrics == paths.metrics_csv and episodes.read_text().splitlines()[0] == ",".join(HORIZON_EPISODE_COLUMNS)
    assert {r["horizon"] for r in read_episodes(episodes)} == {3, 12}
    proc = subprocess.run(
        [sys.executable, "-m", "verl_memopd.experiment", "summary", str(metrics)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert [line.split()[1] for line in lines] == ["horizon=3", "horizon=12"]
    assert all(SUMMARY_LINE.fullmatch(line) for line in lines) and "model=smollm2" in lines[0]


def test_drift_rows_and_the_horizon_figure(tmp_path):
    from verl_memopd.experiment.horizon import mean_interval
    from verl_memopd.experiment.plot import plot_horizon
    from verl_memopd.experiment.report import collect_drift_rows, read_drift

    cfg = smollm2_horizon_config()
    paths = Paths(tmp_path / "runs", tmp_path / "results").at("h3")
    paths.evals().mkdir(parents=True)
    start = {"step": 0, "heldout_reverse_kl": 0.3, "heldout_reverse_kl_by_call": {"1": 0.4, "0": 0.2}}
    (paths.evals() / "heldout_kl_student.json").write_text(json.dumps(start))
    paths.arm("opd", 1).mkdir(parents=True)
    arm = {"step": 10, "heldout_reverse_kl": 0.1, "heldout_reverse_kl_by_call": {"0": 0.05, "1": 0.15}}
    (paths.arm("opd", 1) / "heldout_kl_step10.json").write_text(json.dumps(arm))
    rows = collect_drift_rows(cfg, paths)
    assert [(r["arm"], r["seed"], r["step"], r["call"], r["reverse_kl"]) for r in rows] == [
        ("student", 0, 0, 0, 0.2),
        ("student", 0, 0, 1, 0.4),
        ("opd", 1, 10, 0, 0.05),
        ("opd", 1, 10, 1, 0.15),
    ]
    episodes = [{**r, "horizon": 3} for r in _episodes("opd", (0, 1), [0.5, 0.7]) + _episodes("teacher", (0,), [1.0])]
    mean, lo, hi, seeds = mean_interval(episodes, "opd")
    assert (mean, seeds) == (pytest.approx(0.6), 2) and 0.5 <= lo <= mean <= hi <= 0.7
    out = plot_horizon(episodes, [{**r, "horizon": 3} for r in rows], tmp_path / "f1_vs_horizon.png")
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert plot_horizon([], [], tmp_path / "empty.png").is_file()  # nothing measured yet: labelled panels
    from verl_memopd.experiment.report import DRIFT_COLUMNS, _write

    _write(rows, tmp_path / "drift.csv", DRIFT_COLUMNS)
    assert read_drift(tmp_path / "drift.csv") == rows


def test_the_horizon_experiment_runs_every_arm_of_the_summary():
    cfg = smollm2_horizon_config()
    assert set(cfg.arms.arms) == set(SUMMARY_ARMS) and set(SFT_ARMS) <= set(ARMS)
    kd_soft = ARMS["kd_soft"]
    opd = ARMS["opd"]
    assert set(opd) < set(kd_soft)  # the twin: OPD's overrides, plus only what replay needs
    assert set(kd_soft) - set(opd) == {"algorithm.rollout_correction.bypass_mode=false", "data.shuffle=false"}


def test_the_replay_arm_composes_with_the_recipe():
    from verl_memopd.experiment.arms import check_arm_overrides

    check_arm_overrides(("kd_soft", "opd"))
    check_arm_overrides(("kd_soft", "opd"), critic_free=("kd_soft", "opd"))  # critic.enable, adv_estimator exist


def test_the_arms_without_a_ppo_term_run_without_a_critic(tmp_path):
    from dataclasses import replace

    from verl_memopd.experiment.arms import arm_command
    from verl_memopd.experiment.config import CRITIC_FREE_OVERRIDES, Paths, smollm2_config, smollm2_horizon_config

    cfg, paths = smollm2_horizon_config(), Paths(tmp_path / "runs", tmp_path / "results")
    assert cfg.arms.critic_free == ("opd", "kd_soft")
    for arm in ("opd", "kd_soft", "memopd"):  # (the flat arm's command needs its trained teacher)
        cmd = arm_command(cfg, paths, arm, 0, "S", "T")
        assert all((o in cmd) == (arm in cfg.arms.critic_free) for o in CRITIC_FREE_OVERRIDES), arm
    committed = smollm2_config()  # the 3-call study's committed OPD runs kept their critic: they stay reproducible
    assert not any(o in arm_command(committed, paths, "opd", 0, "S", "T") for o in CRITIC_FREE_OVERRIDES)
    with pytest.raises(ValueError, match=r"critic_free: \['memopd'\] are not arms of this config without a PPO"):
        replace(cfg.arms, critic_free=("opd", "memopd"))
    with pytest.raises(ValueError, match=r"critic_free: \['opd'\]"):
        replace(cfg.arms, arms=("memopd",), critic_free=("opd",))


def test_replay_and_oracle_rows_are_the_arms_episodes(tmp_path):
    import pandas as pd

    from verl_memopd.agent.replay import REPLAY_AGENT_NAME
    from verl_memopd.experiment.hf_agent import AgentCall, AgentEpisode
    from verl_memopd.experiment.kd import kd_episode_indices, oracle_rows, replay_rows
    from verl_memopd.fields import REPLAY

    rows = [{"prompt": [], "extra_info": {"index": i}, "agent_name": "memopd_memory_agent"} for i in range(2)]
    episodes = [
        AgentEpisode(i, (AgentCall(0, (1, 2), (3, 4), "u", "r"), AgentCall(1, (1, 5), (6,), "u", "r")), "a", 0.5)
        for i in range(2)
    ]
    out = replay_rows(rows, episodes)
    assert [r["agent_name"] for r in out] == [REPLAY_AGENT_NAME] * 2 and rows[0]["agent_name"] == "memopd_memory_agent"
    assert out[1]["extra_info"] == {
        "index": 1,
        REPLAY: [{"prompt_ids": [1, 2], "response_ids": [3, 4]}, {"prompt_ids": [1, 5], "response_ids": [6]}],
    }

    cfg = smollm2_horizon_config()
    paths = Paths(tmp_path / "runs", tmp_path / "results").at("h3")
    n = cfg.arms.steps * cfg.arms.episodes_per_step
    paths.sft_data.mkdir(parents=True)
    traces = [
        {"episode_id": f"train-{i}", "call": c, "messages": [{"role": "user", "content": f"{i}/{c}"}]}
        for i in range(cfg.n_train)
        for c in (1, 0)
    ]
    pd.DataFrame(traces).to_parquet(paths.sft_data / "train.parquet")
    oracle = oracle_rows(cfg, paths, seed=1)
    order = kd_episode_indices(cfg.n_train, 1, n)
    assert len(oracle) == 2 * n * cfg.arms.samples_per_episode
    assert [r["messages"][0]["content"] for r in oracle[:4]] == [f"{order[0]}/0", f"{order[0]}/1"] + [
        f"{order[1]}/0",
        f"{order[1]}/1",
    ]


@pytest.mark.slow
def test_an_eval_keeps_per_episode_scores_that_average_to_its_f1(tmp_path, tiny_models):
    """One real eval (verl validation, Ray + vLLM-CPU, the tiny student; ~2 min alone): its per-episode scores, read
    from verl's dump, are one per episode and average to the F1 verl logged."""
    from verl_memopd.experiment.config import smoke_config
    from verl_memopd.experiment.evaluate import eval_model

    data = tmp_path / "data"
    build = [sys.executable, "-m", "verl_memopd.tasks", "build", "--out", str(data), "--preset", "tiny", "--seed", "0"]
    sizes = ["--n-train", "4", "--n-val", "4", "--n-test", "4"]
    subprocess.run(build + sizes, check=True, capture_output=True, timeout=300)
    cfg = smoke_config()
    out = tmp_path / "eval" / "student_val.json"
    out.parent.mkdir()
    result = eval_model(tiny_models.student, data / "val.parquet", out, cfg, Paths(tmp_path, tmp_path / "results"), {})
    episodes = result["episodes"]
    assert len(episodes) == cfg.n_val and len({e["input_sha"] for e in episodes}) == cfg.n_val
    assert sum(e["f1"] for e in episodes) / len(episodes) == pytest.approx(result["f1"], abs=1e-6)
    assert json.loads(out.read_text())["episodes"] == episodes


def test_the_report_says_whether_a_rebuild_reproduces_the_committed_episodes():
    from verl_memopd.experiment.report import reproduction_lines

    def rows(arm, f1s):
        return [
            {"arm": arm, "seed": 0, "episode": i, "f1": f, "em": f, "input_sha": f"s{i}"} for i, f in enumerate(f1s)
        ]

    committed = rows("student", [0.5, 0.0, 1.0]) + rows("teacher", [1.0, 1.0, 0.0]) + rows("opd", [1.0, 0.0, 0.0])
    committed = [{**r, "seed": str(r["seed"]), "episode": str(r["episode"])} for r in committed]  # as read from csv
    here = rows("student", [0.5, 0.0, 1.0]) + rows("teacher", [1.0, 0.5, 0.0]) + rows("memopd", [1.0, 1.0, 1.0])
    assert reproduction_lines(here, committed) == [
        "student seed 0: the test episodes reproduce the committed episodes.csv (3 of 3 episodes equal; F1 0.5000 "
        "here, 0.5000 committed)",
        "teacher seed 0: the test episodes differ from the committed episodes.csv (2 of 3 episodes equal; F1 0.5000 "
        "here, 0.6667 committed)",
    ]  # only (arm, seed) pairs on both sides
