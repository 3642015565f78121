"""``python -m verl_memopd.bench step``: the commands it runs, which steps it times, its last line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from verl_memopd.bench import step, threads

LINE = re.compile(
    r"step model=(?P<model>\w+) fp32_s=(?P<fp32_s>\S+) bf16_s=(?P<bf16_s>\S+) speedup=(?P<speedup>\S+) "
    r"gen_speedup=(?P<gen>\S+) update_actor_speedup=(?P<actor>\S+) update_critic_speedup=(?P<critic>\S+) "
    r"actor_vs_plain=(?P<vs_plain>\S+) rce_pass_bf16=(?P<rce>[01]) probs_diff_max_bf16=(?P<diff>\S+)"
)


def test_step_1_is_never_timed_nor_the_audit_step_unless_alone():
    assert step.steady_steps(4, 4) == [2, 3]
    assert step.steady_steps(3, 3) == [2]
    assert step.steady_steps(2, 2) == [2]  # the audit step, the only steady one
    with pytest.raises(ValueError, match="--steps 1: need >= 2"):
        step.steady_steps(1, 1)


def test_the_two_runs_differ_only_in_the_profile(tmp_path):
    paths = (tmp_path / "s", tmp_path / "t", tmp_path / "d")
    fp32 = step.command("tiny", "fp32", 3, *paths, tmp_path / "run")
    bf16 = step.command("tiny", "bf16", 3, *paths, tmp_path / "run")
    assert [a for a in fp32 if a != "+profile=cpu"] == [a for a in bf16 if a != "+profile=cpu_bf16"]
    assert "+profile=cpu" in fp32 and "+profile=cpu_bf16" in bf16 and "+recipe=memopd" in bf16
    for seed in ("data.seed=0", "actor_rollout_ref.rollout.seed=0", "memopd.audit.every_n_steps=3"):
        assert seed in bf16


def _run(dtype: str, step_s: float, actor_s: float, diff: float, rce: float) -> step.StepRun:
    steps = {
        s: {
            "timing_s/step": step_s * (3 if s == 1 else 1),
            "timing_s/gen": 1.0,
            "timing_s/update_actor": actor_s,
            "timing_s/update_critic": 0.5,
            "training/rollout_probs_diff_max": diff * s / 3,
        }
        for s in (1, 2, 3)
    }
    steps[3]["memopd/audit/rce_pass"] = rce
    return step.StepRun(dtype, 0, 1.0, steps, step.steady_steps(3, 3))


def test_the_summary_line_has_the_issues_format_and_ratios():
    runs = {"fp32": _run("fp32", 4.0, 1.0, 1e-6, 1.0), "bf16": _run("bf16", 8.0, 4.0, 3e-3, 1.0)}
    line = step.summary_line("tiny", runs, 0.75)
    m = LINE.fullmatch(line)
    assert m, line
    assert float(m["fp32_s"]) == 4.0 and float(m["bf16_s"]) == 8.0 and float(m["speedup"]) == 0.5  # step 1 excluded
    assert float(m["actor"]) == 0.25 and float(m["gen"]) == 1.0 and float(m["vs_plain"]) == 0.75
    assert m["rce"] == "1" and float(m["diff"]) == pytest.approx(3e-3)  # max over the run's steps
    runs["bf16"] = _run("bf16", 8.0, 4.0, 3e-3, 0.0)
    assert LINE.fullmatch(step.summary_line("tiny", runs, 0.75))["rce"] == "0"


THREADS_LINE = re.compile(
    r"threads model=(?P<model>\w+) threads=(?P<n>\d+) one_s=(?P<one>\S+) many_s=(?P<many>\S+) speedup=(?P<speedup>\S+) "
    r"gen_speedup=(?P<gen>\S+) teacher_speedup=(?P<teacher>\S+) update_actor_speedup=(?P<actor>\S+) "
    r"update_critic_speedup=(?P<critic>\S+) probs_diff_max_many=(?P<diff>\S+)"
)


def test_the_threads_line_has_its_format_and_one_over_many_ratios():
    runs = {"one": _run("one", 6.0, 3.0, 1e-6, 1.0), "many": _run("many", 4.0, 1.5, 2e-6, 1.0)}
    m = THREADS_LINE.fullmatch(threads.summary_line("smollm2", 2, runs))
    assert m and m["model"] == "smollm2" and m["n"] == "2", m
    assert float(m["one"]) == 6.0 and float(m["many"]) == 4.0 and float(m["speedup"]) == 1.5  # step 1 excluded
    assert float(m["actor"]) == 2.0 and float(m["critic"]) == 1.0 and float(m["diff"]) == pytest.approx(2e-6)
    assert m["teacher"] == "nan"  # a stage verl did not time stays visible as nan, never a made-up ratio
    table = step.table(runs)
    assert "one_s" in table and "many_s" in table and "one/many" in table


def test_the_threads_bench_refuses_a_second_run_of_one_thread():
    with pytest.raises(SystemExit):
        threads.main(["--threads", "1"])


@pytest.mark.slow
def test_bench_step_on_the_tiny_model_ends_with_its_line(tmp_path):
    """The real thing, 2 steps of each dtype in verl (minutes): a table, then the one line, parsed."""
    proc = subprocess.run(
        [sys.executable, "-m", "verl_memopd.bench", "step", "--model", "tiny", "--steps", "2", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    m = LINE.fullmatch(lines[-1])
    assert m and m["model"] == "tiny", lines[-1]
    assert any(line.startswith("update_actor ") for line in lines)  # the per-stage table
    for key in ("fp32_s", "bf16_s", "speedup", "actor", "critic", "vs_plain", "diff"):
        value = float(m[key])
        assert value == value and value > 0, (key, lines[-1])  # measured, finite, positive
    assert m["rce"] == "1", proc.stdout[-3000:]  # the clean bf16 run passes its audit
