"""Invocation records: the exact calls of a memory-agent episode (stage 1 of the data flow).

A memory agent calls the model many times per episode and rewrites its context between
calls. Call ``t`` sees ``z_t = [q, x_t]`` -- the shared prefix ``q`` (instructions and
question, identical token for token in every call) followed by a mutable context ``x_t``
(memory + new chunk) -- and samples ``a_t``. These records keep **token ids only**, exactly
as the rollout server received and returned them; nothing here is ever re-tokenized.

Every later stage (packing, attention, teacher supervision, losses) consumes these records;
they are validated once, here, so later stages can trust them::

    Episode
      prefix_ids       q                      (P,)
      invocations[t]   Invocation
        prompt_ids     [q ; x_t]              (P + C_t,)   exact input ids of call t
        response_ids   a_t                    (R_t,)       sampled ids
        response_logprobs                     (R_t,)       rollout log-probs (pi_old)
        action_mask    m_act                  (R_t,)       True where policy-sampled
        teacher_mask   m_T <= m_act           (R_t,)       True where the teacher supervises
        policy_version (v_first, v_last)                   trainer steps of the weights that sampled a_t

Errors name the episode, the call and the field (``episode 'e3' call 2: response_logprobs
has 7 entries, response_ids has 8``): bad records are refused, never repaired.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional

__all__ = ["Invocation", "Episode", "RecordError", "as_policy_version"]


class RecordError(ValueError):
    """An invocation record or episode that violates the data model."""


def _as_int_tuple(name: str, values: Iterable[Any], where: str) -> tuple[int, ...]:
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) and not (hasattr(v, "__index__")):
            raise RecordError(f"{where}: {name}[{i}] = {v!r} is not an integer token id")
        out.append(int(v))
    return tuple(out)


def _as_bool_tuple(name: str, values: Iterable[Any], where: str) -> tuple[bool, ...]:
    out = []
    for i, v in enumerate(values):
        if v not in (0, 1, True, False):
            raise RecordError(f"{where}: {name}[{i}] = {v!r} is not a 0/1 mask value")
        out.append(bool(v))
    return tuple(out)


def as_policy_version(value: Any, where: str) -> tuple[int, int]:
    """``(first, last)`` as two integers with ``0 <= first <= last``, or a RecordError naming the field."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        raise RecordError(f"{where}: policy_version {value!r} is not a (first, last) pair of weight versions")
    first, last = value
    for name, v in (("first", first), ("last", last)):
        if isinstance(v, bool) or not (isinstance(v, int) or hasattr(v, "__index__")):
            raise RecordError(f"{where}: policy_version {name} = {v!r} is not an integer weight version")
    first, last = int(first), int(last)
    if not 0 <= first <= last:
        raise RecordError(
            f"{where}: policy_version ({first}, {last}) must satisfy 0 <= first <= last "
            f"(first: the weights that sampled the call's first token, last: its last token)"
        )
    return first, last


@dataclass(frozen=True)
class Invocation:
    """One model call, exactly as sent to and returned by the rollout server.

    Attributes:
        prompt_ids: exact input token ids ``[q ; x_t]``; starts with the episode's prefix.
        response_ids: the sampled output token ids ``a_t`` (at least one).
        response_logprobs: rollout log-prob of each sampled token, same length as
            ``response_ids``; finite and <= 0.
        action_mask: ``m_act`` per response token -- True where the policy sampled it (all
            True by default; False e.g. for tokens forced by the agent, such as a closing tag).
        teacher_mask: ``m_T`` per response token; must satisfy ``m_T <= m_act``
            (default: equal to ``action_mask``, the paper's main setting).
        memory_span: ``(start, end)`` slice of ``response_ids`` that the agent retained as
            memory ``m_t`` for the next call, or None when nothing was retained.
        finish_reason: the server's stop reason: ``"stop"`` (eos / stop token) or
            ``"length"`` (hit the token budget; the call is truncated, and this is recorded).
        policy_version: ``(first, last)`` policy version of the weights that sampled ``response_ids``: verl's
            weight version, the trainer step whose update the rollout server last received (0 = the initial
            weights), as its server client reports it per call (``min_global_steps`` / ``max_global_steps``).
            ``first < last`` when a partial rollout (verl's async trainers) paused the call across a weight
            update and resumed it: its earlier tokens were sampled by ``first``, its later ones by ``last``.
            None when the server reported no version (records written before the field existed read as None).
    """

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    response_logprobs: tuple[float, ...]
    action_mask: Optional[tuple[bool, ...]] = None
    teacher_mask: Optional[tuple[bool, ...]] = None
    memory_span: Optional[tuple[int, int]] = None
    finish_reason: str = "stop"
    policy_version: Optional[tuple[int, int]] = None

    def __post_init__(self) -> None:
        self._validate(where="invocation")

    # --- validation -----------------------------------------------------------------
    def _validate(self, where: str) -> None:
        set_ = object.__setattr__
        set_(self, "prompt_ids", _as_int_tuple("prompt_ids", self.prompt_ids, where))
        set_(self, "response_ids", _as_int_tuple("response_ids", self.response_ids, where))
        set_(self, "response_logprobs", tuple(float(x) for x in self.response_logprobs))
        n = len(self.response_ids)
        if len(self.prompt_ids) == 0:
            raise RecordError(f"{where}: prompt_ids is empty")
        if n == 0:
            raise RecordError(f"{where}: response_ids is empty (an invocation must sample a token)")
        if len(self.response_logprobs) != n:
            raise RecordError(
                f"{where}: response_logprobs has {len(self.response_logprobs)} entries, response_ids has {n}"
            )
        for i, lp in enumerate(self.response_logprobs):
            if not math.isfinite(lp) or lp > 1e-6:
                raise RecordError(f"{where}: response_logprobs[{i}] = {lp} is not a finite log-prob <= 0")
        act = (True,) * n if self.action_mask is None else _as_bool_tuple("action_mask", self.action_mask, where)
        teach = act if self.teacher_mask is None else _as_bool_tuple("teacher_mask", self.teacher_mask, where)
        for name, mask in (("action_mask", act), ("teacher_mask", teach)):
            if len(mask) != n:
                raise RecordError(f"{where}: {name} has {len(mask)} entries, response_ids has {n}")
        bad = [i for i in range(n) if teach[i] and not act[i]]
        if bad:
            raise RecordError(
                f"{where}: teacher_mask must satisfy m_T <= m_act, violated at response positions {bad[:8]}"
            )
        set_(self, "action_mask", act)
        set_(self, "teacher_mask", teach)
        if self.memory_span is not None:
            s, e = (int(x) for x in self.memory_span)
            if not 0 <= s <= e <= n:
                raise RecordError(f"{where}: memory_span {self.memory_span} is outside response_ids (length {n})")
            set_(self, "memory_span", (s, e))
        if self.finish_reason not in ("stop", "length"):
            raise RecordError(f"{where}: finish_reason {self.finish_reason!r} is not 'stop' or 'length'")
        if self.policy_version is not None:
            set_(self, "policy_version", as_policy_version(self.policy_version, where))

    # --- derived views --------------------------------------------------------------
    @property
    def truncated(self) -> bool:
        """True when the call stopped at its token budget rather than at a stop token."""
        return self.finish_reason == "length"

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)

    @property
    def memory_ids(self) -> tuple[int, ...]:
        """The retained memory ``m_t`` (a slice of ``response_ids``), empty when none."""
        if self.memory_span is None:
            return ()
        s, e = self.memory_span
        return self.response_ids[s:e]


