"""Procedural memory benchmark: seeded, deterministic episodes of K questions over N chunks.

An episode (a :class:`MemoryTask`) is a consistent synthetic world (see ``world.py``), K
questions about it (1 or 2 hops), and N chunks of text. Every supporting fact appears
exactly once, in some chunk; look-alike distractor facts and filler sentences surround it::

    q:       Questions: 1. Where does Mara Tovin live?  2. In which country does Hugo Lund live?
    chunk 1: The rain did not stop that day. Hugo Lund lives in Orin. Mara Kesh lives in Velmar. ...
    chunk 2: Mara Tovin lives in Velora. Mara Tovin works for Zentek Labs. A dog barked ...
    chunk 3: Orin is located in Drenmark. Orla is located in Sarnia. ...
    answers: 1. Velora   2. Drenmark

Contracts:
- A 2-hop question's bridge fact (``Orin is located in ...``) never comes before the fact that
  names the bridge (``Hugo Lund lives in Orin``): a reader that keeps only what the
  questions need, in reading order, can answer everything (the oracle does).
- A distractor is, with equal chance, a look-alike subject with the same relation
  (``Mara Kesh lives in Velmar``) or the same subject with another relation. Distractors are
  true facts of the world, never contradictions.
- Filler pads each chunk to at least ``chunk_words`` words; facts are never dropped, so a
  chunk may be longer when many facts land in it.
- Episode ``i`` of split ``s`` depends only on ``(seed, s, i)`` and the config.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator, Sequence

from verl_memopd.tasks.prompts import MemoryPrompts, format_answers
from verl_memopd.tasks.world import QUESTION_KINDS, RELATIONS, Fact, World, get_vocabulary

__all__ = [
    "TaskConfig",
    "Question",
    "MemoryTask",
    "Preset",
    "HORIZONS",
    "HORIZON_PRESETS",
    "PRESETS",
    "get_preset",
    "generate",
    "corpus",
]


@dataclass(frozen=True)
class TaskConfig:
    """Generator knobs.

    Attributes:
        n_chunks: N, chunks per episode (>= 1); the agent makes N memory calls + 1 answer call.
        n_questions: K, questions per episode (>= 1).
        hops: allowed hop counts (subset of {1, 2}); each question draws one uniformly.
        distractor_rate: expected distractor facts per supporting fact (>= 0).
        chunk_words: minimum words per chunk, reached with filler (>= 1).
        vocabulary: name pools and filler, ``tiny`` (small word set for tiny CPU models) or ``full``.
        support_chunks: supporting facts land in the first ``support_chunks`` chunks only (None: any chunk);
            distractors still land anywhere, so a small value makes the answer's facts survive
            ``n_chunks - support_chunks`` memory rewrites among look-alikes (the horizon presets).
    """

    n_chunks: int
    n_questions: int
    hops: tuple[int, ...] = (1, 2)
    distractor_rate: float = 1.0
    chunk_words: int = 60
    vocabulary: str = "full"
    support_chunks: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "hops", tuple(int(h) for h in self.hops))
        if self.n_chunks < 1 or self.n_questions < 1:
            raise ValueError(
                f"TaskConfig: n_chunks ({self.n_chunks}) and n_questions ({self.n_questions}) must be >= 1"
            )
        known = sorted({k.hops for k in QUESTION_KINDS.values()})
        if not self.hops or any(h not in known for h in self.hops):
            raise ValueError(f"TaskConfig.hops {self.hops} must be a non-empty subset of {known}")
        if self.distractor_rate < 0:
            raise ValueError(f"TaskConfig.distractor_rate must be >= 0, got {self.distractor_rate}")
        if self.chunk_words < 1:
            raise ValueError(f"TaskConfig.chunk_words must be >= 1, got {self.chunk_words}")
        if self.support_chunks is not None and not 1 <= self.support_chunks <= self.n_chunks:
            raise ValueError(
                f"TaskConfig.support_chunks must be in [1, n_chunks={self.n_chunks}] or None, got {self.support_chunks}"
            )
        get_vocabulary(self.vocabulary)


@dataclass(frozen=True)
class Question:
    """One question: its text, accepted answers (canonical first), and supporting facts."""

    text: str
    answers: tuple[str, ...]
    support: tuple[Fact, ...]

    def __post_init__(self) -> None:
        if not self.text.strip():
            raise ValueError("Question.text is empty")
        if not self.answers or any(not a.strip() for a in self.answers):
            raise ValueError(f"Question {self.text!r}: answers must be non-empty strings, got {self.answers}")


@dataclass(frozen=True)
class MemoryTask:
    """One benchmark episode: K questions and N chunks (``episode_id`` names it in errors)."""

    episode_id: str
    questions: tuple[Question, ...]
    chunks: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.questions:
            raise ValueError(f"task {self.episode_id}: has no questions")
        if not self.chunks:
            raise ValueError(f"task {self.episode_id}: has no chunks")
        empty = [i for i, c in enumerate(self.chunks) if not c.strip()]
        if empty:
            raise ValueError(f"task {self.episode_id}: chunks {empty} are empty")


@dataclass(frozen=True)
class Preset:
    """A named generator config plus default split sizes (episodes)."""

    name: str
    config: TaskConfig
    sizes: dict[str, int]


#: the horizon family ``h<T>``: T memory calls over ``tiny``-sized chunks, 2 questions; the supporting facts sit in
#: the first 2 chunks, so they must survive T - 2 memory rewrites, and the distractor rate grows with T (T / 6 per
#: supporting fact) so the look-alikes per chunk stay about constant. ``h3`` is the short end of the family (not
#: ``tiny``: there the facts may sit in any chunk).
HORIZONS = (3, 6, 12)
HORIZON_PRESETS = tuple(
    Preset(
        f"h{t}",
        TaskConfig(
            n_chunks=t, n_questions=2, distractor_rate=t / 6, chunk_words=24, vocabulary="tiny", support_chunks=2
        ),
        {"train": 2048, "val": 64, "test": 128},
    )
    for t in HORIZONS
)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "tiny",
            TaskConfig(n_chunks=3, n_questions=2, distractor_rate=0.5, chunk_words=24, vocabulary="tiny"),
            {"train": 512, "val": 64, "test": 64},
        ),
        Preset(
            "small",
            TaskConfig(n_chunks=4, n_questions=2, distractor_rate=1.0, chunk_words=60),
            {"train": 2048, "val": 128, "test": 128},
        ),
        Preset(
            "3b",
            TaskConfig(n_chunks=8, n_questions=3, distractor_rate=2.0, chunk_words=400),
            {"train": 4096, "val": 128, "test": 128},
        ),
        Preset(
            "7b",
            TaskConfig(n_chunks=16, n_questions=4, distractor_rate=2.0, chunk_words=800),
            {"train": 2048, "val": 128, "test": 128},
        ),
        *HORIZON_PRESETS,
    )
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; valid: {sorted(PRESETS)}")
    return PRESETS[name]


def _draw_questions(world: World, cfg: TaskConfig) -> list[Question]:
    questions, seen = [], set()
    for k in range(cfg.n_questions):
        for _ in range(100):  # bounded retries: distinct (subject, kind) pairs
            hops = world.rng.choice(cfg.hops)
            kind = world.rng.choice([kind for kind in QUESTION_KINDS.values() if kind.hops == hops])
            subject = world.rng.choice(world.vocab.pools[RELATIONS[kind.relations[0]].subject_type])
            if (subject, kind.name) not in seen:
                break
        else:
            raise ValueError(f"vocabulary {world.vocab.name!r} is too small for {cfg.n_questions} distinct questions")
        seen.add((subject, kind.name))
        support = world.chain(subject, kind)
        questions.append(Question(kind.template.format(s=subject), world.answers(support[-1].object), support))
    return questions


def _draw_distractors(world: World, questions: Sequence[Question], rate: float) -> list[Fact]:
    support = {f for q in questions for f in q.support}
    n = sum(int(rate) + (world.rng.random() < rate - int(rate)) for _ in support)
    out: list[Fact] = []
    for _ in range(20 * n):  # bounded retries: a tiny world may run out of new facts
        if len(out) == n:
            break
        anchor = world.rng.choice(sorted(support, key=lambda f: f.sentence))
        rel = RELATIONS[anchor.relation]
        if world.rng.random() < 0.5:
            fact = world.fact(world.lookalike(anchor.subject, rel.subject_type), anchor.relation)
        else:
            others = [r for r in RELATIONS.values() if r.subject_type == rel.subject_type and r.name != rel.name]
            fact = world.fact(anchor.subject, world.rng.choice(others).name) if others else anchor
        if fact not in support and fact not in out:
            out.append(fact)
    return out


def _layout(world: World, questions: Sequence[Question], distractors: Sequence[Fact], cfg: TaskConfig):
    """Chunk index and in-chunk order of every fact, honouring the bridge-order contract."""
    after: dict[Fact, set[Fact]] = {}
    for q in questions:
        for prev, nxt in zip(q.support, q.support[1:]):
            after.setdefault(nxt, set()).add(prev)
    support = {f for q in questions for f in q.support}
    facts = list(dict.fromkeys([f for q in questions for f in q.support] + list(distractors)))
    chunk_of: dict[Fact, int] = {}
    placed: list[list[Fact]] = [[] for _ in range(cfg.n_chunks)]

    def place(f: Fact) -> None:
        if f in chunk_of:
            return
        for p in sorted(after.get(f, ()), key=lambda x: x.sentence):
            place(p)
        lo = max((chunk_of[p] for p in after.get(f, ())), default=0)
        hi = cfg.n_chunks - 1 if f not in support or cfg.support_chunks is None else cfg.support_chunks - 1
        c = world.rng.randint(lo, hi)
        first = max((placed[c].index(p) + 1 for p in after.get(f, ()) if chunk_of[p] == c), default=0)
        placed[c].insert(world.rng.randint(first, len(placed[c])), f)
        chunk_of[f] = c

    for f in facts:
        place(f)
    return placed


def _fill(world: World, facts: Sequence[Fact], chunk_words: int) -> str:
    sentences = [f.sentence for f in facts]
    while sum(len(s.split()) for s in sentences) < chunk_words:
        sentences.insert(world.rng.randint(0, len(sentences)), world.rng.choice(world.vocab.filler))
    return " ".join(sentences)


def generate(cfg: TaskConfig, seed: int, split: str, index: int) -> MemoryTask:
    """Episode ``index`` of ``split``; a pure function of its arguments."""
    world = World(get_vocabulary(cfg.vocabulary), random.Random(f"memopd-tasks:{seed}:{split}:{index}"))
    questions = _draw_questions(world, cfg)
    distractors = _draw_distractors(world, questions, cfg.distractor_rate)
    chunks = tuple(_fill(world, facts, cfg.chunk_words) for facts in _layout(world, questions, distractors, cfg))
    return MemoryTask(f"{split}-{index}", tuple(questions), chunks)


def corpus(
    n_samples: int, seed: int, presets: Sequence[str] = ("tiny", "small"), prompts: MemoryPrompts = MemoryPrompts()
) -> Iterator[str]:
    """``n_samples`` texts, one per episode, for training a tokenizer on the benchmark's words.

    Episodes cycle through ``presets``; each text holds the episode's question message, every
    memory-call message (with the supporting facts seen so far as a memory-like note), the
    answer-call message and the answer lines -- everything an agent reads or writes.
    """
    for i in range(n_samples):
        cfg = get_preset(presets[i % len(presets)]).config
        task = generate(cfg, seed, "corpus", i)
        parts, seen = [prompts.question_text([q.text for q in task.questions])], []
        support = [f.sentence for q in task.questions for f in q.support]
        for c, chunk in enumerate(task.chunks):
            parts.append(prompts.memory_message("\n".join(seen), chunk, c, len(task.chunks)))
            seen += [s for s in support if s in chunk and s not in seen]
        parts.append(prompts.answer_message("\n".join(seen)))
        parts.append(format_answers([q.answers[0] for q in task.questions]))
        yield "\n\n".join(parts)
