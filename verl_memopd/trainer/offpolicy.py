"""Off-policy bookkeeping of the trainer on verl's async bases (``memopd.trainer.base``; docs/async.md).

- :func:`use_rollout_log_probs`: verl's bypass mode (``algorithm.rollout_correction.bypass_mode=true``) takes
  each token's rollout log-prob -- recorded by the weights that sampled it, ``records.Invocation.policy_version``
  -- as its old log-prob, so PPO's ratio is ``pi_theta / pi_v``. MemOPD's audit steps still run the actor's
  old-log-prob forward (the RCE check rides on it) with bypass off for that call; this puts the rollout
  log-probs back as the old ones afterwards, exactly as verl's bypass branch writes them
  (``PPOTrainer._compute_old_log_prob``), so an audit step trains on the same ratio as any other step.
- :func:`batch_staleness_metrics`: the step's ``memopd/staleness/*`` (``verl_memopd.staleness``), read from the
  episodes' invocation records in TransferQueue.
"""

from __future__ import annotations

from verl_memopd.fields import EPISODE
from verl_memopd.staleness import staleness_metrics

__all__ = ["use_rollout_log_probs", "batch_staleness_metrics"]


def use_rollout_log_probs(batch) -> None:
    """``old_log_probs := rollout_log_probs`` for the rows of ``batch`` (a KVBatchMeta), verl's bypass write."""
    import transfer_queue as tq

    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["rollout_log_probs"])
    data["old_log_probs"] = data.pop("rollout_log_probs")
    tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=data)


def batch_staleness_metrics(batch, global_steps: int) -> dict[str, float]:
    """``memopd/staleness/*`` of the step's rows (verl's padding rows, copies of real ones, left out)."""
    import transfer_queue as tq

    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
    episodes = [
        extra[EPISODE]
        for extra, tag in zip(data["extra_fields"], batch.tags)
        if not tag.get("is_padding", False) and hasattr(extra, "__contains__") and EPISODE in extra
    ]
    return staleness_metrics(episodes, global_steps)