@dataclass(frozen=True)
class Episode:
    """All invocations of one memory-agent episode, in call order.

    Attributes:
        episode_id: unique id of this episode (one rollout).
        uid: id of the dataset row it was sampled for (GRPO groups episodes by ``uid``).
        prefix_ids: the shared task prefix ``q`` (P tokens, P >= 1); every invocation's
            ``prompt_ids`` starts with exactly these ids.
        invocations: the calls, in the order they were made (at least one).
        reward: the episode's final task reward (answer F1), None until scored.
        extra: JSON-serialisable metadata (data source, answers, ...); not used by training.
    """

    episode_id: str
    uid: str
    prefix_ids: tuple[int, ...]
    invocations: tuple[Invocation, ...]
    reward: Optional[float] = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"episode {self.episode_id!r}"
        object.__setattr__(self, "prefix_ids", _as_int_tuple("prefix_ids", self.prefix_ids, where))
        object.__setattr__(self, "invocations", tuple(self.invocations))
        if not self.prefix_ids:
            raise RecordError(f"{where}: prefix_ids is empty (the shared prefix q needs >= 1 token)")
        if not self.invocations:
            raise RecordError(f"{where}: has no invocations")
        p = len(self.prefix_ids)
        for t, inv in enumerate(self.invocations):
            if not isinstance(inv, Invocation):
                raise RecordError(f"{where} call {t}: is a {type(inv).__name__}, not an Invocation")
            if inv.prompt_ids[:p] != self.prefix_ids:
                first = next(
                    (i for i in range(min(p, len(inv.prompt_ids))) if inv.prompt_ids[i] != self.prefix_ids[i]),
                    min(p, len(inv.prompt_ids)),
                )
                raise RecordError(
                    f"{where} call {t}: prompt_ids does not start with the shared prefix q "
                    f"(first difference at token {first}; the prefix must be identical in every call)"
                )
        if self.reward is not None and not math.isfinite(float(self.reward)):
            raise RecordError(f"{where}: reward {self.reward} is not finite")

    @property
    def prefix_len(self) -> int:
        return len(self.prefix_ids)

    def context_ids(self, t: int) -> tuple[int, ...]:
        """``x_t``: the call-specific part of call ``t``'s input (after ``q``)."""
        return self.invocations[t].prompt_ids[self.prefix_len :]

    def validate_vocab(self, vocab_size: int) -> None:
        """Raise RecordError if any token id is outside ``[0, vocab_size)``."""
        for t, inv in enumerate(self.invocations):
            for name in ("prompt_ids", "response_ids"):
                ids = getattr(inv, name)
                bad = [i for i, x in enumerate(ids) if not 0 <= x < vocab_size]
                if bad:
                    raise RecordError(
                        f"episode {self.episode_id!r} call {t}: {name}[{bad[0]}] = {ids[bad[0]]} "
                        f"is outside the vocabulary [0, {vocab_size})"
                    )

    def with_reward(self, reward: float) -> "Episode":
        return Episode(self.episode_id, self.uid, self.prefix_ids, self.invocations, float(reward), dict(self.extra))

    # --- serialisation --------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Episode":
        eid = d.get("episode_id", "?")
        invs = []
        for t, raw in enumerate(d["invocations"]):
            try:
                span = raw.get("memory_span")
                invs.append(Invocation(**{**raw, "memory_span": tuple(span) if span is not None else None}))
            except RecordError as e:
                raise RecordError(str(e).replace("invocation:", f"episode {eid!r} call {t}:", 1)) from None
            except TypeError as e:
                raise RecordError(f"episode {eid!r} call {t}: {e}") from None
        return cls(
            episode_id=str(eid),
            uid=str(d["uid"]),
            prefix_ids=d["prefix_ids"],
            invocations=tuple(invs),
            reward=d.get("reward"),
            extra=d.get("extra") or {},
        )
