"""Scripted oracle memory policy: reads chunks in order, keeps exactly the facts the questions need.

The oracle is the benchmark's upper bound and its consistency check: it sees what the agent
sees (the questions, then one chunk at a time) and its memory is all it has when answering.
Per chunk it parses the fact sentences (``world.parse_fact``) and keeps a fact when its
``(subject, relation)`` is needed: the first hop of a question, or the next hop of a chain
whose earlier hop is already in memory (the generator puts bridge facts after the fact naming
the bridge). It answers by following each question's chain through its memory. A correct
generator gives F1 = EM = 1.0 on every episode.

Its calls can be emitted as chat messages (:meth:`OracleEpisode.messages`) shaped exactly like
the agent loop's calls -- ``prompt`` (q), one user message with memory and chunk (or the
answer request), then the oracle's reply -- for supervised fine-tuning of a teacher.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from verl_memopd.tasks.dataset import TaskRow
from verl_memopd.tasks.prompts import MemoryPrompts, format_answers
from verl_memopd.tasks.reward import Score, score_answers
from verl_memopd.tasks.world import Fact, parse_fact, parse_question

__all__ = ["OracleCall", "OracleEpisode", "run_oracle"]

_SENTENCE_END = re.compile(r"(?<=\.)\s+")


@dataclass(frozen=True)
class OracleCall:
    """One oracle call: the user message the agent would send, and the oracle's reply."""

    user: str
    reply: str


@dataclass(frozen=True)
class OracleEpisode:
    """The oracle's N memory calls and its answer call, with the episode's score."""

    where: str
    calls: tuple[OracleCall, ...]
    answers: tuple[str, ...]
    score: Score

    def messages(self, prompt: Sequence[dict]) -> list[list[dict]]:
        """One chat per call: ``prompt + [user message, assistant reply]`` (SFT samples)."""
        return [
            list(prompt) + [{"role": "user", "content": c.user}, {"role": "assistant", "content": c.reply}]
            for c in self.calls
        ]


def _chains(row: TaskRow):
    chains = []
    for k, text in enumerate(row.questions):
        parsed = parse_question(text)
        if parsed is None:
            raise ValueError(f"{row.where}: question {k + 1} {text!r} matches no question template")
        kind, subject = parsed
        chains.append((subject, kind.relations))
    return chains


def _needed(chains, memory: dict[tuple[str, str], Fact]) -> set[tuple[str, str]]:
    """``(subject, relation)`` pairs to keep: the next unresolved hop of every chain."""
    need = set()
    for subject, relations in chains:
        for rel in relations:
            need.add((subject, rel))
            if (subject, rel) not in memory:
                break
            subject = memory[(subject, rel)].object
    return need


def _resolve(chains, memory: dict[tuple[str, str], Fact]) -> list[str]:
    answers = []
    for subject, relations in chains:
        for rel in relations:
            fact = memory.get((subject, rel))
            subject = fact.object if fact else ""
            if not fact:
                break
        answers.append(subject)
    return answers


def run_oracle(row: TaskRow, prompts: MemoryPrompts = MemoryPrompts()) -> OracleEpisode:
    """Run the oracle on one validated row (see module docstring)."""
    chains = _chains(row)
    memory: dict[tuple[str, str], Fact] = {}
    calls = []
    for c, chunk in enumerate(row.chunks):
        before = "\n".join(f.sentence for f in memory.values())
        for sentence in _SENTENCE_END.split(chunk.strip()):
            fact = parse_fact(sentence)
            if fact is not None and (fact.subject, fact.relation) in _needed(chains, memory):
                memory.setdefault((fact.subject, fact.relation), fact)
        after = "\n".join(f.sentence for f in memory.values())
        calls.append(
            OracleCall(prompts.memory_message(before, chunk, c, len(row.chunks)), after or prompts.empty_memory)
        )
    answers = _resolve(chains, memory)
    final_memory = "\n".join(f.sentence for f in memory.values())
    calls.append(OracleCall(prompts.answer_message(final_memory), format_answers(answers)))
    score = score_answers(answers, row.answer_sets, row.answer_modes)
    return OracleEpisode(row.where, tuple(calls), tuple(answers), score)
