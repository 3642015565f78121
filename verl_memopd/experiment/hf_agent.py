"""The memory agent run with Hugging Face models directly (no Ray, no vLLM): for the experiment's diagnostics.

The calls are the training agent loop's own (``agent.episode.MemoryEpisode`` on the row's prompt: ``q`` once,
then ``[q | memory | chunk]`` per call, the memory being the previous call's sampled ids up to its stop
token), and scored with the benchmark's F1 (``tasks.reward``). What differs
from ``verl_memopd.agent.loop``: generation is Hugging Face ``generate`` (batched, left-padded, fp32, CPU), and
each call may be served by a different model, and a model may act in the flat state (``state="flat"``: at call t its
input is the persistent history of calls 0..t-1, q then each call's block ``[x ; a]``, the blocks separated, then
the separator and ``x_t``: the ``flat`` layout the persistent-history teacher scores in, :func:`flat_prompt`). Uses:

- **teacher from the student's state** (:func:`handoff_f1`): the student writes memory for calls ``0..t-1``,
  the teacher takes over from call ``t``; F1 per ``t`` says whether the teacher can still answer from states
  the student visits (its supervision is only as good as that);
- **off-policy KD data** (:func:`agent_calls` with the teacher alone, greedy): the teacher's own trajectories
  as chat rows for verl's SFT trainer;
- **held-out reverse KL** (:func:`agent_calls` sampled with a fixed seed, then :func:`reverse_kl_on_calls`):
  one fixed set of the start student's rollouts, on which every arm's model is compared with the teacher;
- **F1 by state** (:func:`agent_calls` with ``state``, greedy): a teacher acting in the aligned and in the flat state,
  whether the persistent-history teacher can act in the state it scores in (``heldout.state_f1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from verl_memopd.agent.episode import CallRequest

__all__ = [
    "STATES",
    "AgentCall",
    "AgentEpisode",
    "load_model",
    "flat_prompt",
    "agent_calls",
    "handoff_f1",
    "reverse_kl_on_calls",
    "sft_rows",
]

#: the states a model can act in: ``aligned`` (each call's own ``q + x_t``, what the agent sends) or ``flat`` (the
#: persistent history, :func:`flat_prompt`)
STATES = ("aligned", "flat")


@dataclass(frozen=True)
class AgentCall:
    """One call: ``prompt_ids`` (as sent: q + context in the aligned state, the persistent history up to ``x_t`` in
    the flat one), ``response_ids`` (as generated, stop id included if the call stopped); ``user`` / ``reply``: the
    same call as text (the call message with the memory decoded, the reply without its stop token), the shape of the
    oracle's SFT traces."""

    call: int
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    user: str
    reply: str


@dataclass(frozen=True)
class AgentEpisode:
    index: int
    calls: tuple[AgentCall, ...]
    answer: str
    f1: float


def load_model(path: Path):
    """(model, tokenizer) of a Hugging Face folder: fp32, eval mode, sdpa attention (CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), tokenizer


def _stop_ids(model, tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids |= set([eos] if isinstance(eos, int) else (eos or ()))
    return sorted(i for i in ids if i is not None)


def flat_prompt(
    history: tuple[int, ...], request: "CallRequest", prefix_len: int, separator: Sequence[int]
) -> tuple[int, ...]:
    """Call t's input in the flat state: ``history`` (the ids of calls 0..t-1 as the flat state ran them, each call's
    input then its reply; empty before call 0), ``separator``, then ``x_t`` (``request.prompt_ids`` past the
    ``prefix_len`` ids of q); call 0's is ``q + x_0``. So the input before ``a_t`` is the ``flat`` layout's row of
    the episode's calls (``packing``, ``LayoutOptions.flat_separator_ids``), which the flat teacher scores."""
    if not history:
        return request.prompt_ids
    return history + tuple(separator) + request.prompt_ids[prefix_len:]


