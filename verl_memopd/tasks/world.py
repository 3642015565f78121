"""Synthetic worlds: entities, relations, question kinds, and their sentences.

A world is a small consistent knowledge base built lazily for one episode: every
``(subject, relation)`` pair has exactly one object, drawn the first time it is asked for.
Facts are rendered as sentences from fixed templates and parsed back by the same
templates (the oracle reads chunks that way), so fact sentences are unambiguous::

    person  --lives_in-->   city  --located_in-->  country
    person  --works_for-->  company --based_in-->  city
    person  --born_in-->    year

Questions are 1-hop (one relation) or 2-hop (two relations through a bridge entity,
e.g. "In which country does Mara Tovin live?" = lives_in then located_in).

Look-alikes: two names look alike when they share a word, their first two or their last three
letters (``Mara Tovin`` / ``Mara Kesh``, ``Velora`` / ``Velmar``, ``Drovia`` / ``Lovia``);
distractors use them. Every name of every pool has at least one look-alike.
"""

from __future__ import annotations

import itertools
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

__all__ = [
    "Relation",
    "QuestionKind",
    "Vocabulary",
    "Fact",
    "World",
    "RELATIONS",
    "QUESTION_KINDS",
    "VOCABULARIES",
    "get_vocabulary",
    "parse_fact",
    "parse_question",
    "looks_alike",
]


@dataclass(frozen=True)
class Relation:
    """A relation ``subject_type --name--> object_type`` and its fact sentence template."""

    name: str
    subject_type: str
    object_type: str
    template: str  # "{s} lives in {o}."

    pattern: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        head, tail = self.template.split("{s}")[1].split("{o}")
        object.__setattr__(
            self, "pattern", re.compile(r"(?P<s>[A-Z][\w ]*?)" + re.escape(head) + r"(?P<o>[\w ]+?)" + re.escape(tail))
        )

    def sentence(self, subject: str, obj: str) -> str:
        return self.template.format(s=subject, o=obj)


@dataclass(frozen=True)
class QuestionKind:
    """A question over a chain of relations (1 or 2 hops) and its question template."""

    name: str
    relations: tuple[str, ...]
    template: str  # "Where does {s} live?"

    @property
    def hops(self) -> int:
        return len(self.relations)

    def parse(self, text: str) -> str | None:
        """The subject of ``text`` if it is a question of this kind, else None."""
        head, tail = self.template.split("{s}")
        m = re.fullmatch(re.escape(head) + r"(?P<s>[A-Z][\w ]*?)" + re.escape(tail), text.strip())
        return m.group("s") if m else None


def _registry(items) -> dict:
    out = {}
    for item in items:
        if item.name in out:
            raise ValueError(f"duplicate name {item.name!r}")
        out[item.name] = item
    return out


RELATIONS: dict[str, Relation] = _registry(
    [
        Relation("lives_in", "person", "city", "{s} lives in {o}."),
        Relation("works_for", "person", "company", "{s} works for {o}."),
        Relation("born_in", "person", "year", "{s} was born in {o}."),
        Relation("based_in", "company", "city", "{s} is based in {o}."),
        Relation("located_in", "city", "country", "{s} is located in {o}."),
    ]
)

QUESTION_KINDS: dict[str, QuestionKind] = _registry(
    [
        QuestionKind("home", ("lives_in",), "Where does {s} live?"),
        QuestionKind("employer", ("works_for",), "Which company does {s} work for?"),
        QuestionKind("birth_year", ("born_in",), "In which year was {s} born?"),
        QuestionKind("company_city", ("based_in",), "In which city is {s} based?"),
        QuestionKind("city_country", ("located_in",), "In which country is {s}?"),
        QuestionKind("home_country", ("lives_in", "located_in"), "In which country does {s} live?"),
        QuestionKind("employer_city", ("works_for", "based_in"), "In which city is the company of {s} based?"),
    ]
)
for _kind in QUESTION_KINDS.values():  # chains must compose: object type of hop i = subject type of hop i+1
    for _a, _b in zip(_kind.relations, _kind.relations[1:]):
        assert RELATIONS[_a].object_type == RELATIONS[_b].subject_type, _kind.name


