"""A stock-verl GRPO smoke job on the tiny student: its prompts and Hydra overrides (shared by tests)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

FIXTURES = Path(__file__).parents[1] / "fixtures"


def prompts_parquet(path: Path, n: int) -> Path:
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
        f"data.train_files={train}",
        f"data.val_files={val}",
        "data.train_batch_size=4",
        "data.max_prompt_length=64",
        "data.max_response_length=24",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.max_model_len=128",
        "actor_rollout_ref.rollout.max_num_seqs=16",
        "actor_rollout_ref.rollout.max_num_batched_tokens=1024",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        f"actor_rollout_ref.actor.ppo_epochs={epochs}",
        "actor_rollout_ref.actor.use_kl_loss=false",
        f"reward.custom_reward_function.path={FIXTURES / 'vowel_reward.py'}",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.project_name=memopd_smoke",
        "trainer.experiment_name=grpo_cpu",
    ]
