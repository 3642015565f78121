"""The memory agent loop, registered with verl's agent-loop registry as ``memopd_memory_agent``.

One episode = one dataset row (see ``verl_memopd.tasks.dataset``) with N chunks: N memory calls, then the
answer call, as ``verl_memopd.agent.episode.MemoryEpisode`` lays them out; this loop serves them with verl's
rollout server. Each call's exact input ids, sampled ids and rollout log-probs become a
``records.Invocation`` (memory calls set ``memory_span``; a call that hit its token budget
without a stop token has ``finish_reason="length"`` and its memory is the truncated text);
the episode becomes a ``records.Episode`` and goes to verl as ONE row via
``packing.pack_episode``: ``prompt = q``, ``response`` = the call blocks, ``response_mask`` =
m_act, ``response_logprobs`` = the rollout log-probs (0.0 on context tokens).

Reward: the loop scores the decoded text of its final call itself (SQuAD F1 against the
row's answer aliases, or the share of its values found for an ``all`` question: the row's answer
modes, ``tasks.reward.score_answers``) and sets ``reward_score`` (verl then
skips its reward manager for the row and writes it at the last response token).

``extra_fields`` (read by the MemOPD trainer; verl carries them through unchanged, and its
own ``position_ids`` -- recomputed as 0..L-1 -- are NOT the restored ones):

    memopd_episode       Episode.to_dict(): every invocation's exact ids, log-probs, masks, policy_version
    memopd_position_ids  list[int] (P + R,) restored positions (each call block continues from P)
    memopd_segment_ids   list[int] (P + R,) 0 for q, t + 1 for the tokens of call t
    memopd_teacher_mask  list[int] (R,) 1 where the teacher supervises (m_T <= m_act)
    reward_extra_info    {"f1", "em", "memory_recall", "memory_truncated"} floats (verl logs these per data
                         source, e.g. ``val-aux/<source>/memory_recall/mean@1``): answer F1 / EM; the share of
                         questions whose answer is in the memory the answer call sees (``answer_recall``);
                         the share of memory calls that hit ``memory_tokens`` without a stop token
    min_global_steps / max_global_steps   oldest / newest trainer step of the weights that served
                         any call (verl's off-policy staleness tags; absent if the server reports none)

Config (``memopd.agent`` in the trainer config; every key optional, defaults below):
``memory_tokens`` (256) token budget of a memory call; ``answer_tokens`` (64) of the answer
call; ``seed_requests`` (true) give every call its own vLLM sampling seed, a hash of
(``rollout.seed``, the dataset row, the trainer step, the sample index within ``rollout.n``, the
call index) -- a resumed run then samples what the uninterrupted run sampled (verl's V1 agent
loop passes ``global_steps`` and ``session_id``; without them calls are not seeded);
``call_timeout_s`` (1800) seconds one call may wait for the server, queueing included, before the
episode fails naming the call (0 = no limit): a server whose engine died can otherwise leave verl waiting
forever; ``stop_token_ids`` ([]) extra stop ids -- the tokenizer's eos and the eos ids of the
model's generation config (``actor_rollout_ref.model.path``; vLLM stops on those too) are always
stop ids; ``prompts`` ({}) overrides of the per-call ``MemoryPrompts`` fields (``CALL_FIELDS``;
``task`` and ``questions_header`` are part of ``q``, written into the data when it is built, and are
refused here). A call that ends early on a token outside this set raises (its last token would
otherwise be kept as memory). Rollout requirements: ``actor_rollout_ref.rollout.calculate_log_probs=True``;
``prompt_length`` >= |q| and ``response_length`` >= the packed response (both checked).
An error raised by an episode is recorded for the job's top-level error (``agent.errors``).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import Any, Mapping, Optional, Sequence
from uuid import uuid4

from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
from verl.utils.model import get_generation_config

from verl_memopd.agent import errors as agent_errors
from verl_memopd.agent.context import CallContext
from verl_memopd.agent.episode import MemoryEpisode
from verl_memopd.fields import EPISODE, POSITION_IDS, SEGMENT_IDS, TEACHER_MASK
from verl_memopd.packing import pack_episode
from verl_memopd.records import Episode, Invocation
from verl_memopd.tasks.dataset import AGENT_NAME, TaskRow, parse_row
from verl_memopd.tasks.prompts import CALL_FIELDS, DATA_FIELDS, MemoryPrompts
from verl_memopd.tasks.reward import answer_recall

__all__ = ["MemoryAgentConfig", "MemoryAgentLoop", "EPISODE", "POSITION_IDS", "SEGMENT_IDS", "TEACHER_MASK"]


@dataclass(frozen=True)
class MemoryAgentConfig:
    """Mirror of ``memopd.agent`` (see module docstring)."""

    memory_tokens: int = 256
    answer_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed_requests: bool = True
    call_timeout_s: float = 1800.0
    prompts: MemoryPrompts = field(default_factory=MemoryPrompts)

    def __post_init__(self) -> None:
        for name in ("memory_tokens", "answer_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"memopd.agent.{name} must be >= 1, got {getattr(self, name)}")
        if not float(self.call_timeout_s) >= 0:
            raise ValueError(f"memopd.agent.call_timeout_s must be >= 0 (0 = no limit), got {self.call_timeout_s}")
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))

    @classmethod
    def from_mapping(cls, cfg: Optional[Mapping]) -> "MemoryAgentConfig":
        """Build from a (possibly OmegaConf) mapping; unknown keys are refused by name."""
        raw = dict(OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else (cfg or {}))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"memopd.agent: unknown keys {unknown}; valid: {sorted(known)}")
        prompts = dict(raw.get("prompts") or {})
        for key in DATA_FIELDS:
            if key in prompts:
                raise ValueError(
                    f"memopd.agent.prompts.{key}: not a run-time option -- the agent reads q (the task text and "
                    f"the questions) from the dataset row's `prompt`, written when the data is built "
                    f"(python -m verl_memopd.tasks convert --task TEXT; MemoryPrompts.{key} in "
                    f"verl_memopd/tasks/prompts.py); run-time keys: {list(CALL_FIELDS)}"
                )
        bad = sorted(set(prompts) - set(CALL_FIELDS))
        if bad:
            raise ValueError(f"memopd.agent.prompts: unknown keys {bad}; valid: {sorted(CALL_FIELDS)}")
        return cls(**{**raw, "prompts": MemoryPrompts(**prompts)})


def request_seed(key: str) -> int:
    """A stable 63-bit seed for ``key`` (the same in every process and run; Python's hash() is not)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


@register(AGENT_NAME)
class MemoryAgentLoop(AgentLoopBase):
    """N memory calls over the row's chunks, then one answer call; one packed row out."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.agent_config = MemoryAgentConfig.from_mapping(self.config.get("memopd", {}).get("agent"))
        eos = self.tokenizer.eos_token_id
        model_path = self.config.get("actor_rollout_ref", {}).get("model", {}).get("path")
        self.stop_ids = (
            frozenset(self.agent_config.stop_token_ids)
            | ({eos} if eos is not None else set())
            | (_generation_eos_ids(str(model_path)) if model_path else frozenset())
        )
        if not self.stop_ids:
            raise ValueError("memory agent: the tokenizer has no eos token and memopd.agent.stop_token_ids is empty")

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        try:
            return await self._run(sampling_params, **kwargs)
        except Exception as e:  # verl logs it in this worker only; keep it for the job's top-level error
            agent_errors.record(f"{type(e).__name__}: {e}")
            raise

    async def _run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        task = parse_row(kwargs.get("extra_info"), kwargs.get("reward_model"))
        ctx = CallContext(
            self.tokenizer,
            kwargs["raw_prompt"],
            self.agent_config.prompts,
            self.apply_chat_template_kwargs,
            where=task.where,
        )
        episode = MemoryEpisode(task, ctx, self.agent_config.memory_tokens, self.agent_config.answer_tokens)
        request_id, calls, versions, t0 = uuid4().hex, [], [], time.perf_counter()
        while not episode.done:
            request = episode.next_call()
            call, version = await self._call(
                request_id,
                request.prompt_ids,
                request.budget,
                self._seeded(sampling_params, task, kwargs, request.index),
                keeps_memory=request.keeps_memory,
                where=f"{task.where} call {request.index}",
            )
            episode.receive(call.response_ids, stopped=call.finish_reason == "stop")
            calls.append(call)
            versions.append(version)
        generate_s = time.perf_counter() - t0
        return self._output(episode, kwargs, calls, versions, generate_s)

    def _seeded(self, sampling_params: dict, task: TaskRow, kwargs: dict, call: int) -> dict:
        """``sampling_params`` with this call's vLLM seed (``seed_requests``; see module docstring)."""
        step, sample = kwargs.get("global_steps"), kwargs.get("session_id")
        if not self.agent_config.seed_requests or step is None or sample is None:
            return sampling_params
        key = f"{self.rollout_config.get('seed', 0)}|{task.where}|{int(step)}|{int(sample)}|{call}"
        return {**sampling_params, "seed": request_seed(key)}

    async def _call(
        self,
        request_id: str,
        prompt_ids: tuple[int, ...],
        budget: int,
        sampling_params: dict,
        keeps_memory: bool,
        where: str,
    ) -> tuple[Invocation, tuple[Optional[int], Optional[int]]]:
        """One model call with at most ``budget`` new tokens, recorded exactly as sent and returned.

        Also returns the ``(min, max)`` trainer step of the weights that served it (verl's server
        client reports them as ``min_global_steps`` / ``max_global_steps``; None when unknown).
        """
        params = {**sampling_params, "max_tokens": budget, "stop_token_ids": sorted(self.stop_ids)}
        timeout = float(self.agent_config.call_timeout_s) or None
        try:
            out = await asyncio.wait_for(
                self.server_manager.generate(
                    request_id=request_id, prompt_ids=list(prompt_ids), sampling_params=params
                ),
                timeout,
            )
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"{where}: no reply from the rollout server within memopd.agent.call_timeout_s={timeout:g} s "
                f"(a server whose engine died, e.g. killed for memory, never answers; raise the limit for "
                f"very long queues)"
            ) from None
        ids = list(out.token_ids)
        if not ids:
            raise RuntimeError(f"{where}: the server returned no tokens (stop_reason={out.stop_reason!r})")
        if out.log_probs is None:
            raise RuntimeError(f"{where}: no rollout log-probs; set actor_rollout_ref.rollout.calculate_log_probs=True")
        stopped = ids[-1] in self.stop_ids
        max_model_len = self.rollout_config.get("max_model_len")  # the server clamps new tokens to it
        limit = budget if not max_model_len else min(budget, max_model_len - len(prompt_ids))
        if len(ids) > budget or (not stopped and len(ids) < limit):
            raise RuntimeError(
                f"{where}: {len(ids)} tokens for a budget of {budget}, ending in token {ids[-1]} which is not a "
                f"stop id {sorted(self.stop_ids)}; add the model's stop ids to memopd.agent.stop_token_ids"
            )
        version = (out.extra_fields.get("min_global_steps"), out.extra_fields.get("max_global_steps"))
        call = call_record(prompt_ids, ids, out.log_probs, stopped, keeps_memory, None if None in version else version)
        return call, version

    def _output(
        self,
        episode: MemoryEpisode,
        kwargs: dict,
        calls: list[Invocation],
        versions: list[tuple[Optional[int], Optional[int]]],
        generate_s: float,
    ) -> AgentLoopOutput:
        task = episode.task
        answer_text = self.tokenizer.decode(episode.kept_ids, skip_special_tokens=True)
        score = episode.score(answer_text)
        memory_calls = calls[:-1]  # >= 1: parse_row refuses a row without chunks
        diagnostics = {
            "memory_recall": answer_recall(
                self.tokenizer.decode(memory_calls[-1].memory_ids, skip_special_tokens=True),
                task.answer_sets,
                task.answer_modes,
            ),
            "memory_truncated": sum(c.finish_reason == "length" for c in memory_calls) / len(memory_calls),
        }
        record = Episode(
            episode_id=uuid4().hex,
            uid=str(kwargs.get("uid", task.where)),
            prefix_ids=episode.context.prefix_ids,
            invocations=tuple(calls),
            reward=score.f1,
            extra={
                "where": task.where,
                "data_source": str(kwargs.get("data_source", "")),
                "answer": answer_text,
                "f1": score.f1,
                "em": score.em,
                **diagnostics,
                "weight_steps": [list(v) for v in versions],
            },
        )
        row = pack_episode(record)
        for name, n, limit in (
            ("prompt_length", len(row.prompt_ids), self.rollout_config.prompt_length),
            ("response_length", len(row.response_ids), self.rollout_config.response_length),
        ):
            if n > limit:
                raise ValueError(
                    f"{task.where}: packed episode needs actor_rollout_ref.rollout.{name} >= {n} "
                    f"(is {limit}); the row cannot be truncated without breaking its calls"
                )
        return AgentLoopOutput(
            prompt_ids=list(row.prompt_ids),
            response_ids=list(row.response_ids),
            response_mask=list(row.response_mask),
            response_logprobs=list(row.response_logprobs),
            reward_score=score.f1,
            num_turns=2 * len(calls),
            metrics={"generate_sequences": generate_s},
            extra_fields={
                EPISODE: record.to_dict(),
                POSITION_IDS: list(row.position_ids),
                SEGMENT_IDS: list(row.segment_ids),
                TEACHER_MASK: list(row.teacher_mask),
                "reward_extra_info": {"f1": score.f1, "em": score.em, **diagnostics},
                **_weight_steps(versions),
            },
        )


