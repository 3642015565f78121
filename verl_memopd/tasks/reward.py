"""Answer scoring: SQuAD-normalised token F1 and exact match (EM), and verl's reward hook.

Per question, F1 and EM take the max over the accepted answers (aliases); an episode's
score is the mean over its K questions. Normalisation is SQuAD's: lower-case, drop
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

__all__ = ["normalize_answer", "token_f1", "exact_match", "Score", "score_answers", "answer_recall", "as_answer_sets",
           "compute_score"]

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
            raise ValueError(f"{where}: question {k + 1}'s answers are the string {aliases!r}, not a list of aliases "
                             "(ground_truth is one alias list per question: [[alias, ...], ...])")
        if not hasattr(aliases, "__len__") or len(aliases) == 0:
            raise ValueError(f"{where}: question {k + 1} has no answers (got {aliases!r})")
        if any(not isinstance(a, str) or not a.strip() for a in aliases):
            raise ValueError(f"{where}: question {k + 1} has an empty or non-string answer in {list(aliases)!r}")
        out.append(tuple(aliases))
    return tuple(out)


def score_answers(predictions: Sequence[str], answer_sets: Sequence[Sequence[str]]) -> Score:
    """Score K predictions against K alias sets (lengths must match)."""
    if len(predictions) != len(answer_sets) or not answer_sets:
        raise ValueError(f"score_answers: {len(predictions)} predictions for {len(answer_sets)} questions")
    f1s = [max(token_f1(p, a) for a in aliases) for p, aliases in zip(predictions, answer_sets)]
    ems = [max(exact_match(p, a) for a in aliases) for p, aliases in zip(predictions, answer_sets)]
    k = len(answer_sets)
    return Score(f1=sum(f1s) / k, em=sum(ems) / k, per_question_f1=tuple(f1s))


def answer_recall(text: str, answer_sets: Sequence[Sequence[str]]) -> float:
    """Share of the K questions whose answer (any alias) occurs in ``text`` as whole normalised words.

    Of a memory: how much of what the answer call needs it still holds (a diagnostic, not a reward; a
    closed answer such as ``yes`` counts only if the word is there).
    """
    if not answer_sets:
        raise ValueError("answer_recall: no questions")
    words = f" {normalize_answer(text)} "
    return sum(any(f" {normalize_answer(a)} " in words for a in aliases) for aliases in answer_sets) / len(answer_sets)


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None,
                  **kwargs: Any) -> dict[str, float]:
    """verl custom reward function: ``{"score": F1, "f1": F1, "em": EM}`` for one response."""
    where = f"row {extra_info.get('index', '?')} ({data_source})" if isinstance(extra_info, dict) else data_source
    answer_sets = as_answer_sets(ground_truth, where)
    s = score_answers(parse_answers(solution_str, len(answer_sets)), answer_sets)
    return {"score": s.f1, "f1": s.f1, "em": s.em}
