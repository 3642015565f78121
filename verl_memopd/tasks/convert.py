"""Your own long-context QA -> the agent loop's parquet rows (one row per episode).

Input (``tasks.readers``): JSON lines, a JSON array or one JSON record, or parquet, gzip or not, the
kind read from the content; one record = one episode. Source formats (``tasks.formats``, ``--format``):
RULER (NVIDIA's and MemAgent's), LongBench v2, HotpotQA (distractor JSON, parquet), MemAgent's
``dataset_process.py`` rows, MemAgent's eval json / training parquet and LongBench (``memagent``),
and the plain one (``jsonl``)::

    jsonl     context: str | [str, ...]   question: str | [str x K]   answers: [alias, ...] | [[alias, ...] x K]
              answer_mode (optional): "any" | "all" | ["any" | "all" x K]
    memagent  context; input | extra_info.question | prompt; answers | outputs | reward_model.ground_truth
              (github.com/BytedTsinghua-SIA/MemAgent taskutils/memory_data/: processing.py, convert_to_eval.py)
    auto      recognises the source format of each record (``tasks.formats``), else either name set above

A list ``context`` is a list of documents, joined with MemAgent's convention ("Document {i}:\\n{doc}",
``\\n\\n`` between); a list of integers is a list of document indices into ``--corpus``. With one
question (a string), ``answers`` is its answer list (or a single string); with K questions (a list),
``answers`` holds K entries, each a list or a single string. Answer modes (``tasks.reward``): ``any``
= the answers are aliases, ``all`` = values that must all be given (RULER's multi-value tasks).

Chunking: the context is cut into units at sentence ends -- ``.!?`` plus closing quotes/brackets before
whitespace, except after an abbreviation or initial ("U.S.", "Dr.", "J.") or before a lower-case
word; and the ends of other scripts, ``。！？`` etc., with no space needed -- and before blank lines
(document starts; a "Document i:" header and its title line stay with the text that follows). Units
are packed greedily, in order, into chunks of at most N tokens of the model's own tokenizer
(``len(tokenizer.encode(chunk, add_special_tokens=False))``, every chunk checked). A unit longer than
N tokens is cut between tokens, at a word boundary when one fits (a token is never split). Chunks
are the original text between cuts, stripped of surrounding whitespace.

Refusals (a record is converted whole or refused with its place in the file and one reason;
nothing is dropped silently): see :data:`REFUSALS`. Output rows: ``verl_memopd.tasks.dataset``
(``episode_row``), with ``data_source = "memopd_convert/<input file stem>"``, ``extra_info.answer_modes``
and ``extra_info.source_row`` / ``source_file`` / ``source_id`` (the record's index in its file, the
file, the source's own ``_id`` / ``id`` / ``index``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from verl_memopd.tasks.dataset import episode_row, parse_row
from verl_memopd.tasks.formats import (
    DOCUMENT,
    GENERIC_FORMATS,
    REFUSALS,
    SOURCE_FORMATS,
    Options,
    QARecord,
    Refused,
    extract,
    join_documents,
)
from verl_memopd.tasks.prompts import MemoryPrompts
from verl_memopd.tasks.readers import Located, read_located

__all__ = [
    "GENERIC_FORMATS",
    "FORMAT_NAMES",
    "REFUSALS",
    "Refused",
    "QARecord",
    "Options",
    "read_records",
    "extract",
    "join_documents",
    "split_units",
    "chunk_text",
    "ConvertResult",
    "convert_records",
    "SOURCE_PREFIX",
    "DOCUMENT",
    "LARGE_CONTEXT_CHARS",
    "MANY_CHUNKS",
    "write_rows_atomic",
]

#: ``data_source`` prefix of converted rows; the input file's stem follows after a slash.
SOURCE_PREFIX = "memopd_convert"
#: ``--format`` choices.
FORMAT_NAMES = tuple(sorted([*GENERIC_FORMATS, *SOURCE_FORMATS]))
#: A context longer than this (characters) is announced before it is cut (about 100k tokens).
LARGE_CONTEXT_CHARS = 400_000
#: Rows with more chunks than this are listed after conversion (one memory call per chunk).
MANY_CHUNKS = 200

# Latin sentence ends: . ! ? (closing quotes/brackets), then whitespace. Other scripts: no space needed.
_SENTENCE_END = re.compile(r"[.!?\u2026][\"'\u201d\u2019)\]]*(?=\s)")
_WIDE_END = re.compile(
    r"[\u3002\uff01\uff1f\uff0e\uff61\u0964\u0965\u061f\u06d4]"  # 。！？．｡ । ॥ ؟ ۔
    r"[\u300d\u300f\u201d\u2019\uff09)\]\u3011\"']*"
)
_BLANK_LINE = re.compile(r"\n[ \t]*\n")
_NEXT_CHAR = re.compile(r"\s*(\S)")
#: Words after which a period does not end a sentence (lower-case, without the period).
ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof st mt jr sr vs fig figs gen gov sen rep lt col sgt capt cpt maj adm approx dept univ inc "
    "ltd corp bros vol pp rev hon pres e.g i.e cf al ca jan feb apr jun jul aug sep sept oct nov dec".split()
)
_INITIALS = re.compile(r"(?:[A-Za-z]\.)*[A-Za-z]")  # "U.S" of "U.S.", "J" of "J. R. R."


def read_records(path: str | Path) -> list[Any]:
    """The record values of a file, in order (``tasks.readers.read_located`` without the places)."""
    return [r.value for r in read_located(path)]


# --- chunking -------------------------------------------------------------------------------
def sentence_ends(text: str) -> list[int]:
    """Character offsets just after each sentence end of ``text`` (rules in the module docstring)."""
    ends = [m.end() for m in _WIDE_END.finditer(text)]
    for m in _SENTENCE_END.finditer(text):
        if text[m.start()] == ".":
            k = m.start()
            while k > 0 and not text[k - 1].isspace() and m.start() - k < 24:
                k -= 1
            word = text[k : m.start()].lstrip("\"'(\u201c\u2018[")
            if _INITIALS.fullmatch(word) or word.lower() in ABBREVIATIONS:
                continue
        after = _NEXT_CHAR.match(text, m.end())
        if after and after.group(1).islower():  # "... approx. three" or "e.g. the": the sentence goes on
            continue
        ends.append(m.end())
    return sorted(ends)


def split_units(text: str) -> list[str]:
    """Cut ``text`` at sentence ends and before blank lines; the units concatenate back to ``text``.

    Whitespace belongs to the unit it precedes; a whitespace-only piece joins the next unit.
    """
    cuts = set(sentence_ends(text)) | {m.start() for m in _BLANK_LINE.finditer(text)}
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


def chunk_text(text: str, tokenizer: Any, max_tokens: int, limit: int | None = None) -> list[str]:
    """Chunks of ``text`` of at most ``max_tokens`` tokens each (see module docstring), in order.

    ``limit``: stop once there are more than ``limit`` chunks (the caller refuses the row; a huge
    context is then not cut to the end).
    """
    if max_tokens < 1:
        raise ValueError(f"--chunk-tokens must be >= 1, got {max_tokens}")
    count = _counter(tokenizer)
    units = split_units(text)
    sizes = [len(ids) for ids in tokenizer(units, add_special_tokens=False)["input_ids"]]
    chunks: list[str] = []
    start = 0
    while start < len(units) and (limit is None or len(chunks) <= limit):
        end = _longest_run(units, sizes, start, count, max_tokens)
        piece = "".join(units[start:end]).strip()
        chunks += [piece] if count(piece) <= max_tokens else _split_between_tokens(piece, tokenizer, max_tokens)
        start = end
    return chunks


def _longest_run(
    units: Sequence[str], sizes: Sequence[int], start: int, count: Callable[[str], int], max_tokens: int
) -> int:
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


def _no_space_script(ch: str) -> bool:
    """Scripts written without spaces between words (CJK, kana, hangul): every character is a boundary."""
    o = ord(ch)
    return 0x2E80 <= o <= 0x9FFF or 0xAC00 <= o <= 0xD7AF or 0xF900 <= o <= 0xFAFF or 0xFF00 <= o <= 0xFFEF


def _word_boundary(text: str, i: int) -> bool:
    """Whether a cut before ``text[i]`` falls between words (never inside a word of a spaced script)."""
    a, b = text[i - 1], text[i]
    return not (a.isalnum() and b.isalnum()) or _no_space_script(a) or _no_space_script(b)


def _split_between_tokens(text: str, tokenizer: Any, max_tokens: int) -> list[str]:
    """A unit longer than ``max_tokens``: cut at token starts (never inside a token), at a word boundary
    when one lies within the budget, each piece checked.

    A cut is a token's start offset that lies past the previous token (the byte tokens of one character
    share offsets and are never separated).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("chunking needs a fast tokenizer (character offsets of tokens)")
    count = _counter(tokenizer)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    cuts = (
        [(0, 0)]
        + [
            (s, i)
            for i, (s, _) in enumerate(offsets)  # (character position, token index)
            if i and s > offsets[i - 1][0] and s >= offsets[i - 1][1]
        ]
        + [(len(text), len(offsets))]
    )
    pieces, c = [], 0
    while c < len(cuts) - 1:
        n = c
        while n + 1 < len(cuts) and cuts[n + 1][1] - cuts[c][1] <= max_tokens:
            n += 1
        within = range(n, c, -1)  # candidate ends, longest first: word boundaries, then any token start
        candidates = [e for e in within if cuts[e][0] == len(text) or _word_boundary(text, cuts[e][0])] + [
            e for e in within if not (cuts[e][0] == len(text) or _word_boundary(text, cuts[e][0]))
        ]
        piece, end = None, c
        for e in candidates:  # re-encoding a piece alone may take a token more
            piece = _fitting(text[cuts[c][0] : cuts[e][0]], count, max_tokens)
            if piece is not None:
                end = e
                break
        if piece is None:
            raise ValueError(
                f"--chunk-tokens {max_tokens} is too small: {text[cuts[c][0] :][:40]!r}... "
                "cannot be cut between tokens into pieces that fit"
            )
        pieces += [piece] if piece else []
        c = end
    return pieces