@dataclass(frozen=True)
class Vocabulary:
    """Name pools per entity type; ``aliases`` maps a name to its other accepted answers."""

    name: str
    pools: dict[str, tuple[str, ...]]
    aliases: dict[str, tuple[str, ...]]
    filler: tuple[str, ...]

    def __post_init__(self) -> None:
        needed = {r.subject_type for r in RELATIONS.values()} | {r.object_type for r in RELATIONS.values()}
        for t in sorted(needed):
            if len(self.pools.get(t, ())) < 2:
                raise ValueError(f"vocabulary {self.name!r}: pool {t!r} needs at least 2 names")
        for t, pool in self.pools.items():
            keys = Counter(k for name in set(pool) for k in _alike_keys(name))
            lone = [name for name in pool if all(keys[k] < 2 for k in _alike_keys(name))]
            if lone:
                raise ValueError(f"vocabulary {self.name!r}: pool {t!r} names without a look-alike: {lone}")
        for s in self.filler:
            if parse_fact(s) is not None:
                raise ValueError(f"vocabulary {self.name!r}: filler sentence {s!r} parses as a fact")


_TINY_FIRST = ("Mara", "Tomas", "Ilse", "Bram", "Nia", "Hugo")
_TINY_LAST = ("Tovin", "Kesh", "Amsel", "Vanter", "Orby", "Lund")
_TINY_COMPANIES = {"Zentek": "Labs", "Zenva": "Works", "Brightmill": "Group", "Corla": "Labs", "Halden": "Group"}
_TINY_FILLER = (
    "The rain did not stop that day.",
    "Nobody said much at dinner.",
    "The road was long and quiet.",
    "A dog barked in the yard.",
    "The old clock struck nine.",
    "Someone left the door open.",
    "The market was busy as usual.",
    "Snow fell on the hills.",
)
_SYL = ("ka", "lo", "mi", "ra", "ven", "tor", "sa", "del", "nu", "bri", "zo", "fen", "mar", "ol", "ti", "an")
_ADJ = ("quiet", "busy", "small", "old", "bright", "cold", "green", "narrow", "warm", "empty", "long", "wet")
_NOUN = (
    "river",
    "market",
    "garden",
    "bridge",
    "train",
    "harbor",
    "library",
    "square",
    "tower",
    "field",
    "bakery",
    "school",
)
_VERB = ("looked", "seemed", "stayed", "grew", "felt", "turned")
_TIME = ("that morning", "in the evening", "all week", "at noon", "after the storm", "during the fair")


def _syllable_names(n: int, syllables: int, seed: str) -> tuple[str, ...]:
    combos = ["".join(c).capitalize() for c in itertools.product(_SYL, repeat=syllables)]
    return tuple(sorted(random.Random(seed).sample(combos, n)))


@lru_cache(maxsize=None)
def get_vocabulary(name: str) -> Vocabulary:
    """The vocabulary named ``name`` (``tiny`` or ``full``); lookup errors list the valid names."""
    if name not in VOCABULARIES:
        raise KeyError(f"unknown vocabulary {name!r}; valid: {sorted(VOCABULARIES)}")
    return VOCABULARIES[name]()


def _tiny() -> Vocabulary:
    companies = tuple(f"{b} {s}" for b, s in _TINY_COMPANIES.items())
    return Vocabulary(
        name="tiny",
        pools={
            "person": tuple(f"{f} {s}" for f in _TINY_FIRST for s in _TINY_LAST),
            "city": ("Velora", "Velmar", "Kesh Hill", "Kesh Vale", "Orin", "Orla"),
            "country": ("Drenmark", "Drovia", "Sarnia", "Sarland"),
            "company": companies,
            "year": tuple(str(y) for y in range(1990, 2000)),
        },
        aliases={c: (c.split()[0],) for c in companies},
        filler=_TINY_FILLER,
    )


