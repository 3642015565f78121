#!/usr/bin/env bash
# Baseline: persistent-history teacher scoring (the paper's main control), otherwise identical to MemOPD.
#
#   bash recipes/run_baseline_flat_history.sh [hydra overrides...]      (MEMOPD_DRY_RUN=1: print the command)
#
# Runs recipes/run_memopd_qwen2.5_3b_7b_1node.sh with one more override, memopd.teacher.state=flat: the teacher
# scores every sampled token in the persistent history -- call t's block after q and every earlier block,
# positions 0..L-1, one causal segment -- a state the student never sampled in. It is a matched control: the
# student's PPO branch (old/new log-probs, reference, critic) and the student side of the KL stay on the
# packed, aligned rows, exactly as in MemOPD. Everything else -- models, data (`3b` preset), batch sizes,
# steps, seeds -- is that script's. Same hardware: 1 node, 8x 80 GB GPUs.
# Expect (paper): lower validation F1 than MemOPD (MemOPD +7.0% F1); training/rollout_probs_diff_max stays
# at MemOPD's level (the student is aligned), while actor/memopd/audit/teacher_aligned_vs_flat_kl > 0 shows
# how far the teacher's supervision moved.
set -euo pipefail
EXPERIMENT="${EXPERIMENT:-baseline_flat_history_qwen2.5_3b_7b}" \
  exec bash "$(dirname "${BASH_SOURCE[0]}")/run_memopd_qwen2.5_3b_7b_1node.sh" memopd.teacher.state=flat "$@"
