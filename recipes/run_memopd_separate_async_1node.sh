#!/usr/bin/env bash
# MemOPD on verl's separate_async trainer (PPOTrainerSeparateAsync): Qwen2.5-3B-Instruct student, Qwen2.5-7B-Instruct
# teacher, one node with 8 GPUs, generation on a standalone vLLM pool while the trainer trains (docs/async.md).
#
#   bash recipes/run_memopd_separate_async_1node.sh [hydra overrides...]     (inside docker/Dockerfile's image, or
#                                                                            after bash docker/install.sh gpu; both
#                                                                            need cupy added, see Transport below)
#   MEMOPD_DRY_RUN=1 bash recipes/run_memopd_separate_async_1node.sh       print the command, one argument per line,
#                                                                            and run nothing
#   MEMOPD_PREPARE_ONLY=1 bash recipes/run_memopd_separate_async_1node.sh  fetch the models, build the data, stop
# NOT RUN: this project has not run separate_async (no GPU at hand when it was written); it composes and passes
#   the start-up checks (tests/test_gpu_recipe.py). Everything below that is a number is an estimate.
# It is recipes/run_memopd_qwen2.5_3b_7b_1node.sh (same models, data, lengths, 48 episodes per step, learning rates,
#   steps) plus the overrides below, so it is the sync recipe's matched async counterpart.
# Hardware: 1 node, 8x 80 GB GPUs (A100/H100/H200) with NVLink or PCIe P2P, ~200 GB host RAM, ~25 GB disk.
#   Driver: an NVIDIA driver for CUDA 13 (Linux >= 580.65.06, R580+); `python -m verl_memopd.bench.gpucheck` first.
#   4 GPUs (trainer.n_gpus_per_node): the FSDP-sharded 3B actor, critic and reference, training only (no vLLM here:
#     actor_rollout_ref.hybrid_engine=false).
#   2 GPUs (memopd.teacher.n_gpus_per_node): the 7B teacher's own pool, as in the sync recipe. TEACHER_GPUS_PER_NODE=0
#     colocates it in the actor's processes (memopd.teacher.placement=colocate) and gives the trainer 6 GPUs.
#   2 GPUs (actor_rollout_ref.rollout.nnodes=1, .n_gpus_per_node): the standalone rollout pool, one vLLM replica of
#     the student per GPU (TP 1, 80% of its memory: nothing else lives there). ROLLOUT_GPUS_PER_NODE moves it.
#   HYBRID=1 keeps verl's default hybrid_engine=true instead: vLLM replicas on the training GPUs too (40% of their
#     memory, asleep while training), used for the warm-up batch and validation.
# Transport: weights go from the actor to the pool through verl's checkpoint engine, backend nccl
#   (actor_rollout_ref.rollout.checkpoint_engine.backend=nccl; `naive` only reaches colocated replicas and is refused):
#   verl/checkpoint_engine/nccl_checkpoint_engine.py imports cupy, ray.util.collective (NCCL groups through
#   cupy.cuda.nccl) and zmq (bucket metadata). CUDA + cupy, a CUDA 13 build: pip install cupy-cuda13x==14.0.1
#   (verl 0.9.1's own pin, its extra verl[cupy-cu130]; NOT in this project's gpu extra or image, which install verl
#   with --no-deps). This script checks it before starting. Each update broadcasts the bf16 student in 2 GB buckets
#   (update_weights_bucket_megabytes=2048; 2 buffers = 4 GB on each GPU taking part while it runs).
# Async settings: trainer.v1.separate_async.parameter_sync_step=2 (PARAMETER_SYNC_STEP): verl requires
#   data.train_batch_size (48) == parameter_sync_step x actor.ppo_mini_batch_size (24); every step trains its 2
#   mini-batches (2 optimizer updates), then sends the weights once. algorithm.rollout_correction.bypass_mode=true:
#   PPO's old log-probs are the recorded rollout log-probs of the version that sampled each token (required for an
#   async base); audit steps still recompute them (memopd.audit). verl's defaults: num_warmup_batches=1,
#   trainer.v1.sampler.max_off_policy_threshold=8 (strategy drop). The run logs memopd/staleness/* per step.
# Memory, ESTIMATED (never measured; from the model sizes): training GPUs ~12 GB actor + ~12 GB critic (fp32 weights,
#   grads, Adam, sharded over 4) + ~2 GB reference + activations and log-softmax at 24,576 tokens per micro-batch
#   ~20-25 GB + 4 GB transfer buffers during the update: a ~50-55 GB peak of 80. Rollout GPUs: 64 GB for vLLM
#   (~6 GB weights, the rest KV cache) + 4 GB buffers. Teacher GPUs: as in the sync recipe (~8 GB weights each).
#   OOM on the training GPUs: lower actor_rollout_ref.actor.ppo_max_token_len_per_gpu (and the critic / log-prob ones).
# Step time, ESTIMATED (never measured): ~1-2 min per step of 48 episodes (9 calls each), roughly the larger of the
#   pool's generation of the next batch and the trainer's step on this one (they overlap), plus a weight update of a
#   few seconds. The console's timing_s/* and memopd/staleness/* lines measure it; please report them.
# Env: ROLLOUT_GPUS_PER_NODE (2), PARAMETER_SYNC_STEP (2), HYBRID (0), GPUS_PER_NODE (8, the node's GPUs),
#   TEACHER_GPUS_PER_NODE (2), MEMOPD_DATA, STUDENT, TEACHER, ATTENTION, EXPERIMENT, CKPT_DIR as in the sync recipe;
#   extra arguments are Hydra overrides and win over everything above.
# Expect (not yet run): the sync recipe's curves (validation F1 rising, the teacher KL falling) at a shorter step
#   time; memopd/staleness/mean between 0 and 1 (the warm-up batch keeps generation one update ahead);
#   memopd/audit/rce_pass = 1 and training/rollout_probs_diff_max small on the audit steps.
set -euo pipefail
here="$(dirname "${BASH_SOURCE[0]}")"
total_gpus="${GPUS_PER_NODE:-8}"
rollout_gpus="${ROLLOUT_GPUS_PER_NODE:-2}"
sync_step="${PARAMETER_SYNC_STEP:-2}"
train_batch=48   # the sync recipe's data.train_batch_size
if [ $(( train_batch % sync_step )) -ne 0 ]; then
  echo "PARAMETER_SYNC_STEP=$sync_step must divide data.train_batch_size=$train_batch" >&2
  exit 2
