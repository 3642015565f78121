#!/usr/bin/env bash
# MemOPD smoke run on a CPU-only machine: the memopd recipe with the CPU profile on the tiny models.
#
#   bash recipes/run_memopd_cpu_smoke.sh [hydra overrides...]     (after: bash docker/install.sh cpu, in a venv)
#   MEMOPD_DRY_RUN=1 bash recipes/run_memopd_cpu_smoke.sh         print the command, one argument per line
#
# Hardware: no GPU; 2 CPU cores and ~12 GB RAM are enough (+profile=cpu; two logical GPUs = two processes,
#   one for the actor group, one for the teacher's own pool).
# Builds, offline and deterministically, on first use: the tiny student and teacher (python -m verl_memopd.tiny)
#   and the benchmark's `tiny` preset (python -m verl_memopd.tasks build --preset tiny), under
#   MEMOPD_SMOKE_DIR (default runs/memopd_cpu_smoke).
# Runs 3 steps of `python -m verl.trainer.main_ppo +recipe=memopd +profile=cpu`: vLLM-CPU rollouts of the
#   memory agent, teacher scoring of the packed episodes, FSDP2 updates; bounded by MEMOPD_TIMEOUT_S (1800).
# Expect: ~5-10 min; per-step console lines with finite actor/critic/memopd metrics, then validation F1
#   (val-core/memopd_memory/tiny/reward/mean@1; near 0 for untrained tiny models). Extra arguments are Hydra
#   overrides (e.g. memopd.layout=flat, memopd.distill.coef=0 for the baselines).
set -euo pipefail
out="${MEMOPD_SMOKE_DIR:-runs/memopd_cpu_smoke}"

cmd=(timeout "${MEMOPD_TIMEOUT_S:-1800}" python -m verl.trainer.main_ppo +recipe=memopd +profile=cpu
  ray_kwargs.ray_init.num_gpus=2
  data.train_files="$out/data/train.parquet" data.val_files="$out/data/val.parquet"
  data.train_batch_size=2 data.val_batch_size=8 data.max_prompt_length=256 data.max_response_length=2048
  memopd.agent.memory_tokens=64 memopd.agent.answer_tokens=32
  actor_rollout_ref.model.path="$out/models/student" memopd.teacher.path="$out/models/teacher"
  actor_rollout_ref.rollout.n=2 actor_rollout_ref.rollout.max_model_len=1024
  actor_rollout_ref.rollout.max_num_seqs=8 actor_rollout_ref.rollout.max_num_batched_tokens=2048
  actor_rollout_ref.rollout.val_kwargs.n=1
  actor_rollout_ref.actor.ppo_mini_batch_size=2 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 critic.ppo_micro_batch_size_per_gpu=4
  actor_rollout_ref.actor.optim.lr=1e-5 actor_rollout_ref.actor.use_kl_loss=false
  trainer.total_training_steps=3 trainer.val_before_train=false trainer.test_freq=3 trainer.save_freq=-1
  trainer.project_name=memopd_smoke trainer.experiment_name=memopd_cpu
  trainer.default_local_dir="$out/checkpoints"
  "$@")

if [ "${MEMOPD_DRY_RUN:-0}" = 1 ]; then
  printf '%s\n' "${cmd[@]}"
  exit 0
fi
mkdir -p "$out"
[ -f "$out/models/tiny.json" ] || python -m verl_memopd.tiny --out "$out/models"
[ -f "$out/data/train.parquet" ] || python -m verl_memopd.tasks build --out "$out/data" --seed 0 --preset tiny
export VERL_PLATFORM=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled VLLM_CPU_KVCACHE_SPACE=1
exec "${cmd[@]}"
