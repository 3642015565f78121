#!/usr/bin/env bash
# MemOPD: Qwen2.5-3B-Instruct student, Qwen2.5-7B-Instruct teacher, one node with 8 GPUs.
#
#   bash recipes/run_memopd_qwen2.5_3b_7b_1node.sh [hydra overrides...]     (inside docker/Dockerfile's image,
#                                                                          or after bash docker/install.sh gpu)
#   MEMOPD_DRY_RUN=1 bash recipes/run_memopd_qwen2.5_3b_7b_1node.sh       print the command, one argument per
#                                                                          line, and run nothing
#   MEMOPD_PREPARE_ONLY=1 bash recipes/run_memopd_qwen2.5_3b_7b_1node.sh  fetch the models, build the data, stop
# Hardware: 1 node, 8x 80 GB GPUs (A100/H100/H200), ~200 GB host RAM, ~25 GB disk for the two models.
#   Driver: an NVIDIA driver for CUDA 13 (Linux >= 580.65.06, R580+; torch 2.11.0 / vLLM 0.24.0 are CUDA 13.0
#   builds); `python -m verl_memopd.bench.gpucheck` checks it (exit 4 when too old) and the GPU path in <= 10 min.
#   6 GPUs (trainer.n_gpus_per_node): the FSDP-sharded 3B actor, critic and reference, and one vLLM replica of
#   the student per GPU (TP 1, 40% of its memory). 2 GPUs (memopd.teacher.n_gpus_per_node): the 7B teacher's
#   own resource pool (forward only, bf16 FSDP, ~8 GB of weights per GPU). TEACHER_GPUS_PER_NODE moves the split;
#   TEACHER_GPUS_PER_NODE=0 runs the teacher in the actor's processes on all 8 GPUs (memopd.teacher.placement=colocate).
# Data: the memory benchmark's `3b` preset (8 chunks of ~400 words, 3 questions per episode), built on first
#   use: python -m verl_memopd.tasks build --preset 3b --seed 0 --out "$MEMOPD_DATA".
# Models: local folders STUDENT / TEACHER (default ~/models/Qwen2.5-{3B,7B}-Instruct), downloaded from the
#   Hugging Face hub on first use (memopd.teacher.path must be a local folder).
# Attention: memopd_torch_varlen (packed segments through torch's own varlen flash kernel; needs nothing
#   beyond torch) for actor, critic and teacher. ATTENTION=memopd_fa2 uses flash-attn instead where it is
#   installed (docker build --build-arg WITH_FLASH_ATTN=1); not measured faster (same FA2 kernel family).
# Distillation loss: 512 positions per token chunk (memopd.distill.token_chunk_size; 128, the CPU default,
#   leaves the GPU's head matmuls memory-bound): 43.6 ms and 1.79 GiB for 4096 positions on an H200.
# Env: MEMOPD_DATA (default ~/data/memopd_3b), STUDENT, TEACHER, NNODES (1), GPUS_PER_NODE (8),
#   TEACHER_GPUS_PER_NODE (2), ATTENTION, EXPERIMENT, CKPT_DIR; extra arguments are Hydra overrides and win over
#   everything above (recipes/run_baseline_*.sh are this script plus one override, so all else stays matched).
# Expect (not yet run on GPUs by this project -- the numbers are the paper's): per-step metrics on the
#   console; validation F1 (val-core/memopd_memory/3b/reward/mean@1) rising over the first ~100 steps and the
#   teacher KL (memopd/*) falling; at the end, MemOPD's F1 above the flat-history baseline (paper: +7.0% F1)
#   and far above PPO alone (paper: up to +416%). Packing cuts actor time (paper: up to 1.63x); check the
#   GPU path first with `python -m verl_memopd.bench.gpucheck`.
set -euo pipefail
data="${MEMOPD_DATA:-$HOME/data/memopd_3b}"
student="${STUDENT:-$HOME/models/Qwen2.5-3B-Instruct}"
teacher="${TEACHER:-$HOME/models/Qwen2.5-7B-Instruct}"
experiment="${EXPERIMENT:-memopd_qwen2.5_3b_7b}"
nnodes="${NNODES:-1}"
teacher_gpus="${TEACHER_GPUS_PER_NODE:-2}"
attention="${ATTENTION:-memopd_torch_varlen}"
placement=separate
[ "$teacher_gpus" -gt 0 ] || placement=colocate

