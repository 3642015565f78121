"""The memory agent loop's own error, carried to the training job's top-level error.

verl runs every rollout in an AgentLoopWorker; an exception there is logged in that worker only and
the prompt's group is marked failed. When every group of a step failed, verl's replay buffer raises
just "Sync replay buffer selected terminal groups with no materializable trajectories." -- the cause
(e.g. "packed episode needs actor_rollout_ref.rollout.response_length >= 16418", or the rollout
server's own crash) stays in the workers' logs.

The agent loop records the job's first error of its own (:func:`record`, in Ray's internal key-value
store under a key holding the Ray job id, so jobs sharing a cluster do not mix); the MemOPD trainer
wraps its replay buffer (:func:`surface_in`) so that verl's error is raised again with that message
first. Outside Ray (tests, tools) :func:`record` does nothing unless a store is given.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, MutableMapping, Optional

__all__ = ["NO_TRAJECTORIES", "record", "first", "surface_in"]

#: The part of verl's replay-buffer error that means: every rollout of the selected groups failed.
NO_TRAJECTORIES = "no materializable trajectories"
_MAX_CHARS = 2000
_RECORDED = False


def _key() -> Optional[bytes]:
    try:
        import ray

        if not ray.is_initialized():
            return None
        return f"memopd/agent_loop_error/{ray.get_runtime_context().get_job_id()}".encode()
    except Exception:  # noqa: BLE001 -- a diagnostic: never let it replace the error it reports
        return None


def record(message: str, store: Optional[MutableMapping[bytes, bytes]] = None) -> None:
    """Keep ``message`` as the job's first agent-loop error (later ones are not kept)."""
    value = message[:_MAX_CHARS].encode()
    if store is not None:
        store.setdefault(b"memopd/agent_loop_error", value)
        return
    global _RECORDED
    key = None if _RECORDED else _key()
    if key is None:
        return
    try:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(key, value, overwrite=False)
        _RECORDED = True  # one store call per process: only the first error is kept anyway
    except Exception:  # noqa: BLE001 -- see _key
        pass


def first(store: Optional[MutableMapping[bytes, bytes]] = None) -> Optional[str]:
    """The job's first recorded agent-loop error, or None."""
    if store is not None:
        value = store.get(b"memopd/agent_loop_error")
    else:
        key = _key()
        try:
            from ray.experimental import internal_kv

            value = internal_kv._internal_kv_get(key) if key is not None else None
        except Exception:  # noqa: BLE001 -- see _key
            value = None
    return value.decode() if value else None


def surface_in(buffer: Any, store: Optional[MutableMapping[bytes, bytes]] = None) -> Any:
    """Wrap ``buffer.sample`` so that verl's "no materializable trajectories" error names the cause."""
    sample: Callable = buffer.sample

    @functools.wraps(sample)
    def sample_naming_the_cause(*args: Any, **kwargs: Any):
        try:
            return sample(*args, **kwargs)
        except RuntimeError as e:
            cause = first(store) if NO_TRAJECTORIES in str(e) else None
            if cause is None:
                raise
            raise RuntimeError(f"the memory agent loop failed: {cause} (first error of this job; verl: {e})") from e

    buffer.sample = sample_naming_the_cause
    return buffer
