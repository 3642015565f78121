#!/usr/bin/env bash
# MemOPD quickstart on a CPU-only machine: the memopd recipe with the CPU profile on tiny models.
#
#   bash recipes/quickstart_cpu.sh [hydra overrides...]     (after: bash docker/install.sh cpu, in a venv)
#   MEMOPD_DRY_RUN=1 bash recipes/quickstart_cpu.sh         print the command, one argument per line
#   MEMOPD_PREPARE_ONLY=1 bash recipes/quickstart_cpu.sh    build the models and data, stop
#
# Hardware: no GPU; 2 CPU cores and 16 GB RAM (a step had ~10.9 GB in use: docs/measurements.md; +profile=cpu;
#   two logical GPUs = two processes, one for the actor/critic group, one for the teacher's own pool). Offline.
# Builds, deterministically, on first use under MEMOPD_QUICKSTART_DIR (default runs/quickstart): the tiny
#   student and teacher (python -m verl_memopd.bench.tiny) and the benchmark's `tiny` preset
#   (python -m verl_memopd.tasks build --preset tiny).
# Runs 3 steps of `python -m verl.trainer.main_ppo +profile=cpu +recipe=memopd` (the recipe must come after
#   the profile: both set the attention implementation): vLLM-CPU rollouts of the memory agent (one verl row
#   per episode), the packed, state-aligned rows scored by the teacher worker group, GAE with the critic,
#   PPO + full-vocabulary reverse-KL updates, a checkpoint at step 3; bounded by MEMOPD_TIMEOUT_S (1800).
#   NNODES (1) sets trainer.nnodes (recipes/run_memopd_multinode.sh with MEMOPD_TRAIN_SCRIPT=this script).
# Expect: ~4 min after the install. Per-step lines with actor/memopd/reverse_kl (and per call),
#   timing_s/{gen,teacher,old_log_prob,ref,values,update_critic,update_actor}, memopd/reward_kl/*, memopd/*,
#   training/rollout_probs_diff_max
#   ~1e-5 (the trainer reproduces every call's rollout state); then validation F1
#   (val-core/memopd_memory/tiny/reward/mean@1; ~0 for an untrained tiny student).
# Baselines: add memopd.teacher.state=flat (persistent-history teacher scoring) or memopd.distill.coef=0 (PPO only).
# Async (verl's colocate_async trainer, partial rollouts across weight updates; docs/async.md): add
#   memopd.trainer.base=colocate_async algorithm.rollout_correction.bypass_mode=true (refused without bypass).
set -euo pipefail
out="${MEMOPD_QUICKSTART_DIR:-runs/quickstart}"

cmd=(timeout "${MEMOPD_TIMEOUT_S:-1800}" python -m verl.trainer.main_ppo +profile=cpu +recipe=memopd
  ray_kwargs.ray_init.num_gpus=2
  actor_rollout_ref.model.path="$out/models/student" memopd.teacher.path="$out/models/teacher"
  data.train_files="$out/data/train.parquet" data.val_files="$out/data/val.parquet"
  data.train_batch_size=2 data.val_batch_size=8 data.max_prompt_length=256 data.max_response_length=2048
  memopd.agent.memory_tokens=64 memopd.agent.answer_tokens=32
  actor_rollout_ref.rollout.n=2 actor_rollout_ref.rollout.max_model_len=1024
  actor_rollout_ref.rollout.max_num_seqs=8 actor_rollout_ref.rollout.max_num_batched_tokens=2048
  actor_rollout_ref.rollout.val_kwargs.n=1
  actor_rollout_ref.actor.ppo_mini_batch_size=2 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 critic.ppo_micro_batch_size_per_gpu=4
  actor_rollout_ref.actor.optim.lr=1e-5 actor_rollout_ref.actor.use_kl_loss=false
  trainer.total_training_steps=3 trainer.val_before_train=false trainer.test_freq=3 trainer.save_freq=3
  trainer.project_name=memopd_quickstart trainer.experiment_name=memopd_tiny_cpu
  trainer.default_local_dir="$out/checkpoints" trainer.nnodes="${NNODES:-1}"
  "$@")

if [ "${MEMOPD_DRY_RUN:-0}" = 1 ]; then
  printf '%s\n' "${cmd[@]}"
  exit 0
fi
mkdir -p "$out"
[ -f "$out/models/tiny.json" ] || python -m verl_memopd.bench.tiny --out "$out/models"
[ -f "$out/data/train.parquet" ] || python -m verl_memopd.tasks build --out "$out/data" --seed 0 --preset tiny
[ "${MEMOPD_PREPARE_ONLY:-0}" = 1 ] && exit 0
export VERL_PLATFORM=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled VLLM_CPU_KVCACHE_SPACE=1
exec "${cmd[@]}"