# --- records -> rows ------------------------------------------------------------------------
@dataclass(frozen=True)
class Refusal:
    """A refused record: its index among the records, class, message and place (``FILE line L``...)."""

    index: int
    kind: str
    message: str
    where: str


@dataclass(frozen=True)
class ConvertResult:
    """Rows written, refusals, warnings, and per-row statistics of the rows kept.

    ``needs``: per row ``(M, F, E)`` (``tasks.needs.episode_needs``; empty without a chat template).
    """

    rows: tuple[dict, ...]
    refusals: tuple[Refusal, ...]
    chunk_counts: tuple[int, ...]
    chunk_tokens: tuple[int, ...]  # every chunk of every row
    prompt_tokens: tuple[int, ...]  # q of every row, rendered with the chat template when there is one
    warnings: tuple[str, ...] = ()
    needs: tuple[tuple[int, int, int], ...] = ()
    formats: tuple[tuple[str, str], ...] = ()  # per row: (source format, RULER template or "")

    def data_needs(self, tokenizer_name: str = ""):
        """The rows' :class:`tasks.needs.DataNeeds` (None when they could not be measured)."""
        from verl_memopd.tasks.needs import DataNeeds

        if not self.needs or len(self.needs) != len(self.rows):
            return None
        return DataNeeds(
            max(self.prompt_tokens),
            max(e for _, _, e in self.needs),
            tuple((m, f) for m, f, _ in self.needs),
            tokenizer_name,
        )

    def summary(self, max_tokens: int, memory_tokens: int = 256, answer_tokens: int = 64) -> list[str]:
        """The printed summary: every refusal with its place, then statistics (CLI prints a last line)."""
        lines = [f"refused {r.where}: {r.message}" for r in self.refusals]
        if self.refusals:
            kinds = sorted({r.kind for r in self.refusals})
            lines.append(
                "refusals by class: " + " ".join(f"{k}={sum(r.kind == k for r in self.refusals)}" for k in kinds)
            )
        lines += list(self.warnings)
        n_q = [len(r["extra_info"]["questions"]) for r in self.rows]
        lines.append(f"rows: {len(self.rows)}" + (f" (questions per row {_stats(n_q, '.2f')})" if n_q else ""))
        if not self.rows:
            return lines
        formats = sorted(set(self.formats))
        lines.append(
            "formats: "
            + " ".join(f"{fmt}{'/' + t if t else ''}={self.formats.count((fmt, t))}" for fmt, t in formats)
            + (
                ""
                if not any(t for _, t in formats)
                else "  (RULER: instructions stripped from the question unless --keep-instructions; "
                "'unknown' = no known template, the input kept whole)"
            )
        )
        modes = [m for r in self.rows for m in r["extra_info"]["answer_modes"]]
        lines.append(
            f"answer modes: any={modes.count('any')} (aliases, max over them) all={modes.count('all')} "
            "(values, share found)"
        )
        lines += [
            f"chunks per episode: {_stats(self.chunk_counts, '.2f')}",
            f"tokens per chunk: {_stats(self.chunk_tokens, '.1f')} (limit {max_tokens})",
            f"q tokens: {_stats(self.prompt_tokens, '.1f')} (data.max_prompt_length must be >= "
            f"{max(self.prompt_tokens)})",
        ]
        needs = self.data_needs()
        if needs is not None:
            lines.append(
                f"packed response: data.max_response_length (actor_rollout_ref.rollout.response_length) "
                f"must be >= {needs.response_length(memory_tokens, answer_tokens)} with "
                f"memopd.agent.memory_tokens={memory_tokens} answer_tokens={answer_tokens} (longest row, "
                f"every memory call writing its whole budget; recorded in the parquet file and checked "
                f"by the recipe before Ray starts)"
            )
        many = [c for c in self.chunk_counts if c > MANY_CHUNKS]
        if many:
            lines.append(
                f"warning: {len(many)} row(s) have more than {MANY_CHUNKS} chunks (max {max(many)}): one "
                f"memory call per chunk; --max-chunks M refuses rows with more than M chunks"
            )
        return lines

    def last_line(self) -> str:
        mean = sum(self.chunk_counts) / len(self.chunk_counts) if self.chunk_counts else 0.0
        return (
            f"converted rows={len(self.rows)} refused={len(self.refusals)} chunks_mean={mean:.2f} "
            f"chunk_tokens_max={max(self.chunk_tokens, default=0)}"
        )


