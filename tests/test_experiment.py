"""The CPU experiment (verl_memopd.experiment): parsing, the CSV/summary/plot contract, and the smoke run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from verl_memopd.experiment.config import (
    ExperimentConfig,
    Paths,
    SftConfig,
    SweepConfig,
    Variant,
    full_config,
    smoke_config,
)
from verl_memopd.experiment.launch import val_scores
from verl_memopd.experiment.launching import parse_steps
from verl_memopd.experiment.report import (
    COLUMNS,
    diagnostic_lines,
    read_metrics,
    sensitivity_lines,
    summary_lines,
    write_metrics,
)
from verl_memopd.experiment.sft import fp32_export, sft_losses

REPO = Path(__file__).resolve().parents[1]


def test_parse_steps_merges_lines_and_reads_validation():
    log = (
        "step:0 - val-core/memopd_memory/tiny/reward/mean@1:0.25 - val-aux/memopd_memory/tiny/f1/mean@1:0.25"
        " - val-aux/memopd_memory/tiny/em/mean@1:np.float64(0.125)\n"
        "Training Progress: 10%|#| 1/10 [00:02<00:18]step:1 - actor/memopd/reverse_kl:0.5 - timing_s/step:2.0\n"
        "step:1 - critic/score/mean:0.3 - note:text\n"
    )
    steps = parse_steps(log)
    assert steps[1] == {"actor/memopd/reverse_kl": 0.5, "timing_s/step": 2.0, "critic/score/mean": 0.3}
    assert val_scores(steps[0]) == {"f1": 0.25, "em": 0.125}
    diag = {
        "val-aux/memopd_memory/tiny/f1/mean@1": 0.5,
        "val-aux/memopd_memory/tiny/em/mean@1": 0.25,
        "val-aux/memopd_memory/tiny/memory_recall/mean@1": 0.75,
        "val-aux/memopd_memory/tiny/memory_truncated/mean@1": 0.0,
        "val-aux/memopd_memory/tiny/f1/std@1": 0.1,
    }
    assert val_scores(diag) == {"f1": 0.5, "em": 0.25, "memory_recall": 0.75, "memory_truncated": 0.0}
    assert val_scores(steps[1]) is None
    with pytest.raises(KeyError, match="em"):
        val_scores({"val-aux/memopd_memory/tiny/f1/mean@1": 0.1})


def test_sft_losses_read_train_and_val_loss():
    log = (
        "step:1 - perf/x:1 - train/loss:7.3 - train/lr:0.001\n"
        "Epoch 1/9:   2%|  | 1/64 [00:06<06:54,  6.57s/it]step:2 - train/loss:6.8 - train/grad_norm:4.1\n"
        "step:2 - val/loss:6.6\n"
    )
    assert sft_losses(log) == {1: {"train/loss": 7.3}, 2: {"train/loss": 6.8, "val/loss": 6.6}}


def test_fp32_export_fixes_the_config_dtype(tmp_path):
    (tmp_path / "config.json").write_text('{"dtype": "bfloat16", "hidden_size": 8}')
    fp32_export(tmp_path)
    assert '"dtype": "float32"' in (tmp_path / "config.json").read_text()
    with pytest.raises(FileNotFoundError, match="hf_model"):
        fp32_export(tmp_path / "missing")


def test_configs_are_consistent():
    for cfg in (full_config(), smoke_config()):
        assert isinstance(cfg, ExperimentConfig)
    assert len(full_config().arms.seeds) == 3 and full_config().arms.arms == ("memopd", "flat", "ppo")
    with pytest.raises(ValueError, match="multiple of save_every"):
        SftConfig(steps=10, batch=4, lr=1e-3, save_every=3)

    with pytest.raises(ValueError, match="student_eval_steps"):
        replace(full_config(), student_eval_steps=(75,))


def test_student_choice_evaluates_latest_first_and_stops_in_the_band(tmp_path, monkeypatch):
    from dataclasses import replace

    from verl_memopd.experiment import evaluate

    f1 = {100: 0.1, 200: 0.3, 300: 0.6}
    asked = []

    def fake_eval(cfg, paths, role, step, split):
        asked.append((role, step, split))
        return {"f1": f1[step]}

    monkeypatch.setattr(evaluate, "eval_sft_checkpoint", fake_eval)
    cfg, paths = full_config(), Paths(tmp_path / "run", tmp_path / "res")
    assert evaluate.chosen_student(cfg, paths) == 200  # 300 is above the band (0.05, 0.5)
    assert asked == [("student", 300, "val"), ("student", 200, "val")]  # 100 could not be chosen: not evaluated
    f1[200] = f1[100] = 0.01
    with pytest.raises(RuntimeError, match=r"no checkpoint with val F1 in \[0.05, 0.5\]: \{300: 0.6, 200: 0.01, 100"):
        evaluate.chosen_student(cfg, paths)
    assert evaluate.chosen_student(replace(cfg, student_f1_band=None), paths) == cfg.student_sft.steps


def test_arms_validate_checkpoint_and_audit_on_their_own_schedules(tmp_path):
    from dataclasses import replace

    from verl_memopd.experiment.arms import arm_command
    from verl_memopd.experiment.config import ArmsConfig, smollm2_horizon_config

    cfg, paths = smollm2_horizon_config(), Paths(tmp_path / "runs", tmp_path / "results")
    assert (cfg.arms.val_every, cfg.arms.checkpoint_every, cfg.arms.val_before_train) == (10, 2, False)
    assert list(cfg.arms.val_steps()) == [10] and list(cfg.arms.checkpoint_steps()) == [2, 4, 6, 8, 10]
    cmd = arm_command(cfg, paths, "opd", 0, "S", "T")
    for item in ("trainer.test_freq=10", "trainer.save_freq=2", "trainer.val_before_train=false"):
        assert item in cmd
    assert "memopd.audit.every_n_steps=10" in cmd  # the audit runs with the validation, not at every checkpoint
    default = replace(cfg.arms, save_every=None, val_before_train=True)
    assert default.checkpoint_every == default.val_every  # unset: checkpoints at the val steps, as before
    assert "trainer.val_before_train=true" in arm_command(replace(cfg, arms=default), paths, "opd", 0, "S", "T")
    with pytest.raises(ValueError, match="multiple of checkpoint_every=3"):
        replace(cfg.arms, save_every=3)
    with pytest.raises(ValueError, match="multiple of val_every=0"):
        ArmsConfig(steps=10, val_every=0, episodes_per_step=8, samples_per_episode=1, lr=1e-5, seeds=(0,))


def test_sweep_runs_change_one_setting_of_the_matched_arm(tmp_path):
    from verl_memopd.experiment.arms import arm_command

    cfg, paths = full_config(), Paths(tmp_path / "runs", tmp_path / "results")
    sweep = SweepConfig(
        variants=(
            Variant("lr3e-5", lr=3e-5),
            Variant("lambda0.1", overrides=("memopd.distill.coef=0.1",), only=("memopd",)),
        ),
        arms=("memopd", "ppo"),
    )
    assert [(v.name, a) for v, a in sweep.runs()] == [("lr3e-5", "memopd"), ("lr3e-5", "ppo"), ("lambda0.1", "memopd")]
    base = arm_command(cfg, paths, "memopd", 0, "S", "T")
    lr = arm_command(cfg, paths, "memopd", 0, "S", "T", sweep.variants[0])
    lam = arm_command(cfg, paths, "memopd", 0, "S", "T", sweep.variants[1])
    run_dir = paths.sweep_run("lr3e-5", "memopd", 0)
    changed = {
        "actor_rollout_ref.actor.optim.lr=3e-05",
        "critic.optim.lr=3e-05",
        f"trainer.default_local_dir={run_dir / 'checkpoints'}",
        f"trainer.experiment_name={run_dir.name}",
    }
    assert set(lr) - set(base) == changed and len(lr) == len(base)
    assert (
        lam[:-1]
        == [
            a.replace(str(paths.arm("memopd", 0)), str(paths.sweep_run("lambda0.1", "memopd", 0))).replace(
                "experiment_name=memopd_seed0", "experiment_name=lambda0.1_memopd_seed0"
            )
            for a in base
        ]
        and lam[-1] == "memopd.distill.coef=0.1"
    )
    with pytest.raises(ValueError, match="unique"):
        SweepConfig(variants=(Variant("a"), Variant("a")), arms=("ppo",))
    with pytest.raises(ValueError, match="valid"):
        SweepConfig(variants=(Variant("a", only=("memopdd",)),), arms=("ppo",))
    assert smoke_config().sweep is None and full_config().sweep.runs()


def _rows():
    rows = [
        dict(
            arm="teacher",
            seed=0,
            step=2000,
            split=s,
            f1=f,
            em=0.5,
            reverse_kl=None,
            teacher_aligned_vs_flat_kl=None,
            wall_s=100.0,
        )
        for s, f in (("val", 0.8), ("test", 0.82))
    ]
    rows += [
        dict(
            arm="student",
            seed=0,
            step=200,
            split=s,
            f1=f,
            em=0.0,
            reverse_kl=None,
            teacher_aligned_vs_flat_kl=None,
            wall_s=50.0,
        )
        for s, f in (("val", 0.2), ("test", 0.21))
    ]
    for arm, base in (("memopd", 0.5), ("flat", 0.4), ("ppo", 0.25)):
        for seed in (0, 1, 2):
            for step in (0, 10):
                rows.append(
                    dict(
                        arm=arm,
                        seed=seed,
                        step=step,
                        split="val",
                        f1=base + 0.01 * seed * step / 10,
                        em=0.1,
                        reverse_kl=None,
                        teacher_aligned_vs_flat_kl=None,
                        wall_s=float(step),
                    )
                )
                if step:
                    rows.append(
                        dict(
                            arm=arm,
                            seed=seed,
                            step=step,
                            split="train",
                            f1=0.3,
                            em=None,
                            reverse_kl=None if arm == "ppo" else 0.1 * (seed + 1),
                            teacher_aligned_vs_flat_kl=0.05,
                            wall_s=float(step),
                        )
                    )
            rows.append(
                dict(
                    arm=arm,
                    seed=seed,
                    step=10,
                    split="test",
                    f1=base + 0.01 * seed,
                    em=0.1,
                    reverse_kl=None,
                    teacher_aligned_vs_flat_kl=None,
                    wall_s=600.0,
                )
            )
    return rows


def test_csv_round_trip_and_summary_line(tmp_path):
    path = tmp_path / "metrics.csv"
    write_metrics(_rows(), path)
    assert path.read_text().splitlines()[0] == ",".join(COLUMNS)
    rows = read_metrics(path)
    assert len(rows) == len(_rows())
    lines = summary_lines(rows, "tiny")
    assert lines[-1] == (
        "experiment model=tiny seeds=3 steps=10 teacher_f1=0.8200 start_f1=0.2100 memopd_f1=0.5100 "
        "flat_f1=0.4100 ppo_f1=0.2600 kd_f1=na opd_f1=na"
    )
    assert any(line.startswith("memopd") and "0.0100" in line for line in lines)  # std over seeds


def test_report_keeps_committed_rows_of_runs_this_folder_lacks(tmp_path):
    """A resumed run on a fresh machine (or a subset of arms) must not drop what earlier machines committed."""
    from verl_memopd.experiment.report import collect_rows

    cfg, paths = full_config(), Paths(tmp_path / "runs", tmp_path / "results")
    committed = [r for r in _rows() if r["arm"] in ("memopd", "flat")]
    write_metrics(committed, paths.metrics_csv)
    run_dir = paths.arm("memopd", 0)  # redone here: its rows come from this folder, not from the CSV
    run_dir.mkdir(parents=True)
    (run_dir / "test.json").write_text(json.dumps({"step": 10, "f1": 0.9, "em": 0.8}))
    rows = collect_rows(replace(cfg, arms=replace(cfg.arms, arms=("memopd",), seeds=(0,))), paths)
    assert [(r["split"], r["f1"]) for r in rows if (r["arm"], r["seed"]) == ("memopd", 0)] == [("test", 0.9)]
    kept = [r for r in rows if (r["arm"], r["seed"]) != ("memopd", 0)]
    assert len(kept) == len([r for r in committed if (r["arm"], r["seed"]) != ("memopd", 0)]) > 0
    assert {r["arm"] for r in kept} == {"memopd", "flat"}
    from verl_memopd.experiment.report import _experiment_meta

    (paths.results / "experiment.json").write_text(
        json.dumps({"arms": ["memopd", "flat"], "seeds": [0, 1, 2], "runs": {"flat_seed1": {"attempts": 1}}})
    )
    (run_dir / "DONE.json").write_text(json.dumps({"wall_s": 1.0, "final_actor": "x", "attempts": 2}))
    meta = _experiment_meta(replace(cfg, arms=replace(cfg.arms, arms=("memopd",), seeds=(0,))), paths)
    assert (meta["arms"], meta["seeds"]) == (["memopd", "flat"], [0, 1, 2])
    assert meta["runs"] == {"flat_seed1": {"attempts": 1}, "memopd_seed0": {"wall_s": 1.0, "attempts": 2}}


def test_diagnose_names_the_teacher_the_start_and_finished_arms(tmp_path):
    from verl_memopd.experiment.evaluate import diagnose_names

    cfg, paths = full_config(), Paths(tmp_path / "runs", tmp_path / "results")
    for arm in ("memopd", "ppo"):
        paths.arm(arm, 0).mkdir(parents=True)
    (paths.arm("ppo", 0) / "DONE.json").write_text("{}")  # memopd seed 0 still running: left out
    assert diagnose_names(cfg, paths) == ["teacher", "student", "ppo_seed0"]


def test_sensitivity_table_puts_each_variant_under_its_base_arm():
    sweep = [
        dict(r, arm=f"{r['arm']}@lr1e-5", f1=r["f1"] + 0.1)
        for r in _rows()
        if r["arm"] in ("memopd", "ppo") and r["seed"] == 0
    ]
    lines = sensitivity_lines(sweep, _rows(), seed=0)
    assert lines[0].split() == ["run", "(seed", "0)", "val", "F1", "@0", "val", "F1", "@10"]
    assert [line.split()[0] for line in lines[1:]] == [
        "flat@arms",
        "memopd@arms",
        "memopd@lr1e-5",
        "ppo@arms",
        "ppo@lr1e-5",
    ]
    assert lines[3].split()[1:] == ["0.6000", "0.6000"]


def test_diagnostic_table_has_a_line_per_model():
    lines = diagnostic_lines(
        [
            {"role": "teacher", "f1": 0.63, "em": 0.5, "memory_recall": 0.8, "memory_truncated": 0.1},
            {"role": "memopd_seed0", "f1": 0.2, "em": 0.1, "memory_recall": 0.3, "memory_truncated": 0.6},
        ]
    )
    assert [line.split() for line in lines[1:]] == [
        ["teacher", "0.6300", "0.5000", "0.8000", "0.1000"],
        ["memopd_seed0", "0.2000", "0.1000", "0.3000", "0.6000"],
    ]


def test_score_calls_counts_exact_replies_per_call():
    from verl_memopd.experiment.calls import score_calls

    def chat(call, reply):
        return call, [
            {"role": "user", "content": "q"},
            {"role": "user", "content": f"call {call}"},
            {"role": "assistant", "content": reply},
        ]

    right = {"call 0": "Mara Tovin lives in Orin.", "call 1": "1: Orin\n2: 1993"}
    rows = [
        chat(0, "Mara Tovin lives in Orin."),
        chat(1, "1: Orin\n2: 1993"),
        chat(1, "1: Orla\n2: 1993"),
        chat(0, "(empty)"),
    ]
    scores = score_calls(rows, lambda messages: right[messages[-1]["content"]] + "\n")
    assert scores == [
        {"call": 0, "exact": 1, "n": 2, "lines": 1, "lines_n": 2},
        {"call": 1, "exact": 1, "n": 2, "lines": 3, "lines_n": 4},
    ]
    with pytest.raises(ValueError, match="call 3: the last message must be the oracle's reply"):
        score_calls([(3, [{"role": "user", "content": "q"}])], lambda messages: "")


def test_call_accuracy_runs_the_model_on_each_trace_and_caches(tmp_path, tiny_models):
    import pandas as pd

    from verl_memopd.experiment.calls import call_accuracy

    messages = [
        {"role": "user", "content": "Questions: 1. Where does Mara Tovin live?"},
        {"role": "user", "content": "Memory:\n(empty)\n\nWrite the updated memory."},
        {"role": "assistant", "content": "Mara Tovin lives in Orin."},
    ]
    pd.DataFrame({"episode_id": ["val-0"] * 3, "call": [0, 1, 1], "messages": [messages] * 3}).to_parquet(
        tmp_path / "val.parquet"
    )
    out = tmp_path / "student_calls.json"
    scores = call_accuracy(tiny_models.student, tmp_path / "val.parquet", out, max_new_tokens=4)
    assert [(c["call"], c["n"], c["lines_n"]) for c in scores] == [(0, 1, 1), (1, 2, 2)]
    assert all(c["exact"] == 0 for c in scores)  # a random model does not write the reply in 4 tokens
    assert call_accuracy(tmp_path / "no-model", tmp_path / "val.parquet", out, max_new_tokens=4) == scores


def test_call_accuracy_table_has_a_column_per_call():
    from verl_memopd.experiment.report import call_accuracy_lines

    lines = call_accuracy_lines(
        {
            "teacher": [
                {"call": 0, "exact": 3, "n": 4, "lines": 5, "lines_n": 5},
                {"call": 1, "exact": 1, "n": 4, "lines": 2, "lines_n": 8},
            ],
            "student": [{"call": 1, "exact": 0, "n": 4, "lines": 0, "lines_n": 8}],
        }
    )
    assert lines[0].split()[-6:] == ["call", "0", "exact/lines", "call", "1", "exact/lines"]
    assert [line.split() for line in lines[1:]] == [
        ["teacher", "0.7500/1.0000", "0.2500/0.2500"],
        ["student", "na", "0.0000/0.0000"],
    ]


def test_a_finished_sft_run_is_extended_not_redone(tmp_path, monkeypatch):
    import json

    from verl_memopd.experiment import sft

    run_dir = tmp_path / "teacher"
    ran = []

    def fake_verl(cmd, log, env, timeout_s):  # what verl's SFT trainer leaves: checkpoints and a step log
        steps = int(next(a for a in cmd if a.startswith("trainer.total_training_steps=")).split("=")[1])
        ran.append(steps)
        (run_dir / "checkpoints" / f"global_step_{steps}" / "huggingface").mkdir(parents=True)
        (run_dir / "checkpoints" / f"global_step_{steps}" / "huggingface" / "config.json").write_text("{}")
        (run_dir / "checkpoints" / f"global_step_{steps}" / "huggingface" / "model.safetensors").write_bytes(b"w")
        with open(log, "a") as f:
            f.write(f"step:{steps} - train/loss:{1 / steps}\n")
        return 10.0

    monkeypatch.setattr(sft, "run_logged", fake_verl)
    first = SftConfig(steps=4, batch=2, lr=1e-3, save_every=2)
    sft.run_sft(tmp_path / "model", tmp_path / "data", run_dir, first, "t", {})
    sft.run_sft(
        tmp_path / "model", tmp_path / "data", run_dir, SftConfig(steps=8, batch=2, lr=1e-3, save_every=2), "t", {}
    )
    done = sft.finished_sft(run_dir)
    assert ran == [4, 8] and done["steps"] == 8 and done["wall_s"] == 20.0
    assert done["extends"]["steps"] == 4 and set(done["losses"]) == {"4", "8"}
    assert json.loads((run_dir / "checkpoints/global_step_8/huggingface/config.json").read_text())["dtype"] == "float32"
    with pytest.raises(ValueError, match="finished 8 steps, more than the 4 asked for"):
        sft.run_sft(tmp_path / "model", tmp_path / "data", run_dir, first, "t", {})


def test_the_results_name_each_sft_model_by_its_weights(tmp_path, capsys):
    import hashlib

    from verl_memopd.experiment import sft

    hf = tmp_path / "hf"
    hf.mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        sft.weights_sha256(hf)
    (hf / "model-00002.safetensors").write_bytes(b"BB")
    (hf / "model-00001.safetensors").write_bytes(b"A")
    assert sft.weights_sha256(hf) == hashlib.sha256(b"ABB").hexdigest()  # every shard, in name order
    results = tmp_path / "results"
    done = {"steps": 300, "hf": str(hf), "wall_s": 6637.04, "losses": {"300": {"train/loss": 0.05}}}
    assert sft.record_sft_model(results, "teacher", done)  # no weights_sha256 in an older DONE.json: computed
    assert sft.record_sft_model(results, "teacher", done)  # the same model again: one row
    assert sft.record_sft_model(results, "student", {**done, "steps": 20, "weights_sha256": "s" * 64})
    rebuilt = {**done, "weights_sha256": "f" * 64}
    assert not sft.record_sft_model(results, "teacher", rebuilt)  # another model, same role and steps: said
    assert "this build (sha256 ffffffffffff) is NOT the model of" in capsys.readouterr().out
    rows = (results / "sft_models.csv").read_text().splitlines()
    assert rows[0] == ",".join(sft.SFT_MODEL_COLUMNS)
    assert rows[1:] == [
        f"teacher,300,{hashlib.sha256(b'ABB').hexdigest()},0.05,6637.0",
        f"student,20,{'s' * 64},,6637.0",  # no train loss logged at its step
        f"teacher,300,{'f' * 64},0.05,6637.0",  # both builds kept
    ]


def test_a_longer_finished_sft_run_is_not_taken_for_a_shorter_config(tmp_path):
    import json

    from verl_memopd.experiment.pipeline import _stage_sft

    cfg, paths = full_config(), Paths(tmp_path / "runs", tmp_path / "results")
    paths.sft("teacher").mkdir(parents=True)
    longer = cfg.teacher_sft.steps + cfg.teacher_sft.save_every
    (paths.sft("teacher") / "DONE.json").write_text(json.dumps({"steps": longer, "hf": "x", "wall_s": 1.0}))
    with pytest.raises(
        ValueError, match=f"sft_teacher: .* finished {longer} steps, more than the {cfg.teacher_sft.steps} asked for"
    ):
        _stage_sft("teacher", cfg, paths)


def test_summary_of_a_partial_run_says_na(tmp_path):
    path = tmp_path / "metrics.csv"
    write_metrics([r for r in _rows() if r["arm"] in ("teacher", "student")], path)
    assert summary_lines(read_metrics(path))[-1] == (
        "experiment model=na seeds=0 steps=0 teacher_f1=0.8200 start_f1=0.2100 memopd_f1=na flat_f1=na ppo_f1=na "
        "kd_f1=na opd_f1=na"
    )


def test_summary_cli_prints_the_line(tmp_path):
    path = tmp_path / "metrics.csv"
    write_metrics(_rows(), path)
    (tmp_path / "experiment.json").write_text(json.dumps({"base_model": "smollm2"}))
    out = subprocess.run(
        [sys.executable, "-m", "verl_memopd.experiment", "summary", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip().splitlines()[-1].startswith("experiment model=smollm2 seeds=3 steps=10 teacher_f1=0.8200")


def test_summary_markdown_is_the_readme_table(tmp_path):
    """Per arm: test F1 mean ± std with each seed's value, final val F1, held-out KL (start: step 0), wall."""
    walls = {"memopd": lambda seed: 1000.0 + 100 * seed, "ppo": lambda seed: None}  # the test rows' (DONE.json's)
    rows = [
        dict(r, wall_s=walls[r["arm"]](r["seed"])) if r["split"] == "test" and r["arm"] in walls else r for r in _rows()
    ]
    rows += [
        dict(
            arm=arm,
            seed=seed,
            step=step,
            split="heldout",
            f1=None,
            em=None,
            reverse_kl=0.3 if step == 0 else 0.1 + 0.01 * seed,
            teacher_aligned_vs_flat_kl=None,
            wall_s=None,
        )
        for arm in ("memopd", "flat", "ppo")
        for seed in (0, 1, 2)
        for step in (0, 10)
    ]
    path = tmp_path / "metrics.csv"
    write_metrics(rows, path)
    out = (
        subprocess.run(
            [sys.executable, "-m", "verl_memopd.experiment", "summary", str(path), "--markdown"],
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .splitlines()
    )
    assert out[0] == (
        "| arm | seeds | test F1, mean ± std (each seed) | val F1 at step 10 | held-out KL at step 10 "
        "(start 0.300) | wall / seed |"
    )
    assert out[2] == (
        "| MemOPD | 3 | 0.510 ± 0.010 (seeds 0, 1, 2: 0.500 / 0.510 / 0.520) | 0.510 ± 0.010 | "
        "0.110 ± 0.010 | 1,100 s |"
    )
    assert out[4].startswith("| PPO alone (`memopd.distill.coef=0`) | 3 | 0.260 ± 0.010") and out[4].endswith("| na |")
    assert len(out) == 5  # no row for the arms without a test row (kd, opd)


def test_plot_reference_is_the_latest_tested_checkpoint():
    from verl_memopd.experiment.plot import _reference

    rows = [
        {"arm": "teacher", "step": step, "split": split, "f1": f1}
        for step, split, f1 in (
            (2000, "val", 0.63),
            (2000, "test", 0.62),
            (4000, "val", 0.72),
            (4000, "test", 0.71),
            (1250, "val", 0.66),
        )
    ]
    assert _reference(rows, "teacher") == 0.72 and _reference(rows, "student") is None


def test_plot_writes_a_png(tmp_path):
    from verl_memopd.experiment.plot import band, plot_metrics

    out = plot_metrics(_rows(), tmp_path / "f1.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    steps, mean, lo, hi = band(_rows(), "memopd", "train", "reverse_kl")
    assert steps == [10] and mean == [pytest.approx(0.2)] and (lo, hi) == ([0.1], [pytest.approx(0.3)])
    plot_metrics([], tmp_path / "empty.png")  # a run with nothing measured still draws (labelled panels)


@pytest.mark.slow
def test_experiment_smoke_writes_csv_and_png(tmp_path):
    """EXPERIMENT_SMOKE=1 end to end: 2 SFT steps each (verl SFT trainer), one step of each arm code path (one seed;
    memopd on-policy, kd_soft replaying the teacher's trajectories, kd by verl's SFT trainer; the arms' own step-0
    validation is the start), metrics.csv, f1.png and the summary line (~11 min alone)."""
    env = {**os.environ, "EXPERIMENT_SMOKE": "1", "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    proc = subprocess.run(
        [
            "bash",
            str(REPO / "recipes" / "experiment_cpu.sh"),
            "--root",
            str(tmp_path / "runs"),
            "--results",
            str(tmp_path / "results"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    wall = time.monotonic() - start
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = read_metrics(tmp_path / "results" / "metrics.csv")
    for arm in ("memopd", "kd_soft"):
        assert [r["step"] for r in rows if r["arm"] == arm and r["split"] == "train"] == [1], arm
        assert {r["step"] for r in rows if r["arm"] == arm and r["split"] == "val"} == {0, 1}, arm
    assert all(
        r["reverse_kl"] is not None and r["reverse_kl"] > 0
        for r in rows
        if r["arm"] in ("memopd", "kd_soft") and r["split"] == "train"
    )
    assert [r["step"] for r in rows if r["arm"] == "kd" and r["split"] == "val"] == [1]  # SFT on teacher trajectories
    # held-out reverse KL: the start (step 0) and the saved step
    for arm in ("memopd", "kd_soft", "kd"):
        kls = {r["step"]: r["reverse_kl"] for r in rows if r["arm"] == arm and r["split"] == "heldout"}
        assert set(kls) == {0, 1} and all(v > 0 for v in kls.values()), (arm, kls)
    assert len({r["reverse_kl"] for r in rows if r["split"] == "heldout" and r["step"] == 0}) == 1  # one start
    handoff = (tmp_path / "results" / "handoff.csv").read_text().splitlines()
    assert handoff[0] == "teacher_from_call,val_f1" and len(handoff) > 3
    assert not [
        r for r in rows if r["arm"] in ("student", "teacher")
    ]  # smoke: no SFT evals, the arms' step 0 is the start
    runs = json.loads((tmp_path / "results" / "experiment.json").read_text())["runs"]
    assert sorted(runs) == ["kd_seed0", "kd_soft_seed0", "memopd_seed0"]
    assert all(r["attempts"] == 1 for r in runs.values()), runs
    assert all(r["resumed_from_step"] == 0 for name, r in runs.items() if name != "kd_seed0"), runs
    assert (tmp_path / "results" / "f1.png").read_bytes()[:4] == b"\x89PNG"
    assert any(line.startswith("experiment model=tiny seeds=0 steps=0 ") for line in proc.stdout.splitlines())
    print(f"experiment smoke: wall {wall:.0f}s")


def test_heavy_commands_are_bounded_after_the_lock(tmp_path, monkeypatch):
    from verl_memopd.experiment.runner import heavy, heavy_wall_s, run_logged

    monkeypatch.setenv("MEMOPD_HEAVY_LOCK", str(tmp_path / "heavy.lock"))
    log = tmp_path / "run.log"
    run_logged(heavy(["echo", "hello"], 30), log, dict(os.environ), None)
    assert "hello" in log.read_text() and 0 <= heavy_wall_s(log) < 30
    with pytest.raises(RuntimeError, match="exit status 124"):  # coreutils timeout's status
        run_logged(heavy(["sleep", "30"], 1), log, dict(os.environ), None)


def test_done_record_says_how_many_attempts_and_where_the_last_resumed(tmp_path, monkeypatch):
    from verl_memopd.experiment.arms import _done
    from verl_memopd.experiment.runner import attempts, heavy, run_logged

    monkeypatch.delenv("MEMOPD_HEAVY_LOCK", raising=False)
    log = tmp_path / "main_ppo.log"
    run_logged(
        heavy(["printf", "===== a banner of the command's own =====\\nTraining from scratch\\n"], 30),
        log,
        dict(os.environ),
        None,
    )
    assert attempts(log) == 1 and _done(tmp_path, tmp_path)["resumed_from_step"] == 0
    with pytest.raises(RuntimeError):  # a first attempt that died after its step-5 checkpoint
        run_logged(heavy(["bash", "-c", "echo Training from scratch; exit 3"], 30), log, dict(os.environ), None)
    run_logged(
        heavy(["echo", "Load from checkpoint folder: /x/checkpoints/global_step_5"], 30), log, dict(os.environ), None
    )
    done = _done(tmp_path, tmp_path)
    assert done["attempts"] == 3 and done["resumed_from_step"] == 5 and 0 <= done["wall_s"] < 30
    run_logged(heavy(["echo", "Training from scratch"], 30), log, dict(os.environ), None)  # only the last counts
    assert _done(tmp_path, tmp_path)["resumed_from_step"] == 0


@pytest.mark.parametrize(
    "keep, files, kept",
    [
        (
            "actor/huggingface",
            [
                "global_step_5/actor/huggingface/config.json",
                "global_step_5/actor/model_rank_0.pt",
                "global_step_5/critic/model_rank_0.pt",
                "global_step_5/data.pt",
                "latest.txt",
            ],
            ["global_step_5/actor/huggingface/config.json", "global_step_5/data.pt", "latest.txt"],
        ),
        (
            "huggingface",
            ["global_step_5/huggingface/config.json", "global_step_5/model_rank_0.pt", "global_step_5/optim.pt"],
            ["global_step_5/huggingface/config.json"],
        ),
    ],
)
def test_prune_keeps_only_the_hugging_face_exports(tmp_path, keep, files, kept):
    from verl_memopd.experiment.launching import prune_checkpoints

    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("x")
    prune_checkpoints(tmp_path, keep)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == kept


def test_horizon_experiment_scopes_each_preset_and_shares_models_and_sft(tmp_path):
    from verl_memopd.experiment.config import smollm2_horizon_config

    cfg = smollm2_horizon_config()
    assert cfg.presets == ("h3", "h6", "h12")
    with pytest.raises(ValueError, match="presets"):
        replace(cfg, presets=("h3", "h3"))
    paths = Paths(tmp_path / "runs", tmp_path / "results")
    h12 = paths.at("h12")
    assert h12.data == paths.data / "h12" and h12.evals() == paths.evals() / "h12"
    assert h12.arm("opd", 1) == paths.root / "arms" / "h12" / "opd_seed1" and h12.results == paths.results / "h12"
    assert h12.models == paths.models and h12.sft("teacher") == paths.sft("teacher")


def test_pipeline_runs_per_preset_stages_in_the_asked_order_and_shared_ones_once(tmp_path, monkeypatch):
    from verl_memopd.experiment import pipeline
    from verl_memopd.experiment.config import smollm2_horizon_config

    cfg, paths = smollm2_horizon_config(), Paths(tmp_path / "runs", tmp_path / "results")
    assert [p.scope for p in pipeline._scopes(cfg, paths, "eval", ("h12", "h3"))] == ["h12", "h3"]
    assert [p.scope for p in pipeline._scopes(cfg, paths, "sft_teacher", ("h12",))] == [None]
    for bad in (("h9",), ("h3", "h3")):
        with pytest.raises(ValueError, match="presets"):
            pipeline.run_pipeline(cfg, paths, "eval", None, bad)


def test_mixed_traces_keep_every_row_and_name_episodes_by_preset(tmp_path):
    import pandas as pd

    from verl_memopd.experiment.sft import mix_traces

    for name, n in (("h3", 2), ("h6", 3)):
        (tmp_path / name).mkdir()
        for split in ("train", "val"):
            pd.DataFrame({"episode_id": list(range(n)), "messages": [f"{name}-{i}" for i in range(n)]}).to_parquet(
                tmp_path / name / f"{split}.parquet"
            )
    mix_traces([tmp_path / "h3", tmp_path / "h6"], ["h3", "h6"], tmp_path / "mixed")
    mixed = pd.read_parquet(tmp_path / "mixed" / "train.parquet")
    assert list(mixed["episode_id"]) == ["h3/0", "h3/1", "h6/0", "h6/1", "h6/2"]
    assert list(mixed["messages"]) == ["h3-0", "h3-1", "h6-0", "h6-1", "h6-2"]
    assert len(pd.read_parquet(tmp_path / "mixed" / "val.parquet")) == 5


def test_handoff_saves_each_switch_point_and_resumes_after_a_stop(tmp_path, monkeypatch):
    import pandas as pd

    from verl_memopd.experiment import heldout, hf_agent

    paths = Paths(tmp_path / "runs", tmp_path / "results")
    paths.data.mkdir(parents=True)
    pd.DataFrame({"extra_info": [{"chunks": ["a", "b"]}]}).to_parquet(paths.data / "val.parquet")
    paths.evals().mkdir(parents=True)
    ran: list[int] = []
    stop_after = [2]

    class Stopped(Exception):
        pass

    def fake_handoff(rows, student, teacher, tokenizer, memory_tokens, answer_tokens, switches):
        if len(ran) == stop_after[0]:
            raise Stopped  # the run is stopped after two switch points
        ran.extend(switches)
        return {t: t / 10 for t in switches}

    monkeypatch.setattr(hf_agent, "handoff_f1", fake_handoff)
    monkeypatch.setattr(hf_agent, "load_model", lambda path: (None, None))
    with pytest.raises(Stopped):
        heldout.teacher_handoff(full_config(), paths, Path("s"), Path("t"))
    assert json.loads((paths.evals() / "handoff.partial.json").read_text()) == {"0": 0.0, "1": 0.1}
    ran.clear()
    stop_after[0] = -1  # the resumed run is not stopped
    result = heldout.teacher_handoff(full_config(), paths, Path("s"), Path("t"))
    assert ran == [2, 3] and result["f1_by_switch"] == {"0": 0.0, "1": 0.1, "2": 0.2, "3": 0.3}
    assert not (paths.evals() / "handoff.partial.json").exists()


def test_sft_runs_validate_every_val_every_steps(tmp_path):
    from verl_memopd.experiment.config import smollm2_config, smollm2_horizon_config
    from verl_memopd.experiment.sft import sft_command

    def freqs(cfg: SftConfig) -> tuple[str, str]:
        cmd = sft_command(tmp_path / "m", tmp_path / "d", tmp_path / "r", cfg, "t")
        return tuple(next(a for a in cmd if a.startswith(k)) for k in ("trainer.save_freq=", "trainer.test_freq="))

    horizon, three_calls = smollm2_horizon_config(), smollm2_config()
    assert freqs(horizon.student_sft) == ("trainer.save_freq=5", "trainer.test_freq=20")
    assert freqs(horizon.teacher_sft) == ("trainer.save_freq=50", "trainer.test_freq=150")
    assert freqs(three_calls.student_sft) == ("trainer.save_freq=5", "trainer.test_freq=5")  # unset: save_every
    with pytest.raises(ValueError, match="steps=20 must be a multiple of val_every=15"):
        replace(horizon.student_sft, val_every=15)