fi
mini=$(( train_batch / sync_step ))
if [ "${HYBRID:-0}" = 1 ]; then
  rollout=(actor_rollout_ref.hybrid_engine=true actor_rollout_ref.rollout.gpu_memory_utilization=0.4)
else
  rollout=(actor_rollout_ref.hybrid_engine=false actor_rollout_ref.rollout.gpu_memory_utilization=0.8)
fi

args=(memopd.trainer.base=separate_async
  actor_rollout_ref.rollout.nnodes=1 actor_rollout_ref.rollout.n_gpus_per_node="$rollout_gpus"
  actor_rollout_ref.rollout.checkpoint_engine.backend=nccl "${rollout[@]}"
  algorithm.rollout_correction.bypass_mode=true
  trainer.v1.separate_async.parameter_sync_step="$sync_step"
  actor_rollout_ref.actor.ppo_mini_batch_size="$mini" critic.ppo_mini_batch_size="$mini"
  "$@")

if [ "${MEMOPD_DRY_RUN:-0}" != 1 ] && [ "${MEMOPD_PREPARE_ONLY:-0}" != 1 ]; then
  # the nccl checkpoint engine's imports, before Ray starts anything
  python -c "import verl.checkpoint_engine.nccl_checkpoint_engine
from ray.util.collective import nccl_available
assert nccl_available(), 'ray.util.collective has no NCCL backend (cupy.cuda.nccl did not load)'" || {
    echo "separate_async sends weights through verl's nccl checkpoint engine, which needs cupy with NCCL:" \
      "pip install cupy-cuda13x==14.0.1 (verl 0.9.1's pin), then rerun" >&2
    exit 3
  }
fi
NNODES=1 GPUS_PER_NODE="$(( total_gpus - rollout_gpus ))" \
  EXPERIMENT="${EXPERIMENT:-memopd_separate_async_qwen2.5_3b_7b}" \
  exec bash "$here/run_memopd_qwen2.5_3b_7b_1node.sh" "${args[@]}"