def call_record(
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    response_logprobs: Sequence[float],
    stopped: bool,
    keeps_memory: bool,
    policy_version: Optional[tuple[int, int]] = None,
) -> Invocation:
    """One call's record: a memory call keeps its reply minus the stop id (if it stopped) as the next memory."""
    end = len(response_ids) - 1 if stopped else len(response_ids)
    return Invocation(
        prompt_ids=tuple(prompt_ids),
        response_ids=tuple(response_ids),
        response_logprobs=tuple(response_logprobs),
        memory_span=(0, end) if keeps_memory else None,
        finish_reason="stop" if stopped else "length",
        policy_version=policy_version,
    )


@lru_cache(maxsize=None)
def _generation_eos_ids(model_path: str) -> frozenset[int]:
    """The eos ids of the model's generation config (vLLM stops on them too); empty if it has none."""
    config = get_generation_config(model_path)
    eos = getattr(config, "eos_token_id", None)
    return frozenset([eos] if isinstance(eos, int) else (eos or ()))


def _weight_steps(versions: list[tuple[Optional[int], Optional[int]]]) -> dict:
    """verl's staleness tags for the episode: the oldest and newest weights that served any call."""
    lows, highs = [v[0] for v in versions if v[0] is not None], [v[1] for v in versions if v[1] is not None]
    return {**({"min_global_steps": min(lows)} if lows else {}), **({"max_global_steps": max(highs)} if highs else {})}
