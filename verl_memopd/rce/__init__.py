"""Rollout Context Equivalence (RCE) audit: packed logits == independent per-call logits.

For every action token ``a_{t,k}`` the full-vocabulary logits of the ``packed`` forward must equal
those of running call ``t`` alone. The reference is built from the invocation records alone
(:func:`reference_logits`): each call's ``prompt_ids + response_ids``, positions 0..n-1, under the
model's stock ``sdpa`` attention -- nothing the packer produced, so a packer bug cannot reproduce
itself on both sides. The ``flat`` layout (persistent history) is measured the same way to show that
its misalignment is real::

    python -m verl_memopd.rce --episodes 200 --seed 0 [--dtype bfloat16 --device cuda]
    ...
    RCE episodes=200 max_abs_diff=<x> flat_max_abs_diff=<y>

Exit status 0 only when every call is within the tolerance rule.

The tolerance rule (one rule, both audits; the maths is in ``verl_memopd.audit``), per call, maxima
over the call's action tokens and the vocabulary:

- fp32 logits: ``max |l_packed - l_alone| <= 1e-4 + 2^-15 max |l_alone|`` (``TOLERANCES``): packed and alone
  differ only in summation order, which grows with depth and logit size: ~1e-6 on the tiny models, 6.4e-5 to
  1.2e-4 on SmolLM2-135M (30 layers, logits up to ~40) over 26 audit steps of the experiment's arms -- the
  last above the former absolute 1e-4, which stopped a correct run. 2^-15 (256 fp32 ulps) of the call's
  largest logit leaves ~10x room there (bound ~1.3e-3 at |l| = 40); the injected faults move fp32 logits by
  0.5-1.4 on the tiny student, hundreds of times more (bf16 at the 3B shape: 2.3-7.2).
- bf16 / fp16 logits: flash-attention's test rule. The alone pass runs twice, in the model's dtype
  (``l_alone``) and with the same weights upcast to fp32 (``l_ref``; the in-training check uses TF32
  products with fp32 accumulation on CUDA, ``audit.reference_precision``: on an H200 the floor of a
  random 3B model came out 0.2534 vs 0.2521 with exact fp32, at 2.2x less time)::

      max |l_packed - l_ref| <= k * max |l_alone - l_ref| + eps,   eps = e * u * max |l_ref|

  ``k = 3``, ``e = 4``, ``u`` the unit roundoff (2^-8 bf16, 2^-11 fp16) (``audit.NOISE_FLOOR_RULES``).
  ``k``: packed and alone round differently (other kernels, other shapes), so a correct packed pass
  is off by the same order as the stock low-precision pass, not by the same amount; flash-attention
  uses 2. Measured, clean calls needed at most ``k_needed`` = max |l_packed - l_ref| / |l_alone - l_ref|
  = 1.14 (random Qwen2.5-3B shape, 18-20k-token episodes), 1.2 (7B shape), 1.24 (tiny student): 3
  leaves room, and the faults measured need 9-30 (3B). ``eps``: 4 ulps of the call's largest logit, for
  short calls whose two low-precision passes round alike (a zero floor). The bound follows the
  model's own rounding error: it does not pass real faults on a small model nor run out on a large
  one, as a fixed ``8 * 2^-7 * max |l|`` does (clean 3B / 7B runs use 0.80 / 0.75 of that bound, 0.34 /
  0.37 of this one). Under FSDP mixed precision (verl's GPU set-up: fp32 shards, bf16 compute) the
  in-training check builds the reference unit by unit from the fp32 shards, rounded to bf16
  (``verl_memopd.fp32_reference``; FSDP1 and FSDP2, equal bit for bit to an unsharded model's on 2 ranks).
- A call whose action tokens or token ids do not match its record fails (infinite difference).

Per call both audits also report ``max_kl`` (max over its action tokens of ``KL(p_alone || p_packed)``)
and ``top1_agreement`` (share of action tokens with the same argmax): what training consumes.

``--self-test [--dtype bfloat16]`` shows that both audits can fail: it injects packer faults (calls
>= 2 at positions shifted by one, call blocks restarting at position 0, a segment boundary off by one
token, one call block reversed -- applied after the layout checks, as a bug past them would be) and
attention-backend faults (softmax scale 1.5, GQA heads mixed up, a call block that also sees its
predecessor; backends registered only for the test), runs the offline audit and the in-training
check (``verl_memopd.audit.rce_spot_check``, whose alone pass is rebuilt from the records, never from
the packed rows) on each, and requires each fault detected by both and the clean run passing (the
model: the random tiny student with its q/k projections scaled, ``SELF_TEST_QK_SCALE`` says why)::

    python -m verl_memopd.rce --self-test --dtype bfloat16
    ...
    RCE self-test dtype=bfloat16 faults=7 detected_offline=7 detected_in_training=7 clean_pass=1
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from verl_memopd.attention import BACKENDS, attention_implementation, forward_layout, hf_name, scoped_backend
from verl_memopd.audit import (
    NOISE_FLOOR_RULES,
    TOLERANCES,
    CallRecord,
    CallSummary,
    Tolerance,
    per_call_stats,
    rce_spot_check,
    records_of_episode,
    summarize,
    token_stats,
    upcast_to_fp32,
)
from verl_memopd.packing import BatchLayout, PackedRow, build_layout, pack_episode
from verl_memopd.records import Episode, Invocation
from verl_memopd.segments import SegmentMeta, segment_meta

__all__ = [
    "Tolerance",
    "TOLERANCES",
    "EpisodeShape",
    "random_episodes",
    "RceReport",
    "reference_logits",
    "rce_audit",
    "ROW_FAULTS",
    "BACKEND_FAULTS",
    "faulty_packer",
    "reversed_block_packer",
    "SpotBatch",
    "packed_spot_batch",
    "spot_check_rows",
    "SelfTest",
    "self_test",
    "SELF_TEST_QK_SCALE",
    "sharpen_attention",
]

#: ``build_layout``'s signature: the packer under audit (``rce_audit(pack=...)``).
Packer = Callable[[str, Sequence[Episode], Optional[int]], BatchLayout]


@dataclass(frozen=True)
class EpisodeShape:
    """Inclusive ``(low, high)`` ranges for random episodes (defaults: the RCE audit's shapes)."""

    prefix_len: tuple[int, int] = (8, 64)
    calls: tuple[int, int] = (1, 8)
    chunk_len: tuple[int, int] = (1, 32)
    response_len: tuple[int, int] = (1, 24)

    def __post_init__(self) -> None:
        for name in ("prefix_len", "calls", "chunk_len", "response_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"EpisodeShape.{name} = {(lo, hi)} must satisfy 1 <= low <= high")


def random_episodes(n: int, vocab_size: int, seed: int, shape: EpisodeShape = EpisodeShape()) -> list[Episode]:
    """``n`` random memory-agent episodes: call ``t + 1`` sees ``[q ; m_t ; o_t]`` where ``m_t`` is a
    random slice of call ``t``'s response (memory re-appearing as context) and ``o_t`` a new chunk.
    About a quarter of calls end with a forced (non-sampled) token; teacher mask = action mask."""
    rng = random.Random(seed)

    def ids(lo_hi: tuple[int, int]) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(rng.randint(*lo_hi))]

    episodes = []
    for e in range(n):
        q, memory, calls = ids(shape.prefix_len), [], []
        for _ in range(rng.randint(*shape.calls)):
            response = ids(shape.response_len)
            start = rng.randint(0, len(response))
            end = rng.randint(start, len(response))
            action = [True] * len(response)
            if len(response) > 1 and rng.random() < 0.25:
                action[-1] = False
            calls.append(
                Invocation(
                    prompt_ids=tuple(q + memory + ids(shape.chunk_len)),
                    response_ids=tuple(response),
                    response_logprobs=tuple(-rng.random() * 5 for _ in response),
                    action_mask=tuple(action),
                    memory_span=(start, end),
                    finish_reason=rng.choice(("stop", "stop", "stop", "length")),
                )
            )
            memory = response[start:end]
        episodes.append(Episode(f"rce-{seed}-{e}", f"uid-{e}", tuple(q), tuple(calls)))
    return episodes


@dataclass(frozen=True)
class RceReport:
    """Result of the offline audit over all ``action_tokens`` of ``episodes``: ``max_abs_diff`` =
    max |l_packed - l_alone| and the same for ``flat``; ``calls`` the verdict per call under the rule
    (``tolerance``: the bound of the call that came closest to it); ``rule`` names it."""

    episodes: int
    action_tokens: int
    max_abs_diff: float
    flat_max_abs_diff: float
    tolerance: float
    dtype: str
    backend: str
    calls: CallSummary
    rule: str
    ref_max_abs: float = float("nan")

    @property
    def passed(self) -> bool:
        return self.calls.passed

    def line(self) -> str:
        return (
            f"RCE episodes={self.episodes} max_abs_diff={self.max_abs_diff:.3e} "
            f"flat_max_abs_diff={self.flat_max_abs_diff:.3e}"
        )


@torch.no_grad()
def reference_logits(
    model: torch.nn.Module, episodes: Sequence[Episode], attention: str = "sdpa", batch_calls: int = 64
) -> torch.Tensor:
    """Independent per-call logits at every action token, from the invocation records alone.

    Each call is its own sequence ``prompt_ids + response_ids`` with positions 0..n-1, run right-padded
    ``batch_calls`` at a time under the stock ``attention`` (plain causal: padding follows every real
    token); response token k is predicted at position ``len(prompt_ids) + k - 1``. Returns (A, V) in
    ``(episode, call, k)`` order -- the order of every layout's ``action_origin``.
    """
    seqs = [
        (
            list(inv.prompt_ids) + list(inv.response_ids),
            [len(inv.prompt_ids) + k - 1 for k, m in enumerate(inv.action_mask) if m],
        )
        for ep in episodes
        for inv in ep.invocations
    ]
    device = model.get_input_embeddings().weight.device
    out = []
    with attention_implementation(model, attention):
        for i in range(0, len(seqs), batch_calls):
            batch = seqs[i : i + batch_calls]
            width = max(len(ids) for ids, _ in batch)
            ids = torch.tensor([x + [x[0]] * (width - len(x)) for x, _ in batch], device=device)  # (S, L)
            hidden = model.base_model(
                input_ids=ids, position_ids=torch.arange(width, device=device).expand_as(ids), use_cache=False
            ).last_hidden_state  # (S, L, H)
            index = torch.tensor([s * width + j for s, (_, js) in enumerate(batch) for j in js], device=device)
            out.append(model.get_output_embeddings()(hidden.reshape(-1, hidden.shape[-1])[index]))
    return torch.cat(out)


def rule_name(dtype: torch.dtype) -> str:
    """The rule that applies to logits of ``dtype`` (see the module docstring)."""
    if dtype in NOISE_FLOOR_RULES:
        r = NOISE_FLOOR_RULES[dtype]
        return f"|packed-ref32| <= {r.k:g}*|alone-ref32| + {r.eps_ulps:g}*{r.unit:g}*max|ref32|"
    return f"|packed-alone| <= {TOLERANCES[dtype].atol:g}"


def _record_calls(episodes: Sequence[Episode]) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Per reference row (``(episode, call, k)`` order): its call (A,), the number of calls, and the
    action token ids (A,) -- from the records."""
    call, ids, s = [], [], 0
    for ep in episodes:
        for inv in ep.invocations:
            ks = [k for k, m in enumerate(inv.action_mask) if m]
            call += [s] * len(ks)
            ids += [inv.response_ids[k] for k in ks]
            s += 1
    return torch.tensor(call, dtype=torch.long), s, torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def rce_audit(
    model: torch.nn.Module,
    episodes: Sequence[Episode],
    backend: str = "torch",
    batch_episodes: int = 25,
    reference_attention: str = "sdpa",
    pack: Packer = build_layout,
) -> RceReport:
    """Compare ``packed`` (memopd ``backend``) and ``flat`` with the independent per-call reference.

    Episodes go ``batch_episodes`` at a time; ``pack`` builds the packed and flat layouts (the packer
    under audit), :func:`reference_logits` the reference under ``reference_attention`` (a stock
    transformers implementation), a second time upcast to fp32 when the model is fp16 / bf16. A packed
    layout that does not list the reference's action tokens (count or ids) fails those calls with an
    infinite difference. The model is left with the attention implementation and dtype it had.
    """
    if batch_episodes < 1:
        raise ValueError(f"batch_episodes must be >= 1, got {batch_episodes}")
    dtype = model.get_input_embeddings().weight.dtype
    if dtype not in TOLERANCES:
        raise KeyError(f"no RCE tolerance for dtype {dtype}; known: {', '.join(map(str, TOLERANCES))}")
    vocab = model.config.vocab_size
    diff = flat_diff = ref_max = 0.0
    tokens = 0
    stats, bounds = [], []
    for i in range(0, len(episodes), batch_episodes):
        batch = episodes[i : i + batch_episodes]
        call, n_calls, action_ids = _record_calls(batch)
        alone = reference_logits(model, batch, reference_attention)
        ref = None
        if dtype in NOISE_FLOOR_RULES:
            with upcast_to_fp32(model):
                ref = reference_logits(model, batch, "sdpa")  # fp32: flash-attn has none
        with attention_implementation(model, reference_attention):
            flat = forward_layout(model, pack("flat", batch, vocab))
        layout = pack("packed", batch, vocab)
        with attention_implementation(model, hf_name(backend)):
            packed = forward_layout(model, layout)
        flat_diff = max(flat_diff, _sup_diff(flat, alone))
        ref_max = max(ref_max, float(alone.float().abs().max()) if alone.numel() else 0.0)
        tokens += alone.shape[0]
        if packed.shape != alone.shape:  # the packer lost or added action tokens: every call of the batch fails
            diff = float("inf")
            s, b = per_call_stats(
                token_stats(alone, alone, ref).cpu(), call, n_calls, dtype, torch.ones(n_calls, dtype=torch.bool)
            )
        else:  # a call whose action token ids differ from its record fails
            wrong = layout.action_ids.cpu() != action_ids
            bad = torch.zeros(n_calls, dtype=torch.bool).index_put_((call[wrong],), torch.tensor(True))
            diff = max(diff, _sup_diff(packed, alone) if not bad.any() else float("inf"))
            s, b = per_call_stats(token_stats(packed, alone, ref).cpu(), call, n_calls, dtype, bad)
        stats.append(s)
        bounds.append(b)
    summary = summarize(stats, bounds)
    return RceReport(
        len(episodes),
        tokens,
        diff,
        flat_diff,
        summary.worst_bound,
        str(dtype).replace("torch.", ""),
        backend,
        summary,
        rule_name(dtype),
        ref_max,
    )


def _sup_diff(logits: torch.Tensor, ref: torch.Tensor) -> float:
    """max |logits - ref| over (A, V); inf when the two do not cover the same action tokens."""
    if logits.shape != ref.shape:
        return float("inf")
    return (logits.float() - ref.float()).abs().max().item() if ref.numel() else 0.0


# --- injected faults: each audit must be able to fail ------------------------------------------------
def _row_ids(row: PackedRow) -> list[int]:
    return list(row.prompt_ids + row.response_ids)


def _shift_later_positions(row: PackedRow) -> PackedRow:
    """Calls >= 2 (segment >= 2) one position further on."""
    return dataclasses.replace(
        row, position_ids=tuple(p + int(s >= 2) for p, s in zip(row.position_ids, row.segment_ids))
    )


def _restart_at_zero(row: PackedRow) -> PackedRow:
    """Every call block at positions 0.. instead of continuing from len(q)."""
    p = len(row.prompt_ids)
    return dataclasses.replace(
        row, position_ids=tuple(x - p if s >= 1 else x for x, s in zip(row.position_ids, row.segment_ids))
    )


def _boundary_off_by_one(row: PackedRow) -> PackedRow:
    """The first token of each call block t >= 1 counted as the last token of block t - 1 (segment and
    position), where that token and the next are context: ids, segments and positions stay consistent
    with each other (the layout checks pass), but call t loses a token and call t - 1 sees one more."""
    seg, pos = list(row.segment_ids), list(row.position_ids)
    act = [0] * len(row.prompt_ids) + list(row.response_mask)
    for t in range(2, max(seg) + 1):
        idx = [j for j, s in enumerate(seg) if s == t]
        if len(idx) >= 3 and not act[idx[0]] and not act[idx[1]]:
            seg[idx[0]], pos[idx[0]] = t - 1, pos[idx[0] - 1] + 1
            for j in idx[1:]:
                pos[j] -= 1
    return dataclasses.replace(row, segment_ids=tuple(seg), position_ids=tuple(pos))


def _reversed_block(row: PackedRow) -> PackedRow:
    """The first call block with two different tokens has its tokens reversed (positions, segments and
    the action bookkeeping untouched, as a packer bug that scrambles a block would leave them)."""
    ids, seg = _row_ids(row), row.segment_ids
    for t in range(1, max(seg) + 1):
        idx = [j for j, s in enumerate(seg) if s == t]
        block = [ids[j] for j in idx]
        if block != block[::-1]:
            for j, x in zip(idx, reversed(block)):
                ids[j] = x
            return dataclasses.replace(row, response_ids=tuple(ids[len(row.prompt_ids) :]))
    return row


#: packer faults, applied to each packed row after the layout checks (``segment_meta`` refuses restored
#: positions that do not continue from len(q), so the two position faults model a bug past those checks)
ROW_FAULTS: dict[str, Callable[[PackedRow], PackedRow]] = {
    "positions_shifted_calls_ge_2": _shift_later_positions,
    "blocks_restart_at_0": _restart_at_zero,
    "segment_boundary_off_by_one": _boundary_off_by_one,
    "reversed_call_block": _reversed_block,
}


def _stream(rows: Sequence[PackedRow]) -> tuple[torch.Tensor, torch.Tensor, SegmentMeta]:
    """(1, N) ids and positions of rows in one stream, and their segment metadata (positions unchecked)."""
    ids = torch.tensor([x for r in rows for x in _row_ids(r)])
    pos = torch.tensor([x for r in rows for x in r.position_ids])
    seg = torch.tensor([x for r in rows for x in r.segment_ids])
    row = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([len(r.segment_ids) for r in rows]))
    return ids[None], pos[None], segment_meta(seg, row)


def faulty_packer(fault: Callable[[PackedRow], PackedRow]) -> Packer:
    """``build_layout`` with ``fault`` applied to every ``packed`` row (other layouts as built)."""

    def pack(name: str, episodes: Sequence[Episode], vocab_size: Optional[int] = None) -> BatchLayout:
        layout = build_layout(name, episodes, vocab_size)
        if name != "packed":
            return layout
        ids, pos, meta = _stream([fault(pack_episode(ep)) for ep in episodes])
        return dataclasses.replace(layout, input_ids=ids, position_ids=pos, segments=meta)

    return pack


#: the self-test's reversed-block packer fault as a packer of its own (``tests/test_rce.py``)
reversed_block_packer = faulty_packer(_reversed_block)


def _scale_fault(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SegmentMeta, scale: float, dropout: float
) -> torch.Tensor:
    """The ``torch`` backend with softmax scale x1.5."""
    return BACKENDS["torch"](q, k, v, meta, 1.5 * scale, dropout)


def _gqa_fault(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SegmentMeta, scale: float, dropout: float
) -> torch.Tensor:
    """The ``torch`` backend with the key/value heads rotated by one: each query head group reads another
    group's keys and values (a GQA head-mapping bug)."""
    return BACKENDS["torch"](q, k.roll(1, dims=1), v.roll(1, dims=1), meta, scale, dropout)


def _predecessor_fault(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SegmentMeta, scale: float, dropout: float
) -> torch.Tensor:
    """The ``torch`` backend where every call block after the first of its row also sees the previous
    call block: keys ``[q ; B_{t-1} ; B_t]`` instead of ``[q ; B_t]``."""
    bounds, ks, vs, kis, cu = meta.bounds, [], [], [], [0]
    for s, (qa, qb, ka, kb) in enumerate(bounds):
        lp = (kb - ka) - (qb - qa)  # the q keys in front of the block's own
        kk, vv, ki = k[ka:kb], v[ka:kb], meta.key_index[ka:kb]
        if s > 0 and lp > 0:
            pqa, pqb, pka, pkb = bounds[s - 1]
            if (pkb - pka) - (pqb - pqa) == lp and torch.equal(meta.key_index[pka : pka + lp], ki[:lp]):
                own = slice(pkb - (pqb - pqa), pkb)
                kk, vv = (
                    torch.cat([k[ka : ka + lp], k[own], k[ka + lp : kb]]),
                    torch.cat([v[ka : ka + lp], v[own], v[ka + lp : kb]]),
                )
                ki = torch.cat([ki[:lp], meta.key_index[own], ki[lp:]])
        ks.append(kk)
        vs.append(vv)
        kis.append(ki)
        cu.append(cu[-1] + kk.shape[0])
    lk = torch.tensor(cu).diff()
    wide = SegmentMeta(
        meta.cu_seqlens_q,
        torch.tensor(cu, dtype=torch.int32, device=meta.cu_seqlens_q.device),
        torch.cat(kis),
        meta.max_seqlen_q,
        int(lk.max()),
    )
    return BACKENDS["torch"](q, torch.cat(ks), torch.cat(vs), wide, scale, dropout)


#: attention-backend faults (copies of the ``torch`` backend, registered only inside the self-test)
BACKEND_FAULTS = {
    "softmax_scale_1.5": _scale_fault,
    "gqa_head_mixup": _gqa_fault,
    "block_sees_predecessor": _predecessor_fault,
}


@dataclass(frozen=True)
class SpotReport:
    """The in-training check over a set of packed rows: its per-call verdict and record mismatches."""

    calls: CallSummary
    problems: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return self.calls.passed


@dataclass(frozen=True)
class SpotBatch:
    """What the in-training check reads of a micro-batch (``verl_memopd.audit.rce_spot_check``'s inputs):
    ``logits`` (N, V) of the packed forward over the rows' stream, ``row_start`` (B,) int64, per row its ids
    (L_b,), verl's response mask (R_b,) and its calls' invocation records."""

    logits: torch.Tensor
    row_start: torch.Tensor
    input_ids: list[torch.Tensor]
    response_masks: list[torch.Tensor]
    records: list[list[CallRecord]]


@torch.no_grad()
def packed_spot_batch(
    model: torch.nn.Module,
    episodes: Sequence[Episode],
    backend: str = "torch",
    fault: Optional[Callable[[PackedRow], PackedRow]] = None,
    hf_model: Optional[torch.nn.Module] = None,
) -> SpotBatch:
    """The episodes' packed rows in one remove-padding stream and their packed forward under ``backend``
    (each row passed through the packer ``fault`` when given); the records are the episodes' own. ``model``
    as the engine calls it, ``hf_model`` the Hugging Face model inside (default ``model``; FSDP1 wraps it)."""
    hf_model = model if hf_model is None else hf_model
    rows = [pack_episode(ep) for ep in episodes]
    if fault is not None:
        rows = [fault(r) for r in rows]
    ids, pos, meta = _stream(rows)
    lengths = torch.tensor([len(r.segment_ids) for r in rows])
    device = hf_model.get_input_embeddings().weight.device
    with attention_implementation(hf_model, hf_name(backend)):
        logits = model(
            input_ids=ids.to(device), position_ids=pos.to(device), memopd_segments=meta.to(device), use_cache=False
        ).logits  # (1, N, V)
    return SpotBatch(
        logits.flatten(0, 1),
        torch.cumsum(lengths, 0) - lengths,
        [torch.tensor(_row_ids(r), device=device) for r in rows],
        [torch.tensor(r.response_mask) for r in rows],
        [records_of_episode(ep.invocations) for ep in episodes],
    )


def spot_check_rows(
    model: torch.nn.Module,
    episodes: Sequence[Episode],
    backend: str = "torch",
    fault: Optional[Callable[[PackedRow], PackedRow]] = None,
    hf_model: Optional[torch.nn.Module] = None,
) -> SpotReport:
    """The in-training check (``verl_memopd.audit.rce_spot_check``, as the actor engine runs it) on
    :func:`packed_spot_batch`'s rows (same arguments)."""
    hf_model = model if hf_model is None else hf_model
    batch = packed_spot_batch(model, episodes, backend, fault, hf_model)
    stats, bounds, problems = rce_spot_check(
        model, hf_model, batch.logits, batch.row_start, batch.input_ids, batch.response_masks, batch.records
    )
    return SpotReport(summarize(stats, bounds), problems)


@dataclass(frozen=True)
class SelfTest:
    """Outcome of :func:`self_test`: per case (``clean`` and each fault) the offline report and the
    in-training check's report, the dtype and each audit's wall time on the clean case."""

    dtype: str
    offline: dict[str, RceReport]
    in_training: dict[str, SpotReport]
    seconds: dict[str, float]

    @property
    def faults(self) -> list[str]:
        return [c for c in self.offline if c != "clean"]

    @property
    def detected_offline(self) -> int:
        return sum(not self.offline[c].passed for c in self.faults)

    @property
    def detected_in_training(self) -> int:
        return sum(not self.in_training[c].passed for c in self.faults)

    @property
    def clean_pass(self) -> bool:
        return self.offline["clean"].passed and self.in_training["clean"].passed

    @property
    def ok(self) -> bool:
        n = len(self.faults)
        return self.clean_pass and self.detected_offline == n and self.detected_in_training == n

    def lines(self) -> list[str]:
        out = [f"rule ({self.dtype}): {self.offline['clean'].rule}"]
        for case in self.offline:
            off, spot = self.offline[case], self.in_training[case]
            out.append(f"offline {case}: {'PASS' if off.passed else 'FAIL'} {off.calls.text()}")
            out.append(
                f"in-training {case}: {'PASS' if spot.passed else 'FAIL'} {spot.calls.text()}"
                + (f" records_mismatch={len(spot.problems)}" if spot.problems else "")
            )
        out.append(
            f"seconds clean: offline={self.seconds['offline']:.2f} in_training={self.seconds['in_training']:.2f}"
        )
        out.append(
            f"RCE self-test dtype={self.dtype} faults={len(self.faults)} "
            f"detected_offline={self.detected_offline} detected_in_training={self.detected_in_training} "
            f"clean_pass={int(self.clean_pass)}"
        )
        return out


def self_test(model: torch.nn.Module, episodes: Sequence[Episode], backend: str = "torch") -> SelfTest:
    """Inject each fault of :data:`ROW_FAULTS` (into a copy of the packer) and :data:`BACKEND_FAULTS`
    (copies of the ``torch`` backend registered only inside this call) and run both audits on each;
    the clean case runs the real packer and ``backend``."""
    dtype = str(model.get_input_embeddings().weight.dtype).replace("torch.", "")
    t0 = time.perf_counter()
    offline = {"clean": rce_audit(model, episodes, backend)}
    t1 = time.perf_counter()
    spot = {"clean": spot_check_rows(model, episodes, backend)}
    seconds = {"offline": t1 - t0, "in_training": time.perf_counter() - t1}
    for name, fault in ROW_FAULTS.items():
        offline[name] = rce_audit(model, episodes, backend, pack=faulty_packer(fault))
        spot[name] = spot_check_rows(model, episodes, backend, fault)
    for name, fn in BACKEND_FAULTS.items():
        with scoped_backend("selftest_" + name.replace(".", "_"), fn) as _:
            fault_backend = "selftest_" + name.replace(".", "_")
            offline[name] = rce_audit(model, episodes, backend=fault_backend)
            spot[name] = spot_check_rows(model, episodes, fault_backend)
    return SelfTest(dtype, offline, spot, seconds)


#: the self-test's tiny student has its query and key projections scaled by this factor (attention scores
#: x36): at the default init (std 0.02) the scores have std ~0.05, attention is uniform over the keys and
#: positions or the softmax scale hardly matter to anything -- in bf16 the position and scale faults then
#: move the logits less than bf16's own rounding does. Scaled, the scores have std ~2, as a trained model's.
SELF_TEST_QK_SCALE = 6.0


@torch.no_grad()
def sharpen_attention(model: torch.nn.Module, factor: float) -> torch.nn.Module:
    """Scale every layer's ``q_proj`` and ``k_proj`` (weights and biases) by ``factor``, in place."""
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
            proj.weight.mul_(factor)
            if proj.bias is not None:
                proj.bias.mul_(factor)
    return model