def _stats(values: Sequence[float], fmt: str) -> str:
    return f"min {min(values)} mean {sum(values) / len(values):{fmt}} max {max(values)}"


def convert_records(
    records: Sequence[Any],
    tokenizer: Any,
    chunk_tokens: int,
    fmt: str = "auto",
    split: str = "train",
    source: str = "input",
    max_chunks: int | None = None,
    prompts: MemoryPrompts = MemoryPrompts(),
    options: Options = Options(),
    on_warning: Callable[[str], None] | None = None,
) -> ConvertResult:
    """Convert records to agent rows; refused rows are listed, not raised.

    A record is a value (its place: ``row i``, ``source`` names its file) or a :class:`Located` from
    ``tasks.readers`` (its place and file: ``FILE line L`` etc.; ``source`` = the file's stem when
    the place names no file). ``on_warning`` is called at once with each warning (a huge context).
    """
    if max_chunks is not None and max_chunks < 1:
        raise ValueError(f"--max-chunks must be >= 1, got {max_chunks}")
    rows, refusals, counts, sizes, q_sizes, warnings, needs, formats = [], [], [], [], [], [], [], []
    count = _counter(tokenizer)
    measure = bool(getattr(tokenizer, "chat_template", None))
    for i, item in enumerate(records):
        raw, where, stem, file_row = _place(item, i, source)
        try:
            record = extract(raw, fmt, options)
            if len(record.context) > LARGE_CONTEXT_CHARS:
                warnings.append(_large_warning(where, record.context, count, chunk_tokens, max_chunks))
                if on_warning:
                    on_warning(warnings[-1])
            chunks = chunk_text(record.context, tokenizer, chunk_tokens, max_chunks)
            if max_chunks is not None and len(chunks) > max_chunks:
                raise Refused(
                    "too_many_chunks",
                    f"the context yields more than {max_chunks} chunks of <= "
                    f"{chunk_tokens} tokens (--max-chunks {max_chunks}; cutting stopped "
                    f"at {len(chunks)})",
                )
        except Refused as refused:
            refusals.append(Refusal(i, refused.kind, str(refused), where))
            continue
        except ValueError as e:  # a setting that no row can meet (e.g. --chunk-tokens too small)
            raise ValueError(f"{where}: {e}") from None
        extra = {"source_row": file_row, "source_file": stem, "source_id": record.source_id}
        row = episode_row(
            f"{SOURCE_PREFIX}/{stem}",
            record.questions,
            record.answer_sets,
            chunks,
            len(rows),
            split,
            f"{split}-{len(rows)}",
            prompts,
            extra=extra,
            answer_modes=record.answer_modes,
        )
        parse_row(row["extra_info"], row["reward_model"], where=where)  # the agent loop's own gate
        rows.append(row)
        formats.append((record.source_format, record.template or ""))
        counts.append(len(chunks))
        sizes += [count(c) for c in chunks]
        q_sizes.append(count(_render(tokenizer, row["prompt"])))
        if measure:
            from verl_memopd.tasks.needs import episode_needs

            needs.append(episode_needs(tokenizer, row["prompt"], chunks, prompts))
    return ConvertResult(
        tuple(rows),
        tuple(refusals),
        tuple(counts),
        tuple(sizes),
        tuple(q_sizes),
        tuple(warnings),
        tuple(needs),
        tuple(formats),
    )