def _generate(
    model,
    prompts: Sequence[Sequence[int]],
    budget: int,
    pad_id: int,
    stop_ids: list[int],
    sample: bool,
    seed: int | None,
) -> list[tuple[int, ...]]:
    """Batched generation from token-id prompts (left padded); each reply cut after its first stop id."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=budget,
            do_sample=sample,
            temperature=1.0 if sample else None,
            top_p=1.0 if sample else None,
            top_k=0 if sample else None,
            eos_token_id=stop_ids,
            pad_token_id=pad_id,
        )
    replies = []
    for row in out[:, width:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in stop_ids), len(row))
        replies.append(tuple(row[:cut]))
    return replies


def agent_calls(
    rows: Sequence[dict],
    models: Sequence,
    tokenizer,
    memory_tokens: int,
    answer_tokens: int,
    switch_at: int | None = None,
    sample: bool = False,
    seed: int | None = None,
    batch: int = 32,
    state: str = "aligned",
    separator: Sequence[int] = (),
) -> list[AgentEpisode]:
    """Run the memory agent over ``rows`` (dataset rows: ``prompt``, ``extra_info``, ``reward_model``).

    ``models``: one model, or (first, second) with ``switch_at`` = the first call served by ``second`` (0 = all
    calls by it; >= the number of calls = none). ``sample``: temperature-1 sampling (seeded by ``seed`` per call
    batch) instead of greedy. ``state`` (:data:`STATES`): what each call's model reads, its own ``q + x_t``
    (``aligned``) or the persistent history (``flat``, :func:`flat_prompt` with ``separator``, e.g. the chat
    template's turn separator ``trainer.teacher.flat_separator_ids`` resolves); the memory each reply hands on is the
    same in both. Returns one :class:`AgentEpisode` per row, in order.
    """
    from verl_memopd.agent.context import CallContext
    from verl_memopd.agent.episode import MemoryEpisode
    from verl_memopd.tasks.dataset import parse_row
    from verl_memopd.tasks.prompts import MemoryPrompts

    if state not in STATES:
        raise ValueError(f"agent_calls: state={state!r}, expected one of {STATES}")
    first, second = (models[0], models[-1])
    out: list[AgentEpisode] = []
    for start in range(0, len(rows), batch):
        group = rows[start : start + batch]
        episodes = []
        for row in group:
            task = parse_row(row["extra_info"], row["reward_model"])
            context = CallContext(tokenizer, list(row["prompt"]), MemoryPrompts(), where=task.where)
            episodes.append(MemoryEpisode(task, context, memory_tokens, answer_tokens))
        n_calls = {e.num_calls for e in episodes}
        if len(n_calls) != 1:
            raise ValueError(
                f"rows {start}..{start + len(group) - 1}: episodes with different call counts {n_calls} in one batch"
            )
        calls: list[list[AgentCall]] = [[] for _ in group]
        histories: list[tuple[int, ...]] = [() for _ in group]  # the flat state's ids so far, per episode
        for t in range(n_calls.pop()):
            model = second if switch_at is not None and t >= switch_at else first
            users = [e.message(tokenizer.decode(e.kept_ids, skip_special_tokens=True)) for e in episodes]
            requests = [e.next_call() for e in episodes]
            prompts = [
                r.prompt_ids if state == "aligned" else flat_prompt(h, r, len(e.context.prefix_ids), separator)
                for e, r, h in zip(episodes, requests, histories)
            ]
            stops = _stop_ids(model, tokenizer)
            replies = _generate(
                model,
                prompts,
                requests[0].budget,
                tokenizer.pad_token_id,
                stops,
                sample,
                None if seed is None else seed * 1000 + start * 10 + t,
            )
            histories = [prompt + reply for prompt, reply in zip(prompts, replies)]
            for e, episode_calls, prompt, reply, user in zip(episodes, calls, prompts, replies, users):
                e.receive(reply, stopped=bool(reply) and reply[-1] in stops)
                text = tokenizer.decode(e.kept_ids, skip_special_tokens=True)
                episode_calls.append(AgentCall(t, prompt, reply, user, text))
        for i, (e, episode_calls) in enumerate(zip(episodes, calls)):
            answer = tokenizer.decode(e.kept_ids, skip_special_tokens=True)
            out.append(AgentEpisode(start + i, tuple(episode_calls), answer, float(e.score(answer).f1)))
    return out


def handoff_f1(
    rows: Sequence[dict],
    student,
    teacher,
    tokenizer,
    memory_tokens: int,
    answer_tokens: int,
    batch: int = 32,
    switches: Sequence[int] | None = None,
) -> dict[int, float]:
    """Mean F1 when the teacher takes over at call ``t`` (greedy), for every ``t`` of ``switches`` (default: every
    ``t`` from 0, the teacher alone, to the number of calls, the student alone)."""
    n = len(rows[0]["extra_info"]["chunks"]) + 1
    result = {}
    for t in range(n + 1) if switches is None else switches:
        episodes = agent_calls(
            rows, (student, teacher), tokenizer, memory_tokens, answer_tokens, switch_at=t, batch=batch
        )
        result[t] = sum(e.f1 for e in episodes) / len(episodes)
    return result


def reverse_kl_on_calls(model, teacher, calls: Sequence[AgentCall], batch: int = 8) -> tuple[float, dict[int, float]]:
    """Per-token KL(model || teacher) over the response tokens of ``calls``, each call run alone at positions
    0..n-1 (the state it was sampled in), full vocabulary, fp32: ``(mean over all tokens, {call index: mean over
    that call's tokens})`` (the drift by call index)."""
    import torch

    total: dict[int, float] = {}
    count: dict[int, int] = {}
    for start in range(0, len(calls), batch):
        group = calls[start : start + batch]
        seqs = [c.prompt_ids + c.response_ids for c in group]
        width = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        with torch.no_grad():
            lp_m = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
            lp_t = torch.log_softmax(teacher(input_ids=ids, attention_mask=mask).logits.float(), -1)
        for i, c in enumerate(group):
            lo, hi = len(c.prompt_ids) - 1, len(c.prompt_ids) + len(c.response_ids) - 1  # positions predicting replies
            m, t = lp_m[i, lo:hi], lp_t[i, lo:hi]
            total[c.call] = total.get(c.call, 0.0) + float((m.exp() * (m - t)).sum())
            count[c.call] = count.get(c.call, 0) + hi - lo
    mean = sum(total.values()) / max(sum(count.values()), 1)
    return mean, {k: total[k] / max(count[k], 1) for k in sorted(total)}


def sft_rows(rows: Sequence[dict], episodes: Sequence[AgentEpisode]) -> list[dict]:
    """Chat rows for verl's multi-turn SFT trainer from trajectories, shaped like the oracle's traces: per call,
    ``messages`` = the row's prompt + [user: the call message, assistant: the reply], and ``call`` = its index."""
    out = []
    for row, episode in zip(rows, episodes, strict=True):
        for c in episode.calls:
            out.append(
                {
                    "messages": [
                        *map(dict, row["prompt"]),
                        {"role": "user", "content": c.user},
                        {"role": "assistant", "content": c.reply},
                    ],
                    "call": c.call,
                }
            )
    return out
