"""Answer scoring: SQuAD-normalised token F1 and exact match (EM), and verl's reward hook.

Every question has an answer mode (:data:`ANSWER_MODES`; default ``any``):

``any``  its answers are interchangeable *aliases*: F1 and EM take the max over them (SQuAD, HotpotQA,
         LongBench, RULER's qa ``string_match_part``).
``all``  its answers are *values* that must all be given (RULER's niah multi-value / multi-query,
         variable tracking, common and frequent words; RULER's and MemAgent's ``string_match_all``):
         F1 = the share of values found in the prediction, each as whole normalised words (RULER
         counts a case-insensitive substring; whole words keep "12" from matching "123"); EM = 1 when
         every value is found. A prediction that lists more than the values is not penalised (as RULER).

An episode's score is the mean over its K questions. Normalisation is SQuAD's: lower-case, drop
punctuation and the articles a/an/the, collapse whitespace. Token F1 follows HotpotQA's
``hotpot_evaluate_v1.py`` (also MemAgent's ``taskutils/memory_eval/utils/__init__.py``): when either
side normalises to ``yes``, ``no`` or ``noanswer`` and the two differ, F1 is 0 (no partial
credit for "no" against "no idea").

verl: ``compute_score`` has the signature of a custom reward function
(``reward.custom_reward_function.path=pkg://verl_memopd.tasks.reward``,
``reward.custom_reward_function.name=compute_score``) and returns a dict whose ``score`` is
the F1 (verl logs the other keys as reward extra info). It parses ``<number>: <answer>``
lines from the decoded response, the last line per number winning (see
:func:`verl_memopd.tasks.prompts.parse_answers`). The memory agent loop does not go through
it: it scores the exact text of its final (answer) call with :func:`score_answers` itself.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

from verl_memopd.tasks.prompts import parse_answers

__all__ = [
    "ANSWER_MODES",
    "normalize_answer",
    "token_f1",
    "exact_match",
    "Score",
    "score_answers",
    "answer_recall",
    "as_answer_sets",
    "as_answer_modes",
    "values_found",
    "compute_score",
]

#: ``any``: the answers of a question are aliases (max over them); ``all``: values that must all be given.
ANSWER_MODES = ("any", "all")

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_CLOSED_ANSWERS = frozenset({"yes", "no", "noanswer"})  # HotpotQA: all or nothing
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower-case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: str, truth: str) -> float:
    """Token-level F1 between two answers after normalisation (0.0 when either is empty; HotpotQA's
    yes/no/noanswer rule, see module docstring)."""
    pred_text, gold_text = normalize_answer(prediction), normalize_answer(truth)
    if (pred_text in _CLOSED_ANSWERS or gold_text in _CLOSED_ANSWERS) and pred_text != gold_text:
        return 0.0
    pred, gold = pred_text.split(), gold_text.split()
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


@dataclass(frozen=True)
class Score:
    """Episode score: mean over the K questions of the per-question max over aliases."""

    f1: float
    em: float
    per_question_f1: tuple[float, ...]


def as_answer_sets(ground_truth: Any, where: str) -> tuple[tuple[str, ...], ...]:
    """Validate ground truth as K >= 1 non-empty lists of non-empty alias strings.

    Accepts lists, tuples or numpy arrays (parquet round trips); raises ``ValueError`` naming
    ``where`` (the row) and the question otherwise.
    """
    if isinstance(ground_truth, (str, bytes)) or not hasattr(ground_truth, "__len__") or len(ground_truth) == 0:
        raise ValueError(f"{where}: ground_truth must be a non-empty list of answer-alias lists, got {ground_truth!r}")
    out = []
    for k, aliases in enumerate(ground_truth):
        if isinstance(aliases, (str, bytes)):
            raise ValueError(
                f"{where}: question {k + 1}'s answers are the string {aliases!r}, not a list of aliases "
                "(ground_truth is one alias list per question: [[alias, ...], ...])"
            )
        if not hasattr(aliases, "__len__") or len(aliases) == 0:
            raise ValueError(f"{where}: question {k + 1} has no answers (got {aliases!r})")
        if any(not isinstance(a, str) or not a.strip() for a in aliases):
            raise ValueError(f"{where}: question {k + 1} has an empty or non-string answer in {list(aliases)!r}")
        out.append(tuple(aliases))
    return tuple(out)


def as_answer_modes(modes: Any, k: int, where: str) -> tuple[str, ...]:
    """K answer modes: ``None`` (all ``any``), or a list of K names from :data:`ANSWER_MODES`."""
    if modes is None:
        return ("any",) * k
    if isinstance(modes, (str, bytes)) or not hasattr(modes, "__len__") or len(modes) != k:
        raise ValueError(
            f"{where}: answer_modes must be a list of {k} modes {ANSWER_MODES} (one per question), got {modes!r}"
        )
    for q, mode in enumerate(modes, 1):
        if mode not in ANSWER_MODES:
            raise ValueError(f"{where}: answer mode of question {q} is {mode!r}; valid: {ANSWER_MODES}")
    return tuple(str(m) for m in modes)


def values_found(text: str, values: Sequence[str]) -> float:
    """Share of ``values`` that occur in ``text`` as whole normalised words (mode ``all``)."""
    words = f" {normalize_answer(text)} "
    return sum(f" {normalize_answer(v)} " in words for v in values) / len(values)


def score_answers(
    predictions: Sequence[str], answer_sets: Sequence[Sequence[str]], modes: Sequence[str] | None = None
) -> Score:
    """Score K predictions against K answer sets (lengths must match) under K answer modes (default ``any``)."""
    if len(predictions) != len(answer_sets) or not answer_sets:
        raise ValueError(f"score_answers: {len(predictions)} predictions for {len(answer_sets)} questions")
    modes = as_answer_modes(modes, len(answer_sets), "score_answers")
    f1s, ems = [], []
    for p, answers, mode in zip(predictions, answer_sets, modes):
        if mode == "all":
            found = values_found(p, answers)
            f1s.append(found)
            ems.append(float(found == 1.0))
        else:
            f1s.append(max(token_f1(p, a) for a in answers))
            ems.append(max(exact_match(p, a) for a in answers))
    k = len(answer_sets)
    return Score(f1=sum(f1s) / k, em=sum(ems) / k, per_question_f1=tuple(f1s))


def answer_recall(text: str, answer_sets: Sequence[Sequence[str]], modes: Sequence[str] | None = None) -> float:
    """Mean over the K questions of how much of its answer occurs in ``text`` as whole normalised words:
    1 if any alias does (mode ``any``), the share of its values that do (mode ``all``).

    Of a memory: how much of what the answer call needs it still holds (a diagnostic, not a reward; a
    closed answer such as ``yes`` counts only if the word is there).
    """
    if not answer_sets:
        raise ValueError("answer_recall: no questions")
    modes = as_answer_modes(modes, len(answer_sets), "answer_recall")
    words = f" {normalize_answer(text)} "
    held = [
        values_found(text, answers)
        if mode == "all"
        else float(any(f" {normalize_answer(a)} " in words for a in answers))
        for answers, mode in zip(answer_sets, modes)
    ]
    return sum(held) / len(answer_sets)


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs: Any
) -> dict[str, float]:
    """verl custom reward function: ``{"score": F1, "f1": F1, "em": EM}`` for one response
    (answer modes from ``extra_info.answer_modes`` when the row has them)."""
    where = f"row {extra_info.get('index', '?')} ({data_source})" if isinstance(extra_info, dict) else data_source
    answer_sets = as_answer_sets(ground_truth, where)
    modes = as_answer_modes(
        extra_info.get("answer_modes") if isinstance(extra_info, dict) else None, len(answer_sets), where
    )
    s = score_answers(parse_answers(solution_str, len(answer_sets)), answer_sets, modes)
    return {"score": s.f1, "f1": s.f1, "em": s.em}
