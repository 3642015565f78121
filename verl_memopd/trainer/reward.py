"""The task branch's reward: final-answer F1 with the clipped KL penalty of the method.

    r~_j = r_j - beta * [l_old,j - l_ref,j]_+          for every action token j (response_mask = 1)

``l_old`` / ``l_ref`` are the log-probs of the sampled token under the rollout policy (the
actor's packed forward, ``old_log_probs``) and the frozen reference (``ref_log_prob``), both on
the row's restored layout. Only a policy that drifted *above* the reference is penalised;
tokens the reference likes more cost nothing (verl's ``kl_penalty`` estimators are unclipped).

:func:`penalise_in_place` applies it to a step's rows in TransferQueue around verl's own
advantage step (see ``MemopdTrainer._compute_advantage``).
"""

from __future__ import annotations

import torch
import transfer_queue as tq
from tensordict import TensorDict
from verl.workers.utils.padding import response_to_nested


def clipped_kl_penalty(
    old_log_probs: torch.Tensor, ref_log_prob: torch.Tensor, response_mask: torch.Tensor, coef: float
) -> torch.Tensor:
    """``coef * [old - ref]_+`` per token, 0 where ``response_mask`` is 0. All (B, R); returns (B, R)."""
    if old_log_probs.shape != ref_log_prob.shape or old_log_probs.shape != response_mask.shape:
        raise ValueError(
            f"clipped_kl_penalty: old_log_probs {tuple(old_log_probs.shape)}, ref_log_prob "
            f"{tuple(ref_log_prob.shape)} and response_mask {tuple(response_mask.shape)} differ"
        )
    return coef * (old_log_probs - ref_log_prob).clamp(min=0) * response_mask


def penalty_metrics(
    old_log_probs: torch.Tensor, ref_log_prob: torch.Tensor, response_mask: torch.Tensor, penalty: torch.Tensor
) -> dict[str, float]:
    """``memopd/reward_kl/*`` of a step: mean clipped KL per action token, the share of action tokens
    it clips to 0, and the mean penalty per episode."""
    mask = response_mask.bool()
    diff = (old_log_probs - ref_log_prob)[mask]
    n = max(int(mask.sum()), 1)
    return {
        "memopd/reward_kl/clipped_kl_mean": float(diff.clamp(min=0).sum() / n),
        "memopd/reward_kl/clipped_fraction": float((diff <= 0).sum() / n),
        "memopd/reward_kl/penalty_per_episode": float(penalty.sum(-1).mean()),
    }


def penalise_in_place(batch, coef: float) -> tuple[TensorDict, dict[str, float]]:
    """Replace the step's ``rm_scores`` in TransferQueue by ``rm_scores - penalty``.

    Returns the fields to write back after the advantage step -- ``rm_scores`` (the task scores)
    and ``token_level_rewards`` (the penalised ones), nested like verl's -- which keeps verl's
    ``critic/score`` (task F1) and ``critic/rewards`` metrics apart; and ``memopd/reward_kl/*``.
    """
    fields = ["rm_scores", "old_log_probs", "ref_log_prob", "response_mask"]
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    nested_mask = data["response_mask"]
    padded = data.to_padded_tensor()
    mask = padded["response_mask"].to(padded["old_log_probs"].dtype)
    penalty = clipped_kl_penalty(padded["old_log_probs"], padded["ref_log_prob"], mask, coef)
    penalised = response_to_nested(padded["rm_scores"] - penalty.to(padded["rm_scores"].dtype), nested_mask)
    tq.kv_batch_put(
        keys=batch.keys,
        partition_id=batch.partition_id,
        fields=TensorDict({"rm_scores": penalised}, batch_size=len(batch)),
    )
    after = TensorDict({"rm_scores": data["rm_scores"], "token_level_rewards": penalised}, batch_size=len(batch))
    return after, penalty_metrics(padded["old_log_probs"], padded["ref_log_prob"], mask, penalty)
