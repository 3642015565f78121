#!/usr/bin/env bash
# Baseline: persistent-history teacher scoring (the paper's main control), otherwise identical to MemOPD.
#
#   bash recipes/run_baseline_flat_history.sh [hydra overrides...]      (MEMOPD_DRY_RUN=1: print the command)
#
# Runs recipes/run_memopd_qwen2.5_3b_7b_1node.sh with one more override, memopd.layout=flat: the same episodes
# are scored as one flattened history (plain positions 0..L-1, ordinary causal attention), so the teacher and
# the actor see states the student never sampled in. Everything else -- models, data (`3b` preset), batch
# sizes, steps, seeds -- is that script's. Same hardware: 1 node, 8x 80 GB GPUs.
# Expect (paper): lower validation F1 than MemOPD (MemOPD +7.0% F1), and, unlike MemOPD, action tokens whose
# flat-layout logits differ from their per-call ones (the RCE audit's flat_max_abs_diff > 0).
set -euo pipefail
EXPERIMENT="${EXPERIMENT:-baseline_flat_history_qwen2.5_3b_7b}" \
  exec bash "$(dirname "${BASH_SOURCE[0]}")/run_memopd_qwen2.5_3b_7b_1node.sh" memopd.layout=flat "$@"
