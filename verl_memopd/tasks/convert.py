"""Your own long-context QA -> the agent loop's parquet rows (one row per episode).

Input: JSONL, a JSON array, or parquet; one record = one episode. Field names (``--format``)::

    jsonl     context: str | [str, ...]   question: str | [str x K]   answers: [alias, ...] | [[alias, ...] x K]
    memagent  MemAgent's own names (github.com/BytedTsinghua-SIA/MemAgent, as its data scripts write them):
              context                      the long text, documents as "Document i:\\n<doc>" joined by blank lines
                                           (taskutils/memory_data/processing.py)
              input                        the question (taskutils/memory_data/convert_to_eval.py: eval_*.json;
                                           taskutils/memory_data/ruler_data_prepare.py: RULER jsonl)
              extra_info.question, prompt  the question in its training parquet (processing.py: prompt =
                                           [{"role": "user", "content": question}])
              answers | outputs | reward_model.ground_truth   the aliases (eval json | RULER | training parquet)
    auto      either: a record's question is the first of question, input, extra_info.question, prompt that it
              has; its answers the first of answers, outputs, reward_model.ground_truth

A list ``context`` is a list of documents, joined with MemAgent's convention ("Document {i}:\\n{doc}",
``\\n\\n`` between). With one question (a string), ``answers`` is its alias list (or a single string);
with K questions (a list), ``answers`` holds K entries, each an alias list or a single string.

Chunking: the context is cut into units at sentence ends (``.!?`` plus closing quotes/brackets, before
whitespace) and before blank lines (document starts; a "Document i:" header and its title line stay with
the text that follows), and units are packed greedily, in order, into chunks of at most N tokens of the
model's own tokenizer (``len(tokenizer.encode(chunk, add_special_tokens=False))``, every chunk checked).
A unit longer than N tokens is cut between tokens (at the character offsets where tokens start: a token
is never split). Chunks are the original text between cuts, stripped of surrounding whitespace.

Refusals (a record is converted whole or refused with its row number and one reason; nothing is dropped
silently): see :data:`REFUSALS`. Output rows: ``verl_memopd.tasks.dataset`` (``episode_row``), with
``data_source = "memopd_convert/<input file stem>"`` and ``extra_info.source_row`` = the input row.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from verl_memopd.tasks.dataset import episode_row, parse_row
from verl_memopd.tasks.prompts import MemoryPrompts

__all__ = ["FORMATS", "REFUSALS", "Refused", "QARecord", "read_records", "extract", "join_documents",
           "split_units", "chunk_text", "ConvertResult", "convert_records", "SOURCE_PREFIX"]

#: ``data_source`` prefix of converted rows; the input file's stem follows after a slash.
SOURCE_PREFIX = "memopd_convert"

#: Where each format looks for the question and the answers (first present wins; dots = nesting).
FORMATS: dict[str, dict[str, tuple[str, ...]]] = {
    "jsonl": {"context": ("context",), "question": ("question",), "answers": ("answers",)},
    "memagent": {"context": ("context",), "question": ("input", "extra_info.question", "prompt"),
                 "answers": ("answers", "outputs", "reward_model.ground_truth")},
    "auto": {"context": ("context",), "question": ("question", "input", "extra_info.question", "prompt"),
             "answers": ("answers", "outputs", "reward_model.ground_truth")},
}

#: Refusal classes, as printed in the summary.
REFUSALS = {
    "bad_record": "the line/element is not a JSON object",
    "missing_field": "no context, question or answers field",
    "non_string": "context, a document, a question or an answer alias is not a string",
    "empty_context": "the context (or one of its documents) is empty",
    "empty_question": "a question is empty",
    "no_answers": "a question has no answers (or an empty alias)",
    "extra_answers": "more answer lists than questions",
    "too_many_chunks": "the context yields more chunks than --max-chunks",
}

DOCUMENT = "Document {i}:\n{doc}"  # MemAgent's DOCUMENT_PROMPT (taskutils/memory_data/processing.py)
_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*(?=\s)")
_BLANK_LINE = re.compile(r"\n[ \t]*\n")


class Refused(ValueError):
    """A record that cannot be converted: ``kind`` is one of :data:`REFUSALS`."""

    def __init__(self, kind: str, message: str):
        if kind not in REFUSALS:
            raise KeyError(f"unknown refusal {kind!r}; valid: {sorted(REFUSALS)}")
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@dataclass(frozen=True)
class QARecord:
    """One input episode: the context text, K questions and K alias lists."""

    context: str
    questions: tuple[str, ...]
    answer_sets: tuple[tuple[str, ...], ...]


# --- reading --------------------------------------------------------------------------------
def read_records(path: str | Path) -> list[Any]:
    """All records of a ``.jsonl``, ``.json`` (array, or one object per line) or ``.parquet`` file, in order.

    A JSONL line that does not parse is kept as its raw text (refused later as ``bad_record``);
    blank lines are not records.
    """
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix not in (".jsonl", ".json"):
        raise ValueError(f"{path}: unknown input type {path.suffix!r}; expected .jsonl, .json or .parquet")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            whole = json.loads(text)
            return whole if isinstance(whole, list) else [whole]
        except json.JSONDecodeError:
            pass  # one object per line
    return [_json_line(line) for line in text.splitlines() if line.strip()]


def _json_line(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return line


def _field(record: Mapping, names: Sequence[str]) -> tuple[str, Any] | None:
    """The first of ``names`` (dotted = nested) present and not null in ``record``: (name, value)."""
    for name in names:
        value: Any = record
        for part in name.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if value is not None:
            return name, value
    return None


# --- one record -> QARecord -----------------------------------------------------------------
def extract(record: Any, fmt: str = "auto") -> QARecord:
    """Validate one record in layout ``fmt`` (see module docstring); raises :class:`Refused`."""
    if fmt not in FORMATS:
        raise KeyError(f"unknown format {fmt!r}; valid: {sorted(FORMATS)}")
    if not isinstance(record, Mapping):
        raise Refused("bad_record", f"expected a JSON object, got {type(record).__name__} {str(record)[:60]!r}")
    names = FORMATS[fmt]
    found = {key: _field(record, names[key]) for key in ("context", "question", "answers")}
    missing = [f"{key} ({' | '.join(names[key])})" for key, hit in found.items() if hit is None]
    if missing:
        raise Refused("missing_field", "no " + ", no ".join(missing) + f" [--format {fmt}]")
    (_, context), (q_name, q_value), (a_name, a_value) = found["context"], found["question"], found["answers"]
    questions, single = _questions(q_value, q_name)
    return QARecord(_context(context), questions, _answer_sets(a_value, a_name, len(questions), single))


def join_documents(documents: Sequence[str]) -> str:
    """MemAgent's convention: ``"Document 1:\\n<d1>\\n\\nDocument 2:\\n<d2>..."``."""
    return "\n\n".join(DOCUMENT.format(i=i, doc=d.strip()) for i, d in enumerate(documents, 1))