def _place(item: Any, i: int, source: str) -> tuple[Any, str, str, int]:
    """(value, place, file stem, index in its file) of the i-th record."""
    if isinstance(item, Located):
        return item.value, item.where, item.file or source, item.index
    return item, f"row {i}", source, i


def _large_warning(
    where: str, context: str, count: Callable[[str], int], chunk_tokens: int, max_chunks: int | None
) -> str:
    sample = context[:20_000]  # tokens per character, measured on the first 20k characters
    estimate = int(len(context) * count(sample) / len(sample) / chunk_tokens) + 1
    limit = (
        f"--max-chunks {max_chunks} stops cutting it after {max_chunks} chunks and refuses it"
        if max_chunks
        else "--max-chunks M would refuse rows with more than M chunks (and stop cutting them early)"
    )
    return (
        f"warning: {where}: a context of {len(context) / 1e6:.2f} M characters, about {estimate} chunks of "
        f"{chunk_tokens} tokens = {estimate} memory calls per episode; cutting it takes a while; {limit}"
    )


def _render(tokenizer: Any, prompt: list[dict]) -> str:
    """``q`` as the agent loop encodes it (``agent.context``): the chat template's text, if any."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=False)
    return prompt[-1]["content"]


def write_rows_atomic(rows: Sequence[dict], path: str | Path, metadata: dict[bytes, bytes] | None = None) -> int:
    """Write rows to ``path`` through a temporary file in the same folder, renamed over it when complete
    (a failed write leaves no partial file); ``metadata`` is added to the parquet schema's."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pandas(pd.DataFrame(list(rows)), preserve_index=False)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **(metadata or {})})
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return table.num_rows