# Lengths: q ~300 tokens; each memory call sees [q | memory <= 1024 | chunk ~550] and writes <= 1024 tokens
# (memopd.agent.memory_tokens); one episode = 8 memory calls + 1 answer call packed into one response.
cmd=(python -m verl.trainer.main_ppo +recipe=memopd
  data.train_files="$data/train.parquet" data.val_files="$data/val.parquet"
  data.train_batch_size=48 data.val_batch_size=128
  data.max_prompt_length=1024 data.max_response_length=22528
  actor_rollout_ref.model.path="$student" critic.model.path="$student"
  memopd.teacher.path="$teacher" memopd.teacher.placement="$placement"
  memopd.teacher.n_gpus_per_node="$(( teacher_gpus > 0 ? teacher_gpus : 1 ))" memopd.teacher.nnodes="$nnodes"
  actor_rollout_ref.model.override_config.attn_implementation="$attention"
  critic.model.override_config.attn_implementation="$attention" memopd.teacher.attn_implementation="$attention"
  memopd.distill.token_chunk_size=512
  memopd.agent.memory_tokens=1024 memopd.agent.answer_tokens=128
  actor_rollout_ref.model.enable_gradient_checkpointing=true critic.model.enable_gradient_checkpointing=true
  actor_rollout_ref.model.use_remove_padding=true critic.model.use_remove_padding=true
  actor_rollout_ref.actor.optim.lr=1e-6 critic.optim.lr=1e-5
  actor_rollout_ref.actor.ppo_mini_batch_size=24
  actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576
  critic.use_dynamic_bsz=true critic.ppo_max_token_len_per_gpu=49152 critic.ppo_mini_batch_size=24
  actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=49152
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true
  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=49152
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.tensor_model_parallel_size=1
  actor_rollout_ref.rollout.gpu_memory_utilization=0.4 actor_rollout_ref.rollout.max_model_len=4096
  actor_rollout_ref.rollout.max_num_batched_tokens=16384 actor_rollout_ref.rollout.n=1
  actor_rollout_ref.rollout.agent.num_workers=8
  trainer.nnodes="$nnodes" trainer.n_gpus_per_node="$(( ${GPUS_PER_NODE:-8} - teacher_gpus ))"
  trainer.total_training_steps=300 trainer.val_before_train=true trainer.test_freq=20 trainer.save_freq=50
  trainer.logger='[console,tensorboard]' trainer.project_name=memopd trainer.experiment_name="$experiment"
  trainer.default_local_dir="${CKPT_DIR:-checkpoints/memopd/$experiment}"
  "$@")

if [ "${MEMOPD_DRY_RUN:-0}" = 1 ]; then
  printf '%s\n' "${cmd[@]}"
  exit 0
fi
fetch() {  # local model folder <- hub repo, once
  [ -f "$1/config.json" ] || python -c "import sys; from huggingface_hub import snapshot_download as get
get(sys.argv[2], local_dir=sys.argv[1])" "$1" "$2"
}
fetch "$student" Qwen/Qwen2.5-3B-Instruct
fetch "$teacher" Qwen/Qwen2.5-7B-Instruct
[ -f "$data/train.parquet" ] || python -m verl_memopd.tasks build --preset 3b --seed 0 --out "$data"
[ "${MEMOPD_PREPARE_ONLY:-0}" = 1 ] || exec "${cmd[@]}"
