"""Source formats of long-context QA records -> one validated :class:`QARecord` (or a :class:`Refused`).

Each source format maps a source's own field names onto the generic ones (context, question, answers, answer
mode, source id); the generic reader (:func:`generic`) then validates them. ``--format auto``
recognises a record's source format by its fields, in this order:

==============  ================================================================  =====================
format          recognised by (fields as the source writes them)                  answer mode
==============  ================================================================  =====================
ruler           ``input`` + ``outputs`` (NVIDIA RULER ``scripts/data/prepare.py``:  all-of values, except
                documents inside ``input``, no ``context``; MemAgent's             qa: any-of aliases
                ``ruler_data_prepare.py``: ``context`` separate, a string or a
                list of document indices into ``--corpus``)
longbench_v2    ``choice_A`` .. ``choice_D`` + ``answer`` (a letter) + ``question``  any (the option text)
                + ``context``
hotpotqa        ``question`` + ``answer`` (one string) + ``context`` as
                ``[[title, [sentence, ...]], ...]`` (distractor JSON) or
                ``{"title": [...], "sentences": [[...], ...]}`` (parquet)         any
dataset_process ``question`` + ``solution`` (answers) + ``context`` (MemAgent's
                ``taskutils/memory_data/dataset_process.py``)                     any
memagent        ``context`` + ``input`` | ``extra_info.question`` | ``prompt`` +
                ``answers`` | ``outputs`` | ``reward_model.ground_truth``
                (MemAgent eval json and training parquet; LongBench)              any
jsonl           ``context`` + ``question`` + ``answers`` (+ ``answer_mode``;       any, or the record's
                ``auto`` also takes ``answer``, one string, as the answers)
==============  ================================================================  =====================

RULER's instruction text is stripped from the question (``--keep-instructions`` keeps it): of its
five templates (``RULER_TEMPLATES``, as NVIDIA's and MemAgent's ``constants.py`` write them) the
question is the sentence that asks (niah: "What are all the special magic numbers for X mentioned in
the provided text?"; vt, cwe, fwe, qa: the text after "Question:", or after "Answer the question
based on the given documents." in MemAgent's qa); the preamble ("Some special magic numbers are
hidden ... memorize it.") goes. A RULER record whose ``input`` matches no template keeps it whole
as the question (mode any; listed in the summary). The source's own id (``_id``, ``id``, ``index``)
is carried as ``source_id``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from verl_memopd.tasks.reward import ANSWER_MODES

__all__ = [
    "REFUSALS",
    "Refused",
    "QARecord",
    "GENERIC_FORMATS",
    "SOURCE_FORMATS",
    "RULER_TEMPLATES",
    "Options",
    "extract",
    "join_documents",
    "DOCUMENT",
]

#: Refusal classes, as printed in the summary.
REFUSALS = {
    "bad_record": "the line/element is not a JSON object",
    "missing_field": "no context, question or answers field",
    "non_string": "context, a document, a question or an answer alias is not a string",
    "empty_context": "the context (or one of its documents) is empty",
    "empty_question": "a question is empty",
    "no_answers": "a question has no answers (or an empty alias)",
    "extra_answers": "more answer lists than questions",
    "needs_corpus": "the context is a list of document indices and no --corpus holds them",
    "bad_answer_mode": "answer_mode is not one of any, all (or not one per question)",
    "bad_choice": "a LongBench v2 answer letter without its choice_<letter> text",
    "too_many_chunks": "the context yields more chunks than --max-chunks",
}

DOCUMENT = "Document {i}:\n{doc}"  # MemAgent's DOCUMENT_PROMPT (taskutils/memory_data/processing.py)


class Refused(ValueError):
    """A record that cannot be converted: ``kind`` is one of :data:`REFUSALS`."""

    def __init__(self, kind: str, message: str):
        if kind not in REFUSALS:
            raise KeyError(f"unknown refusal {kind!r}; valid: {sorted(REFUSALS)}")
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@dataclass(frozen=True)
class QARecord:
    """One input episode: the context text, K questions, K answer lists and K answer modes.

    ``source_format`` names the format that read it; ``template`` the RULER template stripped from (or kept
    in) its question, if any; ``source_id`` the source's own id as text.
    """

    context: str
    questions: tuple[str, ...]
    answer_sets: tuple[tuple[str, ...], ...]
    answer_modes: tuple[str, ...] = ()
    source_id: str | None = None
    source_format: str = "jsonl"
    template: str | None = None

    def __post_init__(self) -> None:
        if not self.answer_modes:
            object.__setattr__(self, "answer_modes", ("any",) * len(self.answer_sets))


@dataclass(frozen=True)
class Options:
    """How records are read: ``answer_mode`` auto (the source format's) | any | all (every question);
    ``keep_instructions`` keeps RULER's instruction text in the question; ``corpus`` the documents
    that index contexts point into (``--corpus``, in MemAgent's order: :func:`tasks.readers.read_corpus`)."""

    answer_mode: str = "auto"
    keep_instructions: bool = False
    corpus: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.answer_mode not in ("auto", *ANSWER_MODES):
            raise ValueError(f"--answer-mode {self.answer_mode!r}: expected auto, {', '.join(ANSWER_MODES)}")


#: Where the generic formats look for each field (first present wins; dots = nesting).
GENERIC_FORMATS: dict[str, dict[str, tuple[str, ...]]] = {
    "jsonl": {"context": ("context",), "question": ("question",), "answers": ("answers",)},
    "memagent": {
        "context": ("context",),
        "question": ("input", "extra_info.question", "prompt"),
        "answers": ("answers", "outputs", "reward_model.ground_truth"),
    },
    "auto": {
        "context": ("context",),
        "question": ("question", "input", "extra_info.question", "prompt"),
        "answers": ("answers", "outputs", "solution", "reward_model.ground_truth", "answer"),
    },
}
_ID_FIELDS = ("_id", "id", "index", "extra_info.index")


def _field(record: Mapping, names: Sequence[str]) -> tuple[str, Any] | None:
    """The first of ``names`` (dotted = nested) present and not null in ``record``: (name, value)."""
    for name in names:
        value: Any = record
        for part in name.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if value is not None:
            return name, value
    return None


def _source_id(record: Mapping) -> str | None:
    hit = _field(record, _ID_FIELDS)
    return None if hit is None else str(hit[1])


# --- the generic reader ---------------------------------------------------------------------
def generic(
    record: Mapping,
    fmt: str,
    options: Options,
    names: Mapping[str, Sequence[str]] | None = None,
    source_format: str | None = None,
    modes: Any = None,
    template: str | None = None,
    question: Any = None,
    context: Any = None,
) -> QARecord:
    """Validate ``record`` under the field names of ``fmt`` (or ``names``); ``question`` / ``context``
    replace the record's when a source format has computed them."""
    names = names or GENERIC_FORMATS[fmt]
    found = {key: _field(record, names[key]) for key in ("context", "question", "answers")}
    if question is not None:
        found["question"] = ("question", question)
    if context is not None:
        found["context"] = ("context", context)
    missing = [f"{key} ({' | '.join(names[key])})" for key, hit in found.items() if hit is None]
    if missing:
        raise Refused(
            "missing_field",
            "no " + ", no ".join(missing) + f" [--format {fmt}]; the record has "
            f"fields {sorted(record)}: rename them to context, question, answers, or see docs/data.md "
            f"for the formats read",
        )
    (_, ctx), (q_name, q_value), (a_name, a_value) = found["context"], found["question"], found["answers"]
    questions, single = _questions(q_value, q_name)
    answer_sets = _answer_sets(a_value, a_name, len(questions), single)
    if modes is None and "answer_mode" in record:
        modes = record["answer_mode"]
    return QARecord(
        _context(ctx, options.corpus),
        questions,
        answer_sets,
        _modes(modes, len(questions), options.answer_mode),
        _source_id(record),
        source_format or fmt,
        template,
    )


def _modes(value: Any, k: int, forced: str) -> tuple[str, ...]:
    if forced != "auto":
        return (forced,) * k
    if value is None:
        return ("any",) * k
    items = [value] * k if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or len(items) != k or any(m not in ANSWER_MODES for m in items):
        raise Refused("bad_answer_mode", f"answer_mode {value!r}: expected one of {ANSWER_MODES} or a list of {k}")
    return tuple(items)


def join_documents(documents: Sequence[str]) -> str:
    """MemAgent's convention: ``"Document 1:\\n<d1>\\n\\nDocument 2:\\n<d2>..."``."""
    return "\n\n".join(DOCUMENT.format(i=i, doc=d.strip()) for i, d in enumerate(documents, 1))


def _context(value: Any, corpus: Sequence[str] | None) -> str:
    if isinstance(value, str):
        if not value.strip():
            raise Refused("empty_context", "context is empty")
        return value
    if not isinstance(value, (list, tuple)):
        raise Refused("non_string", f"context must be a string or a list of documents, got {type(value).__name__}")
    if not value:
        raise Refused("empty_context", "context is an empty list of documents")
    if all(isinstance(d, int) and not isinstance(d, bool) for d in value):
        value = _from_corpus(value, corpus)
    for i, doc in enumerate(value, 1):
        if not isinstance(doc, str):
            raise Refused("non_string", f"document {i} of the context is not a string ({type(doc).__name__})")
        if not doc.strip():
            raise Refused("empty_context", f"document {i} of the context is empty")
    return join_documents(value)


def _from_corpus(indices: Sequence[int], corpus: Sequence[str] | None) -> list[str]:
    if corpus is None:
        raise Refused(
            "needs_corpus",
            f"context is a list of {len(indices)} document indices (MemAgent's RULER qa "
            "rows over 2M tokens store indices); pass --corpus FILE: the file they index (MemAgent: "
            "squad.json for qa_1, hotpotqa_dev.json for qa_2) or a JSON array of document strings",
        )
    bad = [i for i in indices if not 0 <= i < len(corpus)]
    if bad:
        raise Refused("needs_corpus", f"document indices {bad[:5]} are outside --corpus ({len(corpus)} documents)")
    return [corpus[i] for i in indices]


def _questions(value: Any, name: str) -> tuple[tuple[str, ...], bool]:
    """The questions, and whether there was a single one (a string, not a list)."""
    if name == "prompt":  # MemAgent's training rows: [{"role": "user", "content": question}]
        users = (
            [m for m in value if isinstance(m, Mapping) and m.get("role") == "user"]
            if isinstance(value, (list, tuple))
            else []
        )
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
    """K answer tuples: one question takes a flat list (or ``[[...]]``), K questions take K entries."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise Refused("non_string", f"{name} must be a list of answers, got {type(value).__name__}")
    nested = any(isinstance(v, (list, tuple)) for v in value)
    if single and not nested:
        value = [value]
    if len(value) < k or not value:
        raise Refused(
            "no_answers",
            f"question {len(value) + 1} has no answers ({k} questions, {len(value)} answer lists in {name})",
        )
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


# --- RULER ----------------------------------------------------------------------------------
_V = r"[\w-]+"
#: (task, answer mode, pattern): RULER's task templates (NVIDIA ``scripts/data/synthetic/constants.py``,
#: MemAgent ``taskutils/memory_data/synthetic/constants.py``, singular niah variants included).
#: Groups: ``context`` (the documents, when inside ``input``) and ``question`` (what is kept).
RULER_TEMPLATES: tuple[tuple[str, str, re.Pattern], ...] = tuple(
    (task, mode, re.compile(p, re.S))
    for task, mode, p in (
        (
            "niah",
            "all",
            rf"(?:Some|A) special magic {_V} (?:are|is) hidden within the following text\. Make sure to "
            rf"memorize it\.(?: I will quiz you about the {_V} afterwards\.)?(?P<context>.*?)"
            rf"(?P<question>What (?:are all|is) the special magic {_V} for .+? mentioned in the provided "
            rf"text\?)",
        ),
        (
            "variable_tracking",
            "all",
            r"Memorize and track the chain\(s\) of variable assignment hidden in the following "
            r"text\.(?P<context>.*?)Question: (?P<question>Find all variables that are assigned "
            r"the value .+? in the text above\.)",
        ),
        (
            "common_words_extraction",
            "all",
            r"Below is a numbered list of words\. In these words, some appear more often "
            r"than others\. Memorize the ones that appear most often\.(?P<context>.*?)"
            r"Question: (?P<question>What are the \d+ most common words in the above "
            r"list\?)",
        ),
        (
            "freq_words_extraction",
            "all",
            r"Read the following coded text and track the frequency of each coded word\. "
            r"Find the three most frequently appeared coded words\.(?P<context>.*?)Question: "
            r"Do not provide any explanation\. (?P<question>Please ignore the dots '\.\.\.\.'"
            r"\. What are the three most frequently appeared words in the above coded "
            r"text\?)",
        ),
        (
            "qa",
            "any",
            r"Answer the question based on the given documents\. Only give me the answer and do not output any "
            r"other words\.\s*The following are given documents\.(?P<context>.*?)Answer the question based on "
            r"the given documents\. Only give me the answer and do not output any other words\.\s*Question: "
            r"(?P<question>.+)",
        ),
        ("qa", "any", r"Answer the question based on the given documents\.(?P<context>)\s*(?P<question>.+)"),
    )
)


def ruler(record: Mapping, options: Options) -> QARecord:
    """A RULER record (NVIDIA: documents in ``input``; MemAgent: ``context`` separate)."""
    text = record.get("input")
    if not isinstance(text, str):
        return generic(record, "memagent", options, source_format="ruler")
    for task, mode, pattern in RULER_TEMPLATES:
        m = pattern.search(text)
        if m is None:
            continue
        inner = m.group("context").strip()
        if options.keep_instructions:  # the input without its documents
            question = " ".join((text[: m.start("context")] + " " + text[m.end("context") :]).split())
        else:
            question = " ".join(m.group("question").split())
        context = inner if inner and record.get("context") is None else None
        return generic(
            record,
            "memagent",
            options,
            source_format="ruler",
            modes=[mode],
            template=task,
            question=question,
            context=context,
        )
    return generic(record, "memagent", options, source_format="ruler", template="unknown")


# --- LongBench v2, HotpotQA, dataset_process ------------------------------------------------
_LETTERS = "ABCD"


def longbench_v2(record: Mapping, options: Options) -> QARecord:
    """LongBench v2: the options go into the question; the gold answer is the chosen option's text."""
    choices = {c: record.get(f"choice_{c}") for c in _LETTERS if record.get(f"choice_{c}") is not None}
    letter = record.get("answer")
    if not isinstance(letter, str) or letter.strip().upper() not in choices:
        raise Refused(
            "bad_choice",
            f"answer {letter!r} is not one of the letters with a choice_<letter> field ({sorted(choices)})",
        )
    if any(not isinstance(c, str) or not c.strip() for c in choices.values()):
        raise Refused("non_string", "a choice_<letter> is empty or not a string")
    question = record.get("question")
    if isinstance(question, str) and question.strip():
        options_text = "; ".join(f"({c}) {' '.join(t.split())}" for c, t in choices.items())
        question = f"{question.strip()} Options: {options_text}. Answer with the text of the correct option."
    gold = " ".join(choices[letter.strip().upper()].split())
    return generic({**record, "answers": [gold]}, "jsonl", options, source_format="longbench_v2", question=question)


def hotpotqa(record: Mapping, options: Options) -> QARecord:
    """HotpotQA: ``[title, sentences]`` pairs or ``{title, sentences}`` -> documents "title\\ntext" (as
    MemAgent's ``read_hotpotqa``: the sentences joined without a separator, they carry their own spaces)."""
    ctx = record.get("context")
    if isinstance(ctx, Mapping):
        titles, sentences = ctx.get("title"), ctx.get("sentences")
        if (
            not isinstance(titles, (list, tuple))
            or not isinstance(sentences, (list, tuple))
            or len(titles) != len(sentences)
        ):
            raise Refused("non_string", "context {title, sentences} must hold two lists of the same length")
        pairs = list(zip(titles, sentences))
    else:
        pairs = ctx
    docs = []
    for i, pair in enumerate(pairs, 1):
        if (
            not isinstance(pair, (list, tuple))
            or len(pair) != 2
            or not isinstance(pair[0], str)
            or not isinstance(pair[1], (list, tuple))
            or not all(isinstance(s, str) for s in pair[1])
        ):
            raise Refused("non_string", f"context document {i} is not [title, [sentence, ...]]")
        docs.append(f"{pair[0]}\n{''.join(pair[1])}")
    return generic(
        {**record, "answers": record.get("answer")}, "jsonl", options, source_format="hotpotqa", context=docs
    )


def _is_hotpot_context(ctx: Any) -> bool:
    if isinstance(ctx, Mapping):
        return "title" in ctx and "sentences" in ctx
    return (
        isinstance(ctx, (list, tuple))
        and bool(ctx)
        and all(isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[1], (list, tuple)) for p in ctx)
    )


#: source format name -> (recognised by, reader); ``auto`` tries them in this order, then ``memagent`` names.
SOURCE_FORMATS: dict[str, tuple[Callable[[Mapping], bool], Callable[[Mapping, Options], QARecord]]] = {
    "ruler": (lambda r: "input" in r and "outputs" in r, ruler),
    "longbench_v2": (lambda r: "choice_A" in r, longbench_v2),
    "hotpotqa": (lambda r: "answer" in r and "answers" not in r and _is_hotpot_context(r.get("context")), hotpotqa),
    "dataset_process": (
        lambda r: "solution" in r and "question" in r,
        lambda r, o: generic(
            r, "auto", o, source_format="dataset_process", names={**GENERIC_FORMATS["auto"], "answers": ("solution",)}
        ),
    ),
}


def extract(record: Any, fmt: str = "auto", options: Options = Options()) -> QARecord:
    """Validate one record in format ``fmt`` (see module docstring); raises :class:`Refused`."""
    valid = sorted([*GENERIC_FORMATS, *SOURCE_FORMATS])
    if fmt not in valid:
        raise KeyError(f"unknown format {fmt!r}; valid: {valid}")
    if not isinstance(record, Mapping):
        raise Refused("bad_record", f"expected a JSON object, got {type(record).__name__} {str(record)[:60]!r}")
    if fmt in SOURCE_FORMATS:
        return SOURCE_FORMATS[fmt][1](record, options)
    if fmt == "memagent" and SOURCE_FORMATS["ruler"][0](record):  # MemAgent's RULER files
        return ruler(record, options)
    if fmt == "auto":
        for name, (recognises, read) in SOURCE_FORMATS.items():
            if recognises(record):
                return read(record, options)
    source_format = (
        fmt
        if fmt != "auto"
        else "jsonl"
        if "question" in record
        else "longbench"
        if "all_classes" in record
        else "memagent"
    )
    return generic(record, fmt, options, source_format=source_format)