def _context(value: Any) -> str:
    if isinstance(value, str):
        if not value.strip():
            raise Refused("empty_context", "context is empty")
        return value
    if not isinstance(value, (list, tuple)):
        raise Refused("non_string", f"context must be a string or a list of documents, got {type(value).__name__}")
    if not value:
        raise Refused("empty_context", "context is an empty list of documents")
    for i, doc in enumerate(value, 1):
        if not isinstance(doc, str):
            raise Refused("non_string", f"document {i} of the context is not a string ({type(doc).__name__})")
        if not doc.strip():
            raise Refused("empty_context", f"document {i} of the context is empty")
    return join_documents(value)


def _questions(value: Any, name: str) -> tuple[tuple[str, ...], bool]:
    """The questions, and whether there was a single one (a string, not a list)."""
    if name == "prompt":  # MemAgent's training rows: [{"role": "user", "content": question}]
        users = [m for m in value if isinstance(m, Mapping) and m.get("role") == "user"] \
            if isinstance(value, (list, tuple)) else []
        if not users:
            raise Refused("missing_field", "prompt has no user message (the question)")
        value = users[-1].get("content")
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise Refused("non_string", f"{name} must be a string or a list of strings, got {type(value).__name__}")
    if not items:
        raise Refused("empty_question", f"{name} is an empty list")
    for k, q in enumerate(items, 1):
        if not isinstance(q, str):
            raise Refused("non_string", f"question {k} ({name}) is not a string ({type(q).__name__})")
        if not q.strip():
            raise Refused("empty_question", f"question {k} ({name}) is empty")
    return tuple(q.strip() for q in items), isinstance(value, str)


