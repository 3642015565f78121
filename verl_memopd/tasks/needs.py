"""What converted rows need from the rollout config, recorded in the parquet file and checked before Ray.

``convert`` measures every row with the student's tokenizer and the default per-call prompts
(``MemoryPrompts``) and writes :class:`DataNeeds` into the parquet file's metadata (key
``memopd_needs``). The packed response of an episode with M chunks is
``sum_t |x_t| + sum_t |a_t|`` (``packing.pack_episode``); its worst case, every memory call writing
its whole ``memory_tokens`` budget, is::

    F + E + M x max(memory_tokens, E) + M x memory_tokens + answer_tokens

with ``F`` = the tokens of all M + 1 call contexts without their memory slots (headers, chunks,
instructions; measured per row) and ``E`` = the tokens of the ``empty_memory`` text (the first call's
memory slot). :func:`check_lengths` (called by the recipe's config check, ``trainer.config``, with
``data.train_files`` / ``data.val_files`` and the rollout and agent settings) reads the recorded needs
and refuses a rollout whose ``prompt_length`` or ``response_length`` is shorter, before any Ray
process starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

__all__ = ["METADATA_KEY", "DataNeeds", "episode_needs", "read_needs", "check_lengths"]

#: Key of the needs in the parquet schema metadata.
METADATA_KEY = b"memopd_needs"


@dataclass(frozen=True)
class DataNeeds:
    """Per file: the longest ``q`` (tokens), ``E``, and per row ``(M memory calls, F fixed tokens)``."""

    q_tokens: int
    empty_memory_tokens: int
    episodes: tuple[tuple[int, int], ...]
    tokenizer: str = ""

    def response_length(self, memory_tokens: int, answer_tokens: int) -> int:
        """The worst-case packed response of the longest row (formula in the module docstring)."""
        e = self.empty_memory_tokens
        return max(
            (f + e + m * max(memory_tokens, e) + m * memory_tokens + answer_tokens for m, f in self.episodes), default=0
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "q_tokens": self.q_tokens,
                "empty_memory_tokens": self.empty_memory_tokens,
                "episodes": [list(e) for e in self.episodes],
                "tokenizer": self.tokenizer,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> "DataNeeds":
        d = json.loads(text)
        return cls(
            int(d["q_tokens"]),
            int(d["empty_memory_tokens"]),
            tuple((int(m), int(f)) for m, f in d["episodes"]),
            str(d.get("tokenizer", "")),
        )


def episode_needs(tokenizer: Any, prompt: Sequence[dict], chunks: Sequence[str], prompts: Any) -> tuple[int, int, int]:
    """``(M, F, E)`` of one row, measured with the agent's own call builder (``agent.context``)."""
    from verl_memopd.agent.context import CallContext

    ctx = CallContext(tokenizer, prompt, prompts)
    e = len(tokenizer.encode(prompts.empty_memory, add_special_tokens=False))
    m = len(chunks)
    fixed = sum(len(ctx.memory_call((), c, t, m)) - e for t, c in enumerate(chunks)) + len(ctx.answer_call(())) - e
    return m, fixed, e


def read_needs(path: str | Path) -> DataNeeds | None:
    """The needs recorded in a parquet file (None: not a converted file, or unreadable)."""
    try:
        import pyarrow.parquet as pq

        meta = pq.read_schema(path).metadata or {}
    except Exception:  # not parquet / not there: verl reports its own errors on its data files
        return None
    return DataNeeds.from_json(meta[METADATA_KEY]) if METADATA_KEY in meta else None


def _files(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def check_lengths(
    data_files: dict[str, Any],
    prompt_length: int | None,
    response_length: int | None,
    memory_tokens: int,
    answer_tokens: int,
    default_call_prompts: bool = True,
) -> list[str]:
    """Problems of the rollout lengths against the recorded needs of the data files (empty: fine).

    ``data_files``: config key (``train_files``, ``val_files``) -> a path or a list of paths; files
    without recorded needs are skipped. The response length is checked only with
    ``default_call_prompts`` (the needs are measured with the default per-call texts).
    """
    problems = []
    for key, value in data_files.items():
        for path in _files(value):
            needs = read_needs(path)
            if needs is None:
                continue
            if prompt_length is not None and needs.q_tokens > int(prompt_length):
                problems.append(
                    f"data.{key} {path}: q takes up to {needs.q_tokens} tokens but "
                    f"actor_rollout_ref.rollout.prompt_length={prompt_length} (set "
                    f"data.max_prompt_length >= {needs.q_tokens})"
                )
            need = needs.response_length(memory_tokens, answer_tokens)
            if response_length is not None and default_call_prompts and need > int(response_length):
                problems.append(
                    f"data.{key} {path}: a packed episode can take {need} response tokens (longest row, "
                    f"{max(m for m, _ in needs.episodes)} chunks at most, every memory call writing memopd.agent."
                    f"memory_tokens={memory_tokens}, answer_tokens={answer_tokens}) but "
                    f"actor_rollout_ref.rollout.response_length={response_length}: set data.max_response_length "
                    f">= {need}, or convert with a smaller --max-chunks / --chunk-tokens"
                )
    return problems
