"""The memory agent replaying recorded trajectories: ``memopd_replay_agent`` (verl's agent-loop registry).

Off-policy distillation with the trainer's own code path: the loop rebuilds every call's context exactly as the
memory agent does (``q``, the memory the *recorded* replies leave, the chunk), checks it token for token against
the recorded prompt, and emits the recorded reply instead of sampling one. Everything after the loop -- packing,
restored positions, the teacher's scoring, the losses -- is the MemOPD trainer's, unchanged: against an on-policy
run only the states differ (the experiment's ``kd_soft`` arm replays the teacher's greedy trajectories).

Data: a dataset row of the memory agent (``tasks.dataset``) with ``agent_name: memopd_replay_agent`` and
``extra_info[fields.REPLAY]``, one ``{"prompt_ids", "response_ids"}`` per call in order (``response_ids`` as
generated, stop id included if the call stopped). A recorded reply longer than its budget, one that neither stops
nor fills it, a context that differs from the recorded prompt, or a call count that differs from the row's
chunks + 1 fails the episode naming the row and the call.

Log-probs: the replayed tokens were not sampled by the rollout policy, so the records carry 0.0 placeholders as
their rollout log-probs, and the loop refuses verl's bypass mode (``algorithm.rollout_correction.bypass_mode``,
which would take those placeholders as the old log-probs): the trainer recomputes the old log-probs with the actor.
verl's rollout-vs-trainer log-prob metrics (``training/rollout_probs_diff_*``) compare against the placeholders and
mean nothing in such a run. Every call is tagged with the weight version the trainer holds at the step that asked
for it (``global_steps - 1``, verl's convention; 0 before the first update): verl's staleness tags
``min/max_global_steps`` are required on every row, and a replayed token belongs to no policy version, so its
staleness reads 0. No request reaches the rollout server.
"""

from __future__ import annotations

from typing import Any, Optional

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register

from verl_memopd.agent.loop import MemoryAgentLoop, call_record
from verl_memopd.fields import REPLAY
from verl_memopd.records import Invocation

__all__ = ["REPLAY_AGENT_NAME", "ReplayAgentLoop", "ReplayError"]

#: the name rows give in their ``agent_name`` column to be replayed
REPLAY_AGENT_NAME = "memopd_replay_agent"


class ReplayError(ValueError):
    """A recorded trajectory that the memory agent could not have produced (names the row and the call)."""


@register(REPLAY_AGENT_NAME)
class ReplayAgentLoop(MemoryAgentLoop):
    """The memory agent with the recorded replies of ``extra_info[REPLAY]`` in place of the server's."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        correction = self.config.get("algorithm", {}).get("rollout_correction", None) or {}
        if correction.get("bypass_mode", False):
            raise ValueError(
                f"{REPLAY_AGENT_NAME}: algorithm.rollout_correction.bypass_mode=true would take the replayed "
                "tokens' placeholder rollout log-probs as the old log-probs; set it to false (the actor recomputes "
                "them)"
            )
        self._recorded: list[dict] = []
        self._version: Optional[int] = None

    async def _run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        extra = kwargs.get("extra_info") or {}
        where = f"row {extra.get('index', '?')} ({extra.get('episode_id', '?')})"
        recorded = extra.get(REPLAY)
        if recorded is None or len(recorded) == 0:
            raise ReplayError(f"{where}: extra_info.{REPLAY} is missing or empty; {REPLAY_AGENT_NAME} needs the calls")
        self._recorded = [dict(c) for c in recorded]
        step = kwargs.get("global_steps")
        self._version = None if step is None else max(int(step) - 1, 0)
        n_recorded = len(self._recorded)
        output = await super()._run(sampling_params, **kwargs)
        if self._recorded:
            raise ReplayError(
                f"{where}: extra_info.{REPLAY} has {n_recorded} calls, the episode made "
                f"{n_recorded - len(self._recorded)}"
            )
        return output

    async def _call(
        self,
        request_id: str,
        prompt_ids: tuple[int, ...],
        budget: int,
        sampling_params: dict,
        keeps_memory: bool,
        where: str,
    ) -> tuple[Invocation, tuple[Optional[int], Optional[int]]]:
        """The next recorded call, checked against the context the agent built; no server request."""
        if not self._recorded:
            raise ReplayError(f"{where}: extra_info.{REPLAY} has no call left for it")
        call = self._recorded.pop(0)
        recorded_prompt = tuple(int(i) for i in call["prompt_ids"])
        if recorded_prompt != tuple(prompt_ids):
            at = next((i for i, (a, b) in enumerate(zip(recorded_prompt, prompt_ids)) if a != b), None)
            at = min(len(recorded_prompt), len(prompt_ids)) if at is None else at
            raise ReplayError(
                f"{where}: the context the agent built ({len(prompt_ids)} tokens) differs from the recorded "
                f"prompt_ids ({len(recorded_prompt)} tokens) from token {at}: the trajectory was recorded under "
                "other prompts, template or memory"
            )
        ids = tuple(int(i) for i in call["response_ids"])
        stopped = bool(ids) and ids[-1] in self.stop_ids
        if not ids or len(ids) > budget or (not stopped and len(ids) < budget):
            raise ReplayError(
                f"{where}: recorded response_ids of {len(ids)} tokens for a budget of {budget} "
                f"({'stops' if stopped else 'no stop id'}): the agent cannot have produced it"
            )
        return call_record(prompt_ids, ids, (0.0,) * len(ids), stopped, keeps_memory), (self._version, self._version)