def _answer_sets(value: Any, name: str, k: int, single: bool) -> tuple[tuple[str, ...], ...]:
    """K alias tuples: one question takes a flat alias list (or ``[[...]]``), K questions take K entries."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise Refused("non_string", f"{name} must be a list of answers, got {type(value).__name__}")
    nested = any(isinstance(v, (list, tuple)) for v in value)
    if single and not nested:
        value = [value]
    if len(value) < k or not value:
        raise Refused("no_answers", f"question {len(value) + 1} has no answers ({k} questions, "
                                    f"{len(value)} answer lists in {name})")
    if len(value) > k:
        raise Refused("extra_answers", f"{len(value)} answer lists in {name} for {k} question(s)")
    out = []
    for q, aliases in enumerate(value, 1):
        aliases = [aliases] if isinstance(aliases, str) else aliases
        if not isinstance(aliases, (list, tuple)):
            raise Refused("non_string", f"the answers of question {q} are not strings ({type(aliases).__name__})")
        if not aliases:
            raise Refused("no_answers", f"question {q} has no answers ({name})")
        for a in aliases:
            if not isinstance(a, str):
                raise Refused("non_string", f"an answer of question {q} is not a string ({type(a).__name__} {a!r})")
            if not a.strip():
                raise Refused("no_answers", f"question {q} has an empty answer alias ({name})")
        out.append(tuple(a.strip() for a in aliases))
    return tuple(out)


# --- chunking -------------------------------------------------------------------------------
def split_units(text: str) -> list[str]:
    """Cut ``text`` at sentence ends and before blank lines; the units concatenate back to ``text``.

    Whitespace belongs to the unit it precedes; a whitespace-only piece joins the next unit.
    """
    cuts = {m.end() for m in _SENTENCE_END.finditer(text)} | {m.start() for m in _BLANK_LINE.finditer(text)}
    units, start = [], 0
    for cut in sorted(c for c in cuts if 0 < c < len(text)):
        if text[start:cut].strip():
            units.append(text[start:cut])
            start = cut
    tail = text[start:]
    if tail.strip() or not units:
        units.append(tail)
    else:
        units[-1] += tail
    return units


def chunk_text(text: str, tokenizer: Any, max_tokens: int) -> list[str]:
    """Chunks of ``text`` of at most ``max_tokens`` tokens each (see module docstring), in order."""
    if max_tokens < 1:
        raise ValueError(f"--chunk-tokens must be >= 1, got {max_tokens}")
    count = _counter(tokenizer)
    units = split_units(text)
    sizes = [len(ids) for ids in tokenizer(units, add_special_tokens=False)["input_ids"]]
    chunks: list[str] = []
    start = 0
    while start < len(units):
        end = _longest_run(units, sizes, start, count, max_tokens)
        piece = "".join(units[start:end]).strip()
        chunks += [piece] if count(piece) <= max_tokens else _split_between_tokens(piece, tokenizer, max_tokens)
        start = end
    return chunks


def _longest_run(units: Sequence[str], sizes: Sequence[int], start: int, count: Callable[[str], int],
                 max_tokens: int) -> int:
    """``end`` of the longest run ``units[start:end]`` (at least one unit) whose stripped text fits.

    Starts from the units' own token counts (``sizes``), then checks the exact count of the joined
    text both ways: counts of concatenated text are not quite additive.
    """
    end, estimate = start + 1, sizes[start]
    while end < len(units) and estimate + sizes[end] <= max_tokens:
        estimate, end = estimate + sizes[end], end + 1

    def fits(e: int) -> bool:
        return count("".join(units[start:e]).strip()) <= max_tokens

    while end > start + 1 and not fits(end):
        end -= 1
    if fits(end):
        while end < len(units) and fits(end + 1):
            end += 1
    return end


def _fitting(piece: str, count: Callable[[str], int], max_tokens: int) -> str | None:
    """``piece`` stripped, or only right-stripped (a leading space may be part of its first token), if it fits."""
    return next((p for p in (piece.strip(), piece.rstrip()) if count(p) <= max_tokens), None)


def _counter(tokenizer: Any) -> Callable[[str], int]:
    return lambda s: len(tokenizer.encode(s, add_special_tokens=False))


def _split_between_tokens(text: str, tokenizer: Any, max_tokens: int) -> list[str]:
    """A unit longer than ``max_tokens``: cut at token starts (never inside a token), each piece checked.

    A cut is a token's start offset that lies past the previous token (the byte tokens of one character
    share offsets and are never separated).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("chunking needs a fast tokenizer (character offsets of tokens)")
    count = _counter(tokenizer)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    cuts = [(0, 0)] + [(s, i) for i, (s, _) in enumerate(offsets)  # (character position, token index)
                       if i and s > offsets[i - 1][0] and s >= offsets[i - 1][1]] + [(len(text), len(offsets))]
    pieces, c = [], 0
    while c < len(cuts) - 1:
        n = c
        while n + 1 < len(cuts) and cuts[n + 1][1] - cuts[c][1] <= max_tokens:
            n += 1
        piece = _fitting(text[cuts[c][0]:cuts[n][0]], count, max_tokens) if n > c else None
        while n > c + 1 and piece is None:  # re-encoding a piece alone may take a token more
            n -= 1
            piece = _fitting(text[cuts[c][0]:cuts[n][0]], count, max_tokens)
        if piece is None:
            raise ValueError(f"--chunk-tokens {max_tokens} is too small: {text[cuts[c][0]:][:40]!r}... "
                             "cannot be cut between tokens into pieces that fit")
        pieces += [piece] if piece else []
        c = n
    return pieces


