#!/usr/bin/env bash
# MemOPD 3B student / 7B teacher on N nodes of a running Ray cluster, submitted with `ray job submit`.
#
#   RAY_DASHBOARD=http://<head>:8265 NNODES=2 bash recipes/run_memopd_multinode.sh [hydra overrides...]
#   MEMOPD_DRY_RUN=1 RAY_DASHBOARD=... NNODES=2 bash recipes/run_memopd_multinode.sh     print the command only
#
# The training command is recipes/run_memopd_qwen2.5_3b_7b_1node.sh's (same settings, same env variables)
# with trainer.nnodes = memopd.teacher.nnodes = $NNODES (per node: 6 GPUs for the actor group, 2 for the
# teacher). `ray job submit` follows the job's log (Ctrl-C detaches and the job keeps running;
# `ray job stop <id> --address $RAY_DASHBOARD` stops it). MEMOPD_JOB_ID names the submission (to stop it,
# read its logs or resubmit under a known id); MEMOPD_TRAIN_SCRIPT swaps the training script for another
# recipe that honours MEMOPD_DRY_RUN, MEMOPD_PREPARE_ONLY and NNODES (tests/test_multinode_ray.py submits
# recipes/quickstart_cpu.sh's tiny CPU job this way to two Ray nodes on one machine).
# If a node holding the run's workers dies, the trainer's node watchdog (verl_memopd/trainer/watchdog.py) names
# it and ends the run, so the job ends FAILED instead of waiting; resubmit with trainer.resume_mode=auto to
# continue from the last checkpoint (trainer.save_freq) once the node is back.
# Hardware: NNODES nodes x GPUS_PER_NODE (8) GPUs of 80 GB, each with an NVIDIA driver for CUDA 13 (Linux
#   >= 580.65.06; check with python -m verl_memopd.bench.gpucheck), one Ray node per machine, started beforehand:
#   head:   ray start --head --port=6379 --dashboard-host=0.0.0.0 --num-gpus=8
#   others: ray start --address=<head>:6379 --num-gpus=8
# Every node needs:
#   - the plugin installed (the docker/Dockerfile image, or bash docker/install.sh gpu), NOT shipped with a
#     runtime_env working_dir: verl imports it through its `verl.plugins` entry point in each worker process it
#     starts on a node, and a node without it would run workers that lack MemOPD's registrations;
#   - MEMOPD_DATA, CKPT_DIR, STUDENT and TEACHER (model folders) on storage all nodes share: verl's TaskRunner
#     reads the data on whichever node Ray puts it, workers load the models, every rank writes its checkpoint.
# Ray token authentication (on by default in recent Ray when a token exists): the submitting shell needs the
#   cluster's token too (RAY_AUTH_MODE=token plus RAY_AUTH_TOKEN or ~/.ray/auth_token).
# Runtime env: env_vars only -- the variables named in MEMOPD_JOB_ENV that are set here (default: HF_HOME
#   HF_HUB_OFFLINE TRANSFORMERS_OFFLINE WANDB_MODE NCCL_SOCKET_IFNAME NCCL_IB_HCA
#   GLOO_SOCKET_IFNAME VERL_PLATFORM). Variables the nodes need at start-up (e.g. NCCL_*) are safest exported
#   before `ray start` as well.
# Data and models: fetched / built here on first use (the 1-node script with MEMOPD_PREPARE_ONLY=1).
# Expect: the outcome run_memopd_qwen2.5_3b_7b_1node.sh's header states, at up to NNODES times its throughput;
#   the job ends SUCCEEDED. The same submission path (two Ray nodes on one CPU machine) is tested by
#   tests/test_multinode_ray.py.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dashboard="${RAY_DASHBOARD:?set RAY_DASHBOARD to the Ray dashboard address, e.g. http://<head>:8265}"
nnodes="${NNODES:?set NNODES to the number of Ray nodes (machines) to train on}"
data="${MEMOPD_DATA:-$HOME/data/memopd_3b}"
script="${MEMOPD_TRAIN_SCRIPT:-$here/run_memopd_qwen2.5_3b_7b_1node.sh}"

mapfile -t train < <(MEMOPD_DRY_RUN=1 NNODES="$nnodes" MEMOPD_DATA="$data" bash "$script" "$@")
runtime_env="$(python - ${MEMOPD_JOB_ENV:-HF_HOME HF_HUB_OFFLINE TRANSFORMERS_OFFLINE WANDB_MODE \
  NCCL_SOCKET_IFNAME NCCL_IB_HCA GLOO_SOCKET_IFNAME VERL_PLATFORM} <<'PY'
import json, os, sys
print(json.dumps({"env_vars": {k: os.environ[k] for k in sys.argv[1:] if k in os.environ}}))
PY
)"
cmd=(ray job submit --address "$dashboard" --runtime-env-json "$runtime_env"
  ${MEMOPD_JOB_ID:+--submission-id "$MEMOPD_JOB_ID"} -- "${train[@]}")

if [ "${MEMOPD_DRY_RUN:-0}" = 1 ]; then
  printf '%s\n' "${cmd[@]}"
  exit 0
fi
MEMOPD_PREPARE_ONLY=1 MEMOPD_DATA="$data" bash "$script"
exec "${cmd[@]}"
