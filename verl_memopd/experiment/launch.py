"""verl ``main_ppo`` command lines of the experiment (evals and arms) and the metrics they print.

Every run shares one set of rollout/agent settings (:data:`SHARED`), so the arms and the evals see
the same memory agent: ``memopd_memory_agent``, memory of at most 64 tokens per call, answers of at
most 32, greedy validation (verl's ``val_kwargs`` default: ``do_sample=False``).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

__all__ = ["SHARED", "AGENT_TOKENS", "main_ppo", "val_scores", "read_log"]

#: the memory agent's token budgets in every run (a memory call, the answer call); the diagnostics that run the
#: agent with Hugging Face models (``hf_agent.py``) use the same
AGENT_TOKENS = {"memory_tokens": 64, "answer_tokens": 32}

#: settings common to every main_ppo run of the experiment (CPU sizes, from recipes/quickstart_cpu.sh)
SHARED = (
    "+profile=cpu",
    "+recipe=memopd",
    "data.max_prompt_length=256",
    "data.max_response_length=2048",
    *(f"memopd.agent.{k}={v}" for k, v in AGENT_TOKENS.items()),
    "actor_rollout_ref.rollout.max_model_len=1024",
    "actor_rollout_ref.rollout.max_num_seqs=16",
    "actor_rollout_ref.rollout.max_num_batched_tokens=4096",
    "actor_rollout_ref.rollout.val_kwargs.n=1",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.use_kl_loss=false",
    "trainer.project_name=memopd_experiment",
)


def main_ppo(*overrides: str) -> list[str]:
    """``python -m verl.trainer.main_ppo`` with the shared settings, then ``overrides`` (which win)."""
    return [sys.executable, "-m", "verl.trainer.main_ppo", *SHARED, *overrides]


def val_scores(metrics: dict[str, float]) -> dict[str, float] | None:
    """``{"f1", "em"}`` from one step's validation metrics (verl logs the agent's reward_extra_info per
    data source: ``val-*/memopd_memory/<preset>/{f1,em}/mean@1``), plus the agent's memory diagnostics
    (``memory_recall``, ``memory_truncated``) when the log has them; None if the step did not validate."""
    found = {}
    for key, value in metrics.items():
        m = re.fullmatch(r"val-[a-z]+/memopd_memory/[^/]+/(f1|em|memory_recall|memory_truncated)/mean@1", key)
        if m:
            found[m.group(1)] = value
    if not found:
        return None
    if not {"f1", "em"} <= set(found):
        raise KeyError(f"validation metrics incomplete: found {sorted(found)} of f1, em in {sorted(metrics)}")
    return found


def read_log(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""