# --- records -> rows ------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvertResult:
    """Rows written, refusals ``(row, kind, message)``, and per-row statistics of the rows kept."""

    rows: tuple[dict, ...]
    refusals: tuple[tuple[int, str, str], ...]
    chunk_counts: tuple[int, ...]
    chunk_tokens: tuple[int, ...]  # every chunk of every row
    prompt_tokens: tuple[int, ...]  # q of every row, rendered with the chat template when there is one

    def summary(self, max_tokens: int) -> list[str]:
        """The printed summary: every refusal with its input row, then statistics (CLI prints a last line)."""
        lines = [f"refused row {i}: {message}" for i, _, message in self.refusals]
        if self.refusals:
            kinds = sorted({k for _, k, _ in self.refusals})
            lines.append("refusals by class: " + " ".join(
                f"{k}={sum(r[1] == k for r in self.refusals)}" for k in kinds))
        n_q = [len(r["extra_info"]["questions"]) for r in self.rows]
        lines.append(f"rows: {len(self.rows)}" + (f" (questions per row {_stats(n_q, '.2f')})" if n_q else ""))
        if self.rows:
            lines += [f"chunks per episode: {_stats(self.chunk_counts, '.2f')}",
                      f"tokens per chunk: {_stats(self.chunk_tokens, '.1f')} (limit {max_tokens})",
                      f"q tokens: {_stats(self.prompt_tokens, '.1f')} (data.max_prompt_length must be >= "
                      f"{max(self.prompt_tokens)})"]
        return lines

    def last_line(self) -> str:
        mean = sum(self.chunk_counts) / len(self.chunk_counts) if self.chunk_counts else 0.0
        return (f"converted rows={len(self.rows)} refused={len(self.refusals)} chunks_mean={mean:.2f} "
                f"chunk_tokens_max={max(self.chunk_tokens, default=0)}")


def _stats(values: Sequence[float], fmt: str) -> str:
    return f"min {min(values)} mean {sum(values) / len(values):{fmt}} max {max(values)}"


def convert_records(records: Sequence[Any], tokenizer: Any, chunk_tokens: int, fmt: str = "auto",
                    split: str = "train", source: str = "input", max_chunks: int | None = None,
                    prompts: MemoryPrompts = MemoryPrompts()) -> ConvertResult:
    """Convert records (input row i = ``records[i]``) to agent rows; refused rows are listed, not raised."""
    if max_chunks is not None and max_chunks < 1:
        raise ValueError(f"--max-chunks must be >= 1, got {max_chunks}")
    rows, refusals, counts, sizes, q_sizes = [], [], [], [], []
    count = _counter(tokenizer)
    for i, raw in enumerate(records):
        try:
            record, chunks = _convert_one(raw, tokenizer, chunk_tokens, fmt, max_chunks)
        except Refused as refused:
            refusals.append((i, refused.kind, str(refused)))
            continue
        except ValueError as e:  # a setting that no row can meet (e.g. --chunk-tokens too small)
            raise ValueError(f"row {i}: {e}") from None
        row = episode_row(f"{SOURCE_PREFIX}/{source}", record.questions, record.answer_sets, chunks, len(rows),
                          split, f"{split}-{len(rows)}", prompts, extra={"source_row": i})
        parse_row(row["extra_info"], row["reward_model"], where=f"row {i}")  # the agent loop's own gate
        rows.append(row)
        counts.append(len(chunks))
        sizes += [count(c) for c in chunks]
        q_sizes.append(count(_render(tokenizer, row["prompt"])))
    return ConvertResult(tuple(rows), tuple(refusals), tuple(counts), tuple(sizes), tuple(q_sizes))


def _render(tokenizer: Any, prompt: list[dict]) -> str:
    """``q`` as the agent loop encodes it (``agent.context``): the chat template's text, if any."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=False)
    return prompt[-1]["content"]


def _convert_one(raw: Any, tokenizer: Any, chunk_tokens: int, fmt: str,
                 max_chunks: int | None) -> tuple[QARecord, list[str]]:
    record = extract(raw, fmt)
    chunks = chunk_text(record.context, tokenizer, chunk_tokens)
    if max_chunks is not None and len(chunks) > max_chunks:
        raise Refused("too_many_chunks", f"the context yields {len(chunks)} chunks of <= {chunk_tokens} tokens, "
                                         f"more than --max-chunks {max_chunks}")
    return record, chunks
