#!/usr/bin/env bash
# MemOPD on one GPU: Qwen2.5-0.5B-Instruct student, Qwen2.5-1.5B-Instruct teacher (the first GPU run to try).
#
#   bash recipes/run_memopd_qwen2.5_0.5b_1.5b_1gpu.sh [hydra overrides...]     (inside docker/Dockerfile's image,
#                                                                            or after bash docker/install.sh gpu)
#   MEMOPD_DRY_RUN=1 bash recipes/run_memopd_qwen2.5_0.5b_1.5b_1gpu.sh       print the command, one argument per
#                                                                            line, and run nothing
#   MEMOPD_PREPARE_ONLY=1 bash recipes/run_memopd_qwen2.5_0.5b_1.5b_1gpu.sh  fetch the models, build the data, stop
# Hardware: one 80 GB GPU (A100/H100/H200), ~64 GB host RAM, ~5 GB disk for the two models. Driver: an NVIDIA
#   driver for CUDA 13 (Linux >= 580.65.06, R580+; torch 2.11.0 / vLLM 0.24.0 are CUDA 13.0 builds);
#   `python -m verl_memopd.bench.gpucheck` checks it and the GPU path first (<= 10 min).
#   Everything shares the GPU: the FSDP actor, critic and reference (0.5B each), the vLLM rollout (30% of the
#   GPU's memory while it generates) and the teacher (1.5B, forward only), colocated in the actor's process
#   (memopd.teacher.placement=colocate).
# Memory, ESTIMATED (not yet measured on a GPU; from the model sizes): actor and critic ~8 GB each (fp32
#   weights, gradients, Adam), reference ~2 GB, teacher ~3-6 GB, vLLM 24 GB (weights + KV cache), activations
#   and the action tokens' log-softmax at 16,384 tokens per micro-batch ~15 GB: a ~60 GB peak, 80 GB leaving room.
#   OOM: lower actor_rollout_ref.actor.ppo_max_token_len_per_gpu (and the log-prob / critic token limits below).
# Step time, ESTIMATED (not measured): ~30-60 s per step of 32 episodes (5 calls each, run one after another
#   by vLLM, plus verl's fixed per-step costs), so ~2-3.5 h for the 200 steps; validation every 20 steps adds.
#   The step's `timing_s/*` lines measure it; please report them.
# Data: the memory benchmark's `small` preset (4 chunks of ~60 words, 2 questions per episode; 2048 train,
#   128 val), built on first use: python -m verl_memopd.tasks build --preset small --seed 0 --out "$MEMOPD_DATA".
# Models: local folders STUDENT / TEACHER (default ~/models/Qwen2.5-{0.5B,1.5B}-Instruct), downloaded from the
#   Hugging Face hub on first use (memopd.teacher.path must be a local folder). They share the tokenizer.
# Attention: memopd_torch_varlen (torch's own varlen flash kernel; nothing beyond torch) for actor, critic and
#   teacher; ATTENTION=memopd_fa2 where flash-attn is installed. Distillation loss: 512 positions per chunk.
# Env: MEMOPD_DATA (default ~/data/memopd_small), STUDENT, TEACHER, ATTENTION, EXPERIMENT, CKPT_DIR; extra
#   arguments are Hydra overrides and win over everything above (e.g. memopd.teacher.state=flat or
#   memopd.distill.coef=0 for the baselines at this scale).
# Expect (not yet run by this project; no paper figures at this scale): per-step metrics on the console, the
#   teacher's reverse KL on the student's calls (actor/memopd/reverse_kl) falling, validation F1
#   (val-core/memopd_memory/small/reward/mean@1) rising from the start student's, the RCE audit passing
#   (memopd/audit/rce_pass = 1 every 10 steps), a checkpoint every 50 steps.
set -euo pipefail
data="${MEMOPD_DATA:-$HOME/data/memopd_small}"
student="${STUDENT:-$HOME/models/Qwen2.5-0.5B-Instruct}"
teacher="${TEACHER:-$HOME/models/Qwen2.5-1.5B-Instruct}"
experiment="${EXPERIMENT:-memopd_qwen2.5_0.5b_1.5b_1gpu}"
attention="${ATTENTION:-memopd_torch_varlen}"

# Lengths: q ~100 tokens; each memory call sees [q | memory <= 256 | chunk ~100] and writes <= 256 tokens
# (memopd.agent.memory_tokens); one episode = 4 memory calls + 1 answer call, packed into one response of
# at most ~2.7k tokens (every call writing its whole budget).
cmd=(python -m verl.trainer.main_ppo +recipe=memopd
  data.train_files="$data/train.parquet" data.val_files="$data/val.parquet"
  data.train_batch_size=32 data.val_batch_size=128
  data.max_prompt_length=512 data.max_response_length=4096
  actor_rollout_ref.model.path="$student" critic.model.path="$student"
  memopd.teacher.path="$teacher" memopd.teacher.placement=colocate
  memopd.teacher.n_gpus_per_node=1 memopd.teacher.nnodes=1
  actor_rollout_ref.model.override_config.attn_implementation="$attention"
  critic.model.override_config.attn_implementation="$attention" memopd.teacher.attn_implementation="$attention"
  memopd.distill.token_chunk_size=512
  memopd.agent.memory_tokens=256 memopd.agent.answer_tokens=64
  actor_rollout_ref.model.enable_gradient_checkpointing=true critic.model.enable_gradient_checkpointing=true
  actor_rollout_ref.model.use_remove_padding=true critic.model.use_remove_padding=true
  actor_rollout_ref.actor.optim.lr=1e-6 critic.optim.lr=1e-5
  actor_rollout_ref.actor.ppo_mini_batch_size=16
  actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384
  critic.use_dynamic_bsz=true critic.ppo_max_token_len_per_gpu=32768 critic.ppo_mini_batch_size=16
  actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true
  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.tensor_model_parallel_size=1
  actor_rollout_ref.rollout.gpu_memory_utilization=0.3 actor_rollout_ref.rollout.max_model_len=2048
  actor_rollout_ref.rollout.max_num_batched_tokens=8192 actor_rollout_ref.rollout.n=1
  actor_rollout_ref.rollout.agent.num_workers=4
  trainer.nnodes=1 trainer.n_gpus_per_node=1
  trainer.total_training_steps=200 trainer.val_before_train=true trainer.test_freq=20 trainer.save_freq=50
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
fetch "$student" Qwen/Qwen2.5-0.5B-Instruct
fetch "$teacher" Qwen/Qwen2.5-1.5B-Instruct
[ -f "$data/train.parquet" ] || python -m verl_memopd.tasks build --preset small --seed 0 --out "$data"
[ "${MEMOPD_PREPARE_ONLY:-0}" = 1 ] || exec "${cmd[@]}"
