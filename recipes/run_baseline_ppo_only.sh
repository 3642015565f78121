#!/usr/bin/env bash
# Baseline: PPO alone (distillation weight lambda = 0), otherwise identical to MemOPD.
#
#   bash recipes/run_baseline_ppo_only.sh [hydra overrides...]          (MEMOPD_DRY_RUN=1: print the command)
#
# Runs recipes/run_memopd_qwen2.5_3b_7b_1node.sh with one more override, memopd.distill.coef=0: the task
# branch (final-answer F1 reward, clipped KL penalty, GAE with the critic, clipped PPO on sampled tokens)
# is unchanged and the teacher term is off. Everything else is that script's. Same hardware: 1 node,
# 8x 80 GB GPUs.
# Expect (paper): far lower validation F1 than MemOPD (MemOPD-3B: up to +416.2% F1 over PPO alone).
set -euo pipefail
EXPERIMENT="${EXPERIMENT:-baseline_ppo_only_qwen2.5_3b}" \
  exec bash "$(dirname "${BASH_SOURCE[0]}")/run_memopd_qwen2.5_3b_7b_1node.sh" memopd.distill.coef=0 "$@"
