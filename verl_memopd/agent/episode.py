"""The memory agent's episode as its sequence of calls, whoever serves them (stage 1 of the data flow).

One dataset row (``tasks.dataset.TaskRow``) with N chunks::

    for t in 0..N-1:  a_t = model([q | memory | chunk_t])   memory := a_t minus its stop token
    final:            a_N = model([q | memory])              answer lines "k: <answer>"

:class:`MemoryEpisode` says what call t sends (:meth:`~MemoryEpisode.next_call`: the exact ids from
``agent.context.CallContext`` and the call's token budget) and takes its reply back
(:meth:`~MemoryEpisode.receive`), which sets the memory of the next call. The training agent loop
(``agent.loop``, verl's rollout server, one episode per loop) and the experiment's Hugging Face agent
(``experiment.hf_agent``, batched ``generate`` over many episodes, call index by call index) both drive it,
so the two cannot build different calls. Imports without verl.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from verl_memopd.agent.context import CallContext
from verl_memopd.tasks.dataset import TaskRow
from verl_memopd.tasks.prompts import parse_answers
from verl_memopd.tasks.reward import Score, score_answers

__all__ = ["CallRequest", "MemoryEpisode"]


@dataclass(frozen=True)
class CallRequest:
    """Call ``index`` of an episode: ``prompt_ids`` = ``q + x_t``, exactly as it must be sent; at most ``budget``
    new tokens. ``keeps_memory``: a memory call (its reply up to the stop token is the next call's memory);
    False for the final, answer call."""

    index: int
    prompt_ids: tuple[int, ...]
    budget: int
    keeps_memory: bool


class MemoryEpisode:
    """One row's calls: N memory calls over its chunks (``memory_tokens`` each), then the answer call
    (``answer_tokens``). Call :meth:`next_call` and :meth:`receive` alternately, ``num_calls`` times."""

    def __init__(self, task: TaskRow, context: CallContext, memory_tokens: int, answer_tokens: int):
        self.task, self.context = task, context
        self.memory_tokens, self.answer_tokens = memory_tokens, answer_tokens
        #: the ids the last reply kept: the memory the next call reads; after the answer call, the answer's ids
        self.kept_ids: tuple[int, ...] = ()
        self.calls_made = 0

    @property
    def num_calls(self) -> int:
        return len(self.task.chunks) + 1

    @property
    def done(self) -> bool:
        return self.calls_made == self.num_calls

    def next_call(self) -> CallRequest:
        """The request of the next call, from the memory the previous reply left."""
        t, n = self.calls_made, len(self.task.chunks)
        if self.done:
            raise RuntimeError(f"{self.task.where}: the episode's {self.num_calls} calls are made")
        if t < n:
            context, budget = self.context.memory_call(self.kept_ids, self.task.chunks[t], t, n), self.memory_tokens
        else:
            context, budget = self.context.answer_call(self.kept_ids), self.answer_tokens
        return CallRequest(t, self.context.prefix_ids + context, budget, keeps_memory=t < n)

    def message(self, memory_text: str) -> str:
        """The next call's user message as text, with the memory as ``memory_text`` (e.g. its ids decoded)."""
        t, n = self.calls_made, len(self.task.chunks)
        if t < n:
            return self.context.prompts.memory_message(memory_text, self.task.chunks[t], t, n)
        return self.context.prompts.answer_message(memory_text)

    def receive(self, response_ids: Sequence[int], stopped: bool) -> None:
        """The reply to the call :meth:`next_call` gave, as generated; ``stopped``: it ends in a stop id, which the
        memory (or the answer) leaves out."""
        self.kept_ids = tuple(response_ids[:-1] if stopped else response_ids)
        self.calls_made += 1

    def score(self, answer_text: str) -> Score:
        """The benchmark's score of the answer call's text (``tasks.reward``: F1 / EM over the row's answers)."""
        answers = parse_answers(answer_text, len(self.task.answer_sets))
        return score_answers(answers, self.task.answer_sets, self.task.answer_modes)
