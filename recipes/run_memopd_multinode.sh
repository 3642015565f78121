#!/usr/bin/env bash
# MemOPD 3B student / 7B teacher on N nodes of a running Ray cluster, submitted with `ray job submit`.
#
#   RAY_DASHBOARD=http://<head>:8265 NNODES=2 bash recipes/run_memopd_multinode.sh [hydra overrides...]
#   MEMOPD_DRY_RUN=1 RAY_DASHBOARD=... NNODES=2 bash recipes/run_memopd_multinode.sh     print the command only
#
# The training command is recipes/run_memopd_qwen2.5_3b_7b_1node.sh's (same settings, same env variables)
# with trainer.nnodes=$NNODES; `ray job submit` follows the job's log (Ctrl-C detaches, the job keeps running;
# `ray job stop <id> --address $RAY_DASHBOARD` stops it).
# Hardware: NNODES nodes x GPUS_PER_NODE (8) GPUs of 80 GB, one Ray node per machine, started beforehand:
#   head:   ray start --head --port=6379 --dashboard-host=0.0.0.0 --num-gpus=8
#   others: ray start --address=<head>:6379 --num-gpus=8
# Every node needs:
#   - the plugin installed (the docker/Dockerfile image, or bash docker/install.sh gpu), NOT shipped with a
#     runtime_env working_dir: verl imports it through its `verl.plugins` entry point in each worker process it
#     starts on a node, and a node without it would run workers that lack MemOPD's registrations;
#   - MEMOPD_DATA, CKPT_DIR and the model folders (or HF_HOME's hub cache) on storage all nodes share: verl's
#     TaskRunner reads the data on whichever node Ray puts it, and every rank writes its checkpoint shard.
# Runtime env: env_vars only -- the variables named in MEMOPD_JOB_ENV that are set here (default: HF_HOME
#   HF_HUB_OFFLINE TRANSFORMERS_OFFLINE WANDB_MODE NCCL_SOCKET_IFNAME NCCL_IB_HCA
#   GLOO_SOCKET_IFNAME VERL_PLATFORM). Variables the nodes need at start-up (e.g. NCCL_*) are safest exported
#   before `ray start` as well.
# Data: the `3b` preset, built here on first use (python -m verl_memopd.tasks build --preset 3b).
# Expect: what run_memopd_qwen2.5_3b_7b_1node.sh's header says, with NNODES times the GPUs per step's
#   rollout; the job ends SUCCEEDED. The same submission path is tested on one CPU machine by
#   tests/test_multinode_ray.py (two Ray nodes on loopback).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dashboard="${RAY_DASHBOARD:?set RAY_DASHBOARD to the Ray dashboard address, e.g. http://<head>:8265}"
nnodes="${NNODES:?set NNODES to the number of Ray nodes (machines) to train on}"
data="${MEMOPD_DATA:-$HOME/data/memopd_3b}"

mapfile -t train < <(MEMOPD_DRY_RUN=1 NNODES="$nnodes" MEMOPD_DATA="$data" \
  bash "$here/run_memopd_qwen2.5_3b_7b_1node.sh" "$@")
runtime_env="$(python - ${MEMOPD_JOB_ENV:-HF_HOME HF_HUB_OFFLINE TRANSFORMERS_OFFLINE WANDB_MODE \
  NCCL_SOCKET_IFNAME NCCL_IB_HCA GLOO_SOCKET_IFNAME VERL_PLATFORM} <<'PY'
import json, os, sys
print(json.dumps({"env_vars": {k: os.environ[k] for k in sys.argv[1:] if k in os.environ}}))
PY
)"
cmd=(ray job submit --address "$dashboard" --runtime-env-json "$runtime_env" -- "${train[@]}")

if [ "${MEMOPD_DRY_RUN:-0}" = 1 ]; then
  printf '%s\n' "${cmd[@]}"
  exit 0
fi
[ -f "$data/train.parquet" ] || python -m verl_memopd.tasks build --preset 3b --seed 0 --out "$data"
exec "${cmd[@]}"
