#!/usr/bin/env bash
# One GPU session (<= 10 min on one GPU): the GPU check and the benchmarks whose figures the README's
# "Deployment" section quotes, each log under $OUT (default ./gpu_session_out), one summary on stdout.
#
#   bash verl_memopd/bench/gpu_session.sh                     # from the repository root, on a CUDA machine
#   MEMOPD_WHEELS=.whl bash verl_memopd/bench/gpu_session.sh  # also unpack the pure-Python wheels found there
#                                                             # (e.g. liger-kernel, for the KL comparison)
# The whole script keeps within MEMOPD_GPU_BUDGET_S seconds (default 570: a 600-second device call with room to
# return the logs): each step's `timeout` is its own bound or what is left of the budget, whichever is smaller,
# and a step with under 20 s left is skipped with a "== NAME SKIP" line. The steps whose figures blocked
# issues wait for (kl, audit, fsdp_reference) run first.
# Steps, in this order (each bounded by `timeout`; one failing does not stop the others):
#   kl          bench kl --device cuda: naive, ours at several token chunks (fp32, bf16), Liger-Kernel; profile
#   audit       bench audit --device cuda, 8 layers of Qwen2.5-3B, memory-agent episodes: the bf16 RCE check
#               with its fp32 (TF32) reference vs the check before it and vs the step's own passes
#   fsdp_reference  tests/test_fp32_reference.py on CUDA: the check's fp32 reference under FSDP1 / FSDP2 bf16
#               mixed precision, one rank per GPU (NCCL)
#   gpucheck    python -m verl_memopd.bench.gpucheck (every check this image can run; SKIP lines for the rest)
#   attention   bench attention: torch_varlen's K/V head repeat vs native GQA (vs flash-attn when installed)
#   packing     bench packing --device cuda, 8 layers of Qwen2.5-3B, with profiler tables: the bench shape
#               (32 episodes) and the GRPO group shape (64 episodes, groups of 8 sharing q, q = 2 blocks, 2 calls)
set -uo pipefail
out="${OUT:-gpu_session_out}"
mkdir -p "$out"
if [ -n "${MEMOPD_WHEELS:-}" ]; then
  site="$(mktemp -d)"
  for w in "$MEMOPD_WHEELS"/*.whl; do python -m zipfile -e "$w" "$site"; done
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

budget=${MEMOPD_GPU_BUDGET_S:-570}
session_start=$(date +%s)

step() {  # step NAME SECONDS COMMAND...: log to $out/NAME.log, print its rc, wall time and key lines
  local name=$1 limit=$2 start rc left
  shift 2
  start=$(date +%s)
  left=$(( budget - (start - session_start) ))
  if [ "$left" -lt 20 ]; then
    echo "== $name SKIP: ${left}s of the ${budget}s budget left"
    return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  echo "== $name rc=$rc wall_s=$(( $(date +%s) - start ))"
  grep -E "^(gpucheck|kl |attention |packing|audit |[0-9]+ (passed|failed))" "$out/$name.log" | grep -v " profile of " | cut -c1-400
  [ "$rc" = 0 ] || tail -n 5 "$out/$name.log"
}

nvidia-smi > "$out/nvidia-smi.txt" 2>&1
python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, torch.cuda.get_device_name(0))" 2>&1 | tee "$out/versions.txt"
step kl 120 python -m verl_memopd.bench kl --device cuda --token-chunks 256,384,512,768 --token-chunk 512 --profile
step audit 90 python -m verl_memopd.bench audit --device cuda --model-shape qwen2.5-3b --layers 8 \
  --shape memory-agent --episodes 4 --repeats 3
step fsdp_reference 60 python -m pytest tests/test_fp32_reference.py -q -p no:cacheprovider -k cuda
step gpucheck 150 python -m verl_memopd.bench.gpucheck --workdir /tmp/memopd_gpucheck
step attention 45 python -m verl_memopd.bench attention
# 32 episodes (~24k packed tokens, a real micro-batch's budget: the recipe's ppo_max_token_len_per_gpu) keep
# the step GPU-bound; at 8 the eager model's kernel launches dominate the packed step.
step packing_bench 150 python -m verl_memopd.bench packing --device cuda --model-shape qwen2.5-3b --layers 8 \
  --episodes 32 --repeats 5 --profile
step packing_group 120 python -m verl_memopd.bench packing --device cuda --model-shape qwen2.5-3b --layers 8 \
  --episodes 64 --group-size 8 --q-ratio 2 --calls 2 --repeats 5 --profile
