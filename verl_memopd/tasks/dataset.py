"""Benchmark episodes <-> rows of verl's RL parquet dataset, validated on the way back.

Row schema (one episode per row; what ``RLHFDataset`` reads and the agent loop receives)::

    data_source   "memopd_memory/<preset>"
    prompt        [{"role": "user", "content": q}]           q = task text + numbered questions
    ability       "memory"
    reward_model  {"style": "rule", "ground_truth": [[alias, ...] x K]}
    extra_info    {"index": i, "split": s, "episode_id": "<split>-<i>",
                   "questions": [str x K], "chunks": [str x N],
                   "support": [[fact sentence, ...] x K]}   (benchmark rows; analysis only, never shown)
                  converted rows (tasks.convert) add "answer_modes": ["any" | "all" x K] (read by the
                  reward: aliases vs values, see tasks.reward) and "source_row", "source_id", "source_file"
    agent_name    "memopd_memory_agent"                      the agent loop registered in verl_memopd.agent

:func:`parse_row` is the one gate back in: a row with missing answers, empty chunks or a
question/answer count mismatch raises ``ValueError`` naming the row.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from verl_memopd.tasks.generator import MemoryTask
from verl_memopd.tasks.prompts import MemoryPrompts
from verl_memopd.tasks.reward import as_answer_modes, as_answer_sets

__all__ = ["AGENT_NAME", "DATA_SOURCE", "TaskRow", "to_row", "episode_row", "parse_row", "write_rows", "read_rows"]

#: Name under which the memory agent loop registers with verl (``agent_name`` column).
AGENT_NAME = "memopd_memory_agent"
#: ``data_source`` prefix; the preset name follows after a slash.
DATA_SOURCE = "memopd_memory"


@dataclass(frozen=True)
class TaskRow:
    """A validated dataset row: what the agent and the oracle need (``where`` names it in errors).

    ``answer_modes``: one of ``tasks.reward.ANSWER_MODES`` per question (``any`` when the row has none).
    """

    where: str
    questions: tuple[str, ...]
    chunks: tuple[str, ...]
    answer_sets: tuple[tuple[str, ...], ...]
    answer_modes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.answer_modes:
            object.__setattr__(self, "answer_modes", ("any",) * len(self.answer_sets))


def to_row(task: MemoryTask, preset: str, split: str, index: int, prompts: MemoryPrompts = MemoryPrompts()) -> dict:
    """The parquet row of one generated episode (schema in the module docstring)."""
    return episode_row(
        f"{DATA_SOURCE}/{preset}",
        [q.text for q in task.questions],
        [list(q.answers) for q in task.questions],
        list(task.chunks),
        index,
        split,
        task.episode_id,
        prompts,
        extra={"support": [[f.sentence for f in q.support] for q in task.questions]},
    )


def episode_row(
    data_source: str,
    questions: Sequence[str],
    answer_sets: Sequence[Sequence[str]],
    chunks: Sequence[str],
    index: int,
    split: str,
    episode_id: str,
    prompts: MemoryPrompts = MemoryPrompts(),
    extra: Mapping | None = None,
    answer_modes: Sequence[str] | None = None,
) -> dict:
    """One row of the schema above from its parts (K questions, K alias lists, N chunk texts).

    ``answer_modes`` (K names, ``tasks.reward.ANSWER_MODES``) is written to ``extra_info.answer_modes``
    when given; a row without it scores every question as ``any`` (aliases).

    ``extra`` adds keys to ``extra_info`` (analysis only; the agent loop reads none of them).
    Shared by the benchmark (:func:`to_row`) and ``tasks.convert`` (your own data).
    """
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": prompts.question_text(questions)}],
        "ability": "memory",
        "reward_model": {"style": "rule", "ground_truth": [list(a) for a in answer_sets]},
        "extra_info": {
            "index": index,
            "split": split,
            "episode_id": episode_id,
            "questions": list(questions),
            "chunks": list(chunks),
            **({"answer_modes": list(answer_modes)} if answer_modes is not None else {}),
            **(extra or {}),
        },
        "agent_name": AGENT_NAME,
    }


def _strings(value: Any, name: str, where: str) -> tuple[str, ...]:
    if value is None or isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise ValueError(f"{where}: extra_info.{name} must be a list of strings, got {value!r}")
    out = tuple(value)
    if not out:
        raise ValueError(f"{where}: extra_info.{name} is empty")
    for i, s in enumerate(out):
        if not isinstance(s, str) or not s.strip():
            raise ValueError(f"{where}: extra_info.{name}[{i}] is empty or not a string ({s!r})")
    return out


def parse_row(extra_info: Mapping | None, reward_model: Mapping | None, where: str | None = None) -> TaskRow:
    """Validate the task fields of a row (its ``extra_info`` and ``reward_model``).

    ``where`` defaults to ``row <extra_info.index> (<episode_id>)``. Raises ``ValueError`` for
    a missing field, no/empty questions or chunks, a question without answers, or K questions
    with a different number of answer sets.
    """
    if not isinstance(extra_info, Mapping):
        raise ValueError(f"{where or 'row ?'}: extra_info is missing or not a mapping ({type(extra_info).__name__})")
    where = where or f"row {extra_info.get('index', '?')} ({extra_info.get('episode_id', '?')})"
    if not isinstance(reward_model, Mapping) or "ground_truth" not in reward_model:
        raise ValueError(f"{where}: reward_model.ground_truth is missing (the answers)")
    questions = _strings(extra_info.get("questions"), "questions", where)
    chunks = _strings(extra_info.get("chunks"), "chunks", where)
    answer_sets = as_answer_sets(reward_model["ground_truth"], where)
    if len(answer_sets) != len(questions):
        raise ValueError(f"{where}: {len(questions)} questions but {len(answer_sets)} answer sets (K mismatch)")
    modes = as_answer_modes(extra_info.get("answer_modes"), len(answer_sets), where)
    return TaskRow(where, questions, chunks, answer_sets, modes)


def write_rows(rows: Iterable[dict], path: str | Path) -> int:
    """Write rows to a parquet file; returns the row count."""
    import pandas as pd

    df = pd.DataFrame(list(rows))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    df.to_parquet(path, index=False)
    return len(df)


def read_rows(path: str | Path) -> list[dict]:
    """Read a parquet file written by :func:`write_rows` as plain Python rows (lists, not arrays)."""
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()
