"""verl_memopd.experiment.launching: verl's console step lines, the run environments, the time bound (shared by the GPU
check, the experiment and the tests' launcher)."""

from __future__ import annotations

import math
import sys

import pytest

from verl_memopd.experiment.launching import cpu_env, offline_env, parse_steps, run_bounded


def test_step_lines_are_parsed_numbers_only_and_merged_per_step():
    log = (
        "noise\n"
        "(TaskRunner pid=1) step:1 - actor/memopd/reverse_kl:0.5 - training/global_step:np.int64(1) - note:abc\n"
        "Training Progress: 10%|#| 1/10 [00:02<00:18]step:2 - timing_s/step:2.0 - x:np.float64(-1.5e-3) - y:nan\n"
        "step:x - a:1\n"
        "step:1 - val-core/memopd_memory/tiny/reward/mean@1:0.25 - actor/memopd/reverse_kl:0.75\n"
    )
    steps = parse_steps(log)
    assert sorted(steps) == [1, 2] and math.isnan(steps[2].pop("y"))
    assert steps == {
        1: {
            "actor/memopd/reverse_kl": 0.75,
            "training/global_step": 1.0,
            "val-core/memopd_memory/tiny/reward/mean@1": 0.25,
        },
        2: {"timing_s/step": 2.0, "x": -1.5e-3},
    }


def test_cpu_env_adds_the_cpu_platform_and_caches_to_the_offline_env(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMOPD_PROBE", "kept")
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    offline, cpu = offline_env(), cpu_env(tmp_path)
    assert offline["MEMOPD_PROBE"] == cpu["MEMOPD_PROBE"] == "kept"
    assert offline["HF_HUB_OFFLINE"] == offline["TRANSFORMERS_OFFLINE"] == "1" and offline["WANDB_MODE"] == "disabled"
    assert "VERL_PLATFORM" not in offline  # the GPU check's run: verl picks the platform
    assert cpu["VERL_PLATFORM"] == "cpu" and {k: cpu[k] for k in offline} == offline
    assert all(cpu[k].startswith(str(tmp_path / "cache")) for k in ("HF_HOME", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR"))


def test_cpu_env_sets_the_workers_threads_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_env(tmp_path)["OMP_NUM_THREADS"] == "3"  # None: this process's environment, untouched
    assert cpu_env(tmp_path, threads=2)["OMP_NUM_THREADS"] == "2"
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert "OMP_NUM_THREADS" not in cpu_env(tmp_path)  # Ray's default then: one thread per verl worker
    with pytest.raises(ValueError, match="threads must be >= 1"):
        cpu_env(tmp_path, threads=0)


def test_bounded_run_returns_status_and_writes_the_log(tmp_path):
    run = run_bounded(
        [sys.executable, "-c", "print('step:1 - a:2'); raise SystemExit(3)"],
        tmp_path,
        offline_env(),
        60,
        tmp_path / "run.log",
        who="test",
    )
    assert run.returncode == 3 and parse_steps(run.log) == {1: {"a": 2.0}}
    assert (tmp_path / "run.log").read_text() == run.log and 0 <= run.wall_s < 60