def _full() -> Vocabulary:
    first, last = _syllable_names(40, 2, "first"), _syllable_names(60, 3, "last")
    bases = _syllable_names(40, 3, "company")
    companies = tuple(f"{b} {('Labs', 'Works', 'Group', 'Systems')[i % 4]}" for i, b in enumerate(bases))
    filler = tuple(
        f"The {a} {n} {v} {a2} {t}."
        for a, n, v, a2, t in itertools.product(_ADJ, _NOUN, _VERB, _ADJ[::-1], _TIME)
        if a != a2
    )
    return Vocabulary(
        name="full",
        pools={
            "person": tuple(f"{f} {s}" for f in first for s in last),
            "city": _syllable_names(60, 3, "city"),
            "country": tuple(n + "ia" for n in _syllable_names(24, 2, "country")),
            "company": companies,
            "year": tuple(str(y) for y in range(1940, 2020)),
        },
        aliases={c: (c.rsplit(" ", 1)[0],) for c in companies},
        filler=filler,
    )


VOCABULARIES = {"tiny": _tiny, "full": _full}


@dataclass(frozen=True)
class Fact:
    """One ``(subject, relation, object)`` fact of a world."""

    subject: str
    relation: str
    object: str

    @property
    def sentence(self) -> str:
        return RELATIONS[self.relation].sentence(self.subject, self.object)


def parse_fact(sentence: str) -> Fact | None:
    """The fact a sentence states, or None if it is not a fact sentence (e.g. filler)."""
    for rel in RELATIONS.values():
        m = rel.pattern.fullmatch(sentence.strip())
        if m:
            return Fact(m.group("s"), rel.name, m.group("o"))
    return None


def parse_question(text: str) -> tuple[QuestionKind, str] | None:
    """``(kind, subject)`` of a generated question, or None if no template matches."""
    for kind in QUESTION_KINDS.values():
        subject = kind.parse(text)
        if subject is not None:
            return kind, subject
    return None


def _alike_keys(name: str) -> set[tuple[str, str]]:
    return {("word", w) for w in name.split()} | {("head", name.lower()[:2]), ("tail", name.lower()[-3:])}


def looks_alike(a: str, b: str) -> bool:
    """True for two different names sharing a word, their first two or their last three letters."""
    return a != b and bool(_alike_keys(a) & _alike_keys(b))


@dataclass
class World:
    """A lazily built consistent world over ``vocab`` for one episode (drawn with ``rng``)."""

    vocab: Vocabulary
    rng: random.Random
    _objects: dict[tuple[str, str], str] = field(default_factory=dict)

    def fact(self, subject: str, relation: str) -> Fact:
        """The fact ``(subject, relation, ?)``; the object is drawn once, then fixed."""
        key = (subject, relation)
        if key not in self._objects:
            self._objects[key] = self.rng.choice(self.vocab.pools[RELATIONS[relation].object_type])
        return Fact(subject, relation, self._objects[key])

    def chain(self, subject: str, kind: QuestionKind) -> tuple[Fact, ...]:
        """The supporting facts of question ``kind`` about ``subject``, hop by hop."""
        facts, s = [], subject
        for rel in kind.relations:
            facts.append(self.fact(s, rel))
            s = facts[-1].object
        return tuple(facts)

    def lookalike(self, name: str, entity_type: str) -> str:
        """A random look-alike of ``name`` from its pool (every name has one, see Vocabulary)."""
        return self.rng.choice([n for n in self.vocab.pools[entity_type] if looks_alike(name, n)])

    def answers(self, name: str) -> tuple[str, ...]:
        """All accepted answers for entity ``name``: the name first, then its aliases."""
        return (name, *self.vocab.aliases.get(name, ()))
