"""The texts around the benchmark data: task prompt, per-call messages, answer format.

One place for every string the model reads besides the data itself, shared by the
generator (dataset ``prompt``), the agent loop (per-call context), the oracle (its traces)
and the reward (answer parsing), so all four agree::

    q (dataset prompt, user)   "<task>\\n\\nQuestions:\\n1. Where does Mara Tovin live?\\n2. ..."
    memory call t (user)       "Memory:\\n<memory>\\n\\nChunk 2 of 3:\\n<chunk>\\n\\n<write instruction>"
    answer call (user)         "Memory:\\n<memory>\\n\\n<answer instruction>"
    answer (assistant)         "1: Velora\\n2: Zentek Labs"

Every field has a default. ``task`` and ``questions_header`` (``DATA_FIELDS``) go into ``q`` and
are fixed when the dataset is built (``python -m verl_memopd.tasks convert --task TEXT``); the
agent loop reads ``q`` from the row's ``prompt`` and refuses them in its config. The per-call
fields (``CALL_FIELDS``) are set when training (``memopd.agent.prompts``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

__all__ = ["CALL_FIELDS", "DATA_FIELDS", "MemoryPrompts", "format_answers", "parse_answers"]

DATA_FIELDS = ("task", "questions_header")
CALL_FIELDS = ("memory_header", "empty_memory", "chunk_header", "write_instruction", "answer_instruction")

_ANSWER_LINE = re.compile(r"^\s*(\d+)\s*[:.)]\s*(.*?)\s*$")


@dataclass(frozen=True)
class MemoryPrompts:
    """Prompt texts of the memory benchmark (see module docstring for where each goes).

    Attributes:
        task: instructions at the top of ``q``.
        questions_header: line before the numbered questions in ``q``.
        memory_header: line before the memory in every call's context.
        empty_memory: shown instead of the memory when there is none yet (first call) or the
            model wrote nothing.
        chunk_header: line before the chunk; ``{index}`` is 1-based, ``{total}`` is N.
        write_instruction: closes a memory call's message.
        answer_instruction: closes the final (answer) call's message.
    """

    task: str = (
        "You read a long document one chunk at a time and never see earlier chunks again. "
        "Keep a short memory of the facts needed to answer the questions below."
    )
    questions_header: str = "Questions:"
    memory_header: str = "Memory:"
    empty_memory: str = "(empty)"
    chunk_header: str = "Chunk {index} of {total}:"
    write_instruction: str = (
        "Write the updated memory: keep every fact needed to answer the questions, and nothing else."
    )
    answer_instruction: str = "Answer every question, one line each, as <number>: <answer>."

    def __post_init__(self) -> None:
        for name in DATA_FIELDS + CALL_FIELDS:
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise ValueError(f"MemoryPrompts.{name} must be a non-empty string")
        try:
            self.chunk_header.format(index=1, total=1)
        except (KeyError, IndexError) as e:
            raise ValueError(f"MemoryPrompts.chunk_header may only use {{index}} and {{total}}: {e!r}") from None

    def question_text(self, questions: Sequence[str]) -> str:
        """The user message of ``q``: task instructions and the numbered questions."""
        lines = [f"{i}. {q}" for i, q in enumerate(questions, 1)]
        return f"{self.task}\n\n{self.questions_header}\n" + "\n".join(lines)

    def memory_message(self, memory: str, chunk: str, index: int, total: int) -> str:
        """User message of memory call ``index`` (0-based) of ``total`` chunks."""
        header = self.chunk_header.format(index=index + 1, total=total)
        return f"{self.memory_header}\n{memory or self.empty_memory}\n\n{header}\n{chunk}\n\n{self.write_instruction}"

    def answer_message(self, memory: str) -> str:
        """User message of the final call, which answers from memory alone."""
        return f"{self.memory_header}\n{memory or self.empty_memory}\n\n{self.answer_instruction}"


def format_answers(answers: Sequence[str]) -> str:
    """``["Velora", "Zentek Labs"]`` -> ``"1: Velora\\n2: Zentek Labs"`` (the expected answer format)."""
    return "\n".join(f"{i}: {a}" for i, a in enumerate(answers, 1))


def parse_answers(text: str, k: int) -> list[str]:
    """The K answers in ``text``: lines ``<number>: <answer>`` (also ``.`` or ``)``), 1-based.

    A missing number gives ``""``; when a number appears more than once the **last** line
    wins, so a response that ends with the final answer (e.g. a whole decoded episode) is
    scored on that answer. Numbers outside 1..K are ignored.
    """
    if k < 1:
        raise ValueError(f"parse_answers: k must be >= 1, got {k}")
    out = [""] * k
    for line in text.splitlines():
        m = _ANSWER_LINE.match(line)
        if m and 1 <= int(m.group(1)) <= k:
            out[int(m.group(1)) - 1] = m.group(2)
    return out
