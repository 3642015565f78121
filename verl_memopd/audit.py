"""RCE audit maths: the tolerance rule, per-call figures and the records-built alone pass (pure torch).

Rollout Context Equivalence: at every action token the packed forward's full-vocabulary logits
must equal those of the call run alone, ``[q ; x_t ; a_t]`` at positions 0..n-1. Both audits use
this module: the offline audit (``python -m verl_memopd.rce``) and the in-training check that the
trainer wires into the actor's old-log-prob forward (``verl_memopd.trainer.audit``). It imports
neither verl nor the trainer.

The tolerance rule (fp32: ``TOLERANCES``; bf16 / fp16: ``NOISE_FLOOR_RULES``, the measured noise floor of
the model's own low-precision pass against an fp32 reference of the same weights) is stated, justified
and measured in one place: the ``verl_memopd.rce`` module docstring (and docs/recipe.md's RCE section).

Per call the audits also report ``max_kl`` (``max_k KL(p_alone || p_packed)`` of the next-token
distributions) and ``top1_agreement`` (share of action tokens whose argmax agrees): what training
consumes.

The in-training check does not trust the packer: :func:`record_calls` rebuilds each call from the
invocation records the agent loop wrote (``prompt_ids + response_ids``, positions 0..n-1) and pairs
its action tokens with the packed row's action tokens (verl's ``response_mask``) in order, checking
the token ids; the packed rows' segment ids and positions are never read.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

from verl_memopd.attention import attention_implementation
from verl_memopd.fp32_reference import Fp32ReferenceError, fp32_replica, upcast_to_fp32

__all__ = [
    "Tolerance",
    "TOLERANCES",
    "NoiseFloorRule",
    "NOISE_FLOOR_RULES",
    "TOKEN_COLUMNS",
    "STAT_COLUMNS",
    "CallRecord",
    "records_of_episode",
    "encode_records",
    "decode_records",
    "AloneCalls",
    "record_calls",
    "token_stats",
    "per_call_stats",
    "upcast_to_fp32",
    "compute_dtype",
    "reference_precision",
    "stock_attention",
    "alone_pass_stats",
    "rce_spot_check",
    "RceAuditError",
    "CallSummary",
    "summarize",
]

logger = logging.getLogger(__name__)


class RceAuditError(RuntimeError):
    """The RCE check found a call whose packed logits differ from the call run alone (or could not run)."""


# --- the rule ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tolerance:
    """Allowed ``max |l_pack - l_ind|``: ``atol + rtol * max |l_ind|`` over the audited logits."""

    atol: float
    rtol: float

    def __post_init__(self) -> None:
        if self.atol < 0 or self.rtol < 0 or self.atol + self.rtol == 0:
            raise ValueError(f"Tolerance needs atol, rtol >= 0, not both 0; got {self}")

    def bound(self, ref_max_abs: float) -> float:
        return self.atol + self.rtol * ref_max_abs


#: Direct bound on ``max |l_packed - l_alone|``. fp32: the rule, ``1e-4 + 2^-15 max |l_alone|`` (summation order
#: only: ~1e-6 on the tiny models, up to 1.2e-4 on 30-layer SmolLM2 whose logits reach ~40; see
#: ``verl_memopd.rce``). fp16 / bf16: a relative bound (8 ulps of the largest logit), a fallback used only
#: where no fp32 reference runs (``alone_pass_stats(reference=False)``, or no replica could be built; it warns).
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-4, rtol=2.0**-15),
    torch.float16: Tolerance(atol=0.0, rtol=8 * 2.0**-10),
    torch.bfloat16: Tolerance(atol=0.0, rtol=8 * 2.0**-7),
}


@dataclass(frozen=True)
class NoiseFloorRule:
    """``max |l_packed - l_ref| <= k * max |l_alone - l_ref| + eps_ulps * unit * max |l_ref|`` per call."""

    k: float
    eps_ulps: float
    unit: float

    def __post_init__(self) -> None:
        if self.k < 1 or self.eps_ulps <= 0 or not 0 < self.unit < 1:
            raise ValueError(f"NoiseFloorRule needs k >= 1, eps_ulps > 0, 0 < unit < 1; got {self}")

    def bound(self, alone_err: torch.Tensor, ref_max_abs: torch.Tensor) -> torch.Tensor:
        return self.k * alone_err + self.eps_ulps * self.unit * ref_max_abs


#: The low-precision rule (``verl_memopd.rce`` docstring): k = 3, eps = 4 ulps of the call's largest fp32 logit.
NOISE_FLOOR_RULES: dict[torch.dtype, NoiseFloorRule] = {
    torch.bfloat16: NoiseFloorRule(k=3.0, eps_ulps=4.0, unit=2.0**-8),
    torch.float16: NoiseFloorRule(k=3.0, eps_ulps=4.0, unit=2.0**-11),
}

#: per action token (:func:`token_stats`), (A, 6) float32
TOKEN_COLUMNS = ("packed_vs_alone", "packed_vs_ref", "alone_vs_ref", "kl", "top1_agree", "ref_max_abs")
#: per call (:func:`per_call_stats`), (S, 5) float32. ``audited`` is what the bound applies to: packed vs
#: alone (fp32, or the low-precision fallback) or packed vs the fp32 reference (noise-floor rule);
#: ``noise_floor`` = max |l_alone - l_ref| (NaN without a reference).
STAT_COLUMNS = ("audited", "max_abs_diff", "noise_floor", "max_kl", "top1_agreement")


@torch.no_grad()
def token_stats(packed: torch.Tensor, alone: torch.Tensor, ref: Optional[torch.Tensor]) -> torch.Tensor:
    """Per action token, from its logits (n, V) under the three passes (``ref`` None: fp32 model, or no
    reference): :data:`TOKEN_COLUMNS`, (n, 6) float32. Without a reference the ``alone`` logits are the
    reference (``packed_vs_ref = packed_vs_alone``, ``alone_vs_ref`` NaN)."""
    p, a = packed.float(), alone.float()
    d_pa = (p - a).abs().amax(-1)
    lp, la = F.log_softmax(p, -1), F.log_softmax(a, -1)
    kl = (la.exp() * (la - lp)).sum(-1).clamp(min=0)
    top1 = (p.argmax(-1) == a.argmax(-1)).float()
    if ref is None:
        d_pr, d_ar, r_max = d_pa, torch.full_like(d_pa, float("nan")), a.abs().amax(-1)
    else:
        r = ref.float()
        d_pr, d_ar, r_max = (p - r).abs().amax(-1), (a - r).abs().amax(-1), r.abs().amax(-1)
    return torch.stack([d_pa, d_pr, d_ar, kl, top1, r_max], 1)


def per_call_stats(
    tokens: torch.Tensor, call: torch.Tensor, n_calls: int, dtype: torch.dtype, bad: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Aggregate :func:`token_stats` (A, 6) over each token's call (A,) into :data:`STAT_COLUMNS` (S, 5)
    and each call's bound (S,), both float32. ``dtype``: the logits' dtype -- fp32 (or a low-precision
    pass without a reference, column ``alone_vs_ref`` NaN): :data:`TOLERANCES`; else
    :data:`NOISE_FLOOR_RULES`. ``bad`` (S,) bool: calls whose tokens did not match their record
    (audited = inf). A call without action tokens: all 0, top-1 agreement 1, bound = the rule's floor."""
    dev = tokens.device
    call = call.to(dev)

    def amax(col: int) -> torch.Tensor:
        return torch.zeros(n_calls, device=dev).scatter_reduce(0, call, tokens[:, col], "amax", include_self=True)

    d_pa, d_pr, kl, r_max = amax(0), amax(1), amax(3), amax(5)
    counts = torch.zeros(n_calls, device=dev).index_add_(0, call, torch.ones_like(tokens[:, 0]))
    agree = torch.zeros(n_calls, device=dev).index_add_(0, call, tokens[:, 4])
    top1 = torch.where(counts > 0, agree / counts.clamp(min=1), torch.ones_like(agree))
    with_ref = bool(tokens.shape[0]) and not torch.isnan(tokens[:, 2]).all()
    if dtype in NOISE_FLOOR_RULES and with_ref:
        floor = amax(2)
        bound, audited = NOISE_FLOOR_RULES[dtype].bound(floor, r_max), d_pr
    else:
        if dtype not in TOLERANCES:
            raise KeyError(f"RCE: no tolerance for logits of dtype {dtype}; known: {', '.join(map(str, TOLERANCES))}")
        tol = TOLERANCES[dtype]
        floor = torch.full((n_calls,), float("nan"), device=dev)
        bound, audited = tol.atol + tol.rtol * r_max, d_pa
    if bad is not None and bool(bad.any()):
        audited = torch.where(bad.to(dev), torch.full_like(audited, float("inf")), audited)
    return torch.stack([audited, d_pa, floor, kl, top1], 1).float(), bound.float()


# --- the invocation records -------------------------------------------------------------------------
@dataclass(frozen=True)
class CallRecord:
    """One call as the agent loop recorded it: ``ids`` (n,) int64 = ``prompt_ids + response_ids``;
    ``action`` (n,) bool -- True at the response tokens the policy sampled (``action_mask``)."""

    ids: torch.Tensor
    action: torch.Tensor

    def __post_init__(self) -> None:
        if self.ids.dim() != 1 or self.ids.shape != self.action.shape:
            raise ValueError(
                f"CallRecord: ids {tuple(self.ids.shape)} and action {tuple(self.action.shape)} must "
                f"be equal 1-D tensors"
            )
        if self.ids.numel() and bool(self.action[0]):
            raise ValueError("CallRecord: the first token cannot be an action token (nothing predicts it)")


def records_of_episode(invocations: Sequence) -> list[CallRecord]:
    """The calls of one episode, from ``Invocation`` objects or their dicts (``Episode.to_dict()``:
    ``prompt_ids``, ``response_ids``, ``action_mask``, the latter None = all sampled)."""
    out = []
    for t, inv in enumerate(invocations):
        get = inv.get if isinstance(inv, dict) else lambda k, d=None, i=inv: getattr(i, k, d)
        prompt, response = list(get("prompt_ids")), list(get("response_ids"))
        mask = get("action_mask")
        mask = [True] * len(response) if mask is None else [bool(m) for m in mask]
        if not prompt or len(mask) != len(response):
            raise ValueError(
                f"call {t}: a record needs a non-empty prompt_ids and an action_mask as long as "
                f"response_ids ({len(mask)} vs {len(response)})"
            )
        out.append(
            CallRecord(
                torch.tensor(prompt + response, dtype=torch.long),
                torch.tensor([False] * len(prompt) + mask, dtype=torch.bool),
            )
        )
    return out


def encode_records(calls: Sequence[CallRecord]) -> dict[str, torch.Tensor]:
    """One row's calls as three 1-D tensors (to travel as verl row fields): ``ids`` (T,) and ``action``
    (T,) int64 of the calls concatenated, ``lengths`` (C,) int64 per call. No calls (verl's padding
    rows): one placeholder token and ``lengths = [0]``."""
    if not calls:
        return {
            "ids": torch.zeros(1, dtype=torch.long),
            "action": torch.zeros(1, dtype=torch.long),
            "lengths": torch.zeros(1, dtype=torch.long),
        }
    return {
        "ids": torch.cat([c.ids for c in calls]),
        "action": torch.cat([c.action for c in calls]).long(),
        "lengths": torch.tensor([c.ids.numel() for c in calls], dtype=torch.long),
    }


def decode_records(ids: torch.Tensor, action: torch.Tensor, lengths: torch.Tensor) -> list[CallRecord]:
    """Inverse of :func:`encode_records` (zero-length calls are placeholders and dropped)."""
    lengths = lengths.reshape(-1).long()
    total = int(lengths.sum())
    if total > ids.numel() or ids.shape != action.shape:
        raise ValueError(
            f"RCE records: lengths sum to {total}, ids has {ids.numel()} and action {action.numel()} entries"
        )
    parts = zip(ids[:total].split(lengths.tolist()), action[:total].split(lengths.tolist()))
    return [CallRecord(i.long(), a.bool()) for i, a in parts if i.numel()]


@dataclass(frozen=True)
class AloneCalls:
    """Every recorded call of a micro-batch as its own sequence, right-padded; paired with the packed rows.

    Shapes: S calls, L = longest call, A action tokens paired (in row, call, token order).

    Attributes:
        input_ids: (S, L) int64 -- the call's ``prompt_ids + response_ids``, padded with its first token.
        position_ids: (S, L) int64 -- 0..L-1 on every row (real tokens at 0..n-1, padding after).
        alone_index: (A,) int64 -- index into the ``S * L`` stream of the position predicting each action token.
        row: (A,) int64 -- the packed row b of each action token.
        packed_pos: (A,) int64 -- index in row b of the position predicting it in the packed forward.
        call: (A,) int64 -- which of the S calls it belongs to.
        calls: per call s, ``(b, t)``: row and call index t.
        bad: (S,) bool -- the call's action tokens do not match the packed row (count or token ids).
        problems: a description of each mismatch (for the error message).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    alone_index: torch.Tensor
    row: torch.Tensor
    packed_pos: torch.Tensor
    call: torch.Tensor
    calls: tuple[tuple[int, int], ...]
    bad: torch.Tensor
    problems: tuple[str, ...]


def record_calls(
    records: Sequence[Sequence[CallRecord]], input_ids: Sequence[torch.Tensor], response_masks: Sequence[torch.Tensor]
) -> AloneCalls:
    """Lay out each row's recorded calls alone and pair their action tokens with the packed row's.

    Per row b: ``records[b]`` its calls; ``input_ids[b]`` (L_b,) the packed row and ``response_masks[b]``
    (R_b,) verl's response mask (response token j at row index ``P_b + j``, ``P_b = L_b - R_b``). The
    k-th action token of the records is the k-th masked response token of the row; its token id must
    match. A row whose action count differs has every call marked bad (nothing can be paired); a call
    whose ids differ is marked bad. A micro-batch without calls still gets one 1-token sequence (one
    forward per micro-batch on every data-parallel rank)."""
    seqs, alone, row_of, packed, call_of, calls, bad, problems = [], [], [], [], [], [], [], []
    for b, (recs, tok, rmask) in enumerate(zip(records, input_ids, response_masks)):
        p = tok.numel() - rmask.numel()
        targets = p + torch.nonzero(rmask.to(tok.device).bool(), as_tuple=True)[0]  # packed action token indices
        n_rec = sum(int(r.action.sum()) for r in recs)
        count_ok = n_rec == targets.numel()
        if not count_ok:
            problems.append(f"row {b}: {n_rec} recorded action tokens, the packed row has {targets.numel()}")
        k = 0
        for t, rec in enumerate(recs):
            s = len(seqs)
            seqs.append(rec.ids.to(tok.device))
            calls.append((b, t))
            js = torch.nonzero(rec.action, as_tuple=True)[0].to(tok.device)  # action token indices in the call
            if not count_ok:
                bad.append(True)
                continue
            tgt = targets[k : k + js.numel()]
            k += js.numel()
            same = torch.equal(tok[tgt], seqs[-1][js])
            bad.append(not same)
            if not same:
                problems.append(f"row {b} call {t}: the packed row's action token ids differ from the record's")
            alone.append((s, js - 1))
            row_of.append(torch.full_like(js, b))
            packed.append(tgt - 1)
            call_of.append(torch.full_like(js, s))
    device = input_ids[0].device if input_ids else torch.device("cpu")
    if not seqs:
        seqs = [input_ids[0][:1] if input_ids else torch.zeros(1, dtype=torch.long)]
    width = max(x.numel() for x in seqs)
    ids = torch.stack([F.pad(x, (0, width - x.numel()), value=int(x[0])) for x in seqs])

    def cat(parts: list) -> torch.Tensor:
        return torch.cat(parts).to(device) if parts else torch.zeros(0, dtype=torch.long, device=device)

    return AloneCalls(
        ids,
        torch.arange(width, device=device).expand(len(seqs), width).contiguous(),
        cat([s * width + j for s, j in alone]),
        cat(row_of),
        cat(packed),
        cat(call_of),
        tuple(calls),
        torch.tensor(bad, dtype=torch.bool),
        tuple(problems),
    )


# --- the alone pass -------------------------------------------------------------------------------------
def stock_attention(device: torch.device) -> str:
    """The reference attention of the alone pass: transformers' ``flash_attention_2`` on CUDA when
    flash-attn is installed (the model's own flash path), else ``sdpa``."""
    import importlib.util

    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def _head_of(hf_model: torch.nn.Module) -> torch.nn.Module:
    head = hf_model.get_output_embeddings()
    return getattr(head, "_fsdp_wrapped_module", head)  # an FSDP1-wrapped head: hook the module inside


def _run_alone(
    module: torch.nn.Module,
    hf_model: torch.nn.Module,
    calls: AloneCalls,
    device: torch.device,
    on_hidden,
    attention: Optional[str] = None,
) -> None:
    """One forward of the alone rows under stock attention (``attention``, default :func:`stock_attention`);
    ``on_hidden(head, h)`` gets the final hidden states at the predicting positions (A, H) inside a pre-hook of
    the output head (where FSDP has gathered its weights), and the head itself then projects nothing."""
    head = _head_of(hf_model)
    seen = []

    def hook(mod: torch.nn.Module, args: tuple) -> tuple:
        hidden = args[0]  # (S, L, H): final normed hidden states of the alone rows
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, calls.alone_index.to(hidden.device))
        on_hidden(mod, h, hidden)
        seen.append(1)
        return (hidden[:, :0],) + tuple(args[1:])

    handle = head.register_forward_pre_hook(hook)
    try:
        with attention_implementation(hf_model, attention or stock_attention(device)):
            module(
                input_ids=calls.input_ids.to(device),
                position_ids=calls.position_ids.to(device),
                attention_mask=None,
                use_cache=False,
            )
    finally:
        handle.remove()
    if not seen:
        raise RceAuditError(
            "RCE check: the model never called its output head (fused kernels?); the audit "
            "needs the plain lm_head path (actor_rollout_ref.model.use_fused_kernels=false)"
        )


@contextmanager
def reference_precision(device: torch.device, tf32: bool) -> Iterator[None]:
    """fp32 matrix products of the reference pass: exact fp32 (``tf32=False``), or on CUDA TF32 tensor-core
    products with fp32 accumulation (``tf32=True``): ~8x less rounding than bf16 (10 vs 7 mantissa bits),
    an order of magnitude faster than exact fp32 on a GPU (no effect on the CPU)."""
    if device.type != "cuda":
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _fp32_head(weight: torch.Tensor, bias: Optional[torch.Tensor], h32: torch.Tensor) -> torch.Tensor:
    return F.linear(h32.float(), weight.float(), None if bias is None else bias.float())


def compute_dtype(packed_logits: torch.Tensor, hf_model: torch.nn.Module) -> torch.dtype:
    """The dtype the low-precision passes compute in: the packed logits' when fp16 / bf16 (FSDP mixed
    precision keeps fp32 parameters and computes in bf16), else the parameters'."""
    if packed_logits.dtype in NOISE_FLOOR_RULES:
        return packed_logits.dtype
    return next(hf_model.parameters()).dtype


_warned_fallback = False


@torch.no_grad()
def alone_pass_stats(
    module: torch.nn.Module,
    hf_model: torch.nn.Module,
    packed_logits: torch.Tensor,
    packed_index: torch.Tensor,
    calls: AloneCalls,
    chunk: int = 256,
    reference: bool = True,
    reference_tf32: bool = True,
) -> tuple[torch.Tensor, torch.dtype]:
    """Run ``calls`` alone (``module``: the engine's model, FSDP-wrapped or not; ``hf_model`` the HF model
    inside it) and compare with the packed forward at the action tokens, ``chunk`` tokens at a time.

    ``packed_logits``: (M, V) the packed forward's logits, rows concatenated (read in place);
    ``packed_index``: (A,) the row of each action token's prediction in it. When the passes compute in fp16 /
    bf16 (:func:`compute_dtype`; and ``reference``) the alone pass runs first as the fp32 reference
    (:func:`verl_memopd.fp32_reference.fp32_replica`: the same weights rounded to that dtype, every operation in
    fp32, also under FSDP; autocast off; ``reference_tf32``: TF32 products on CUDA,
    :func:`reference_precision`), keeping only its (A, H) hidden states and its head's weights, for the
    noise-floor rule. Returns :func:`token_stats` (A, 6) and the logits' dtype."""
    global _warned_fallback
    device = packed_logits.device
    packed_index = packed_index.to(device)
    dtype = compute_dtype(packed_logits, hf_model)
    ref: dict = {}

    def keep(mod: torch.nn.Module, h: torch.Tensor, _) -> None:
        ref.update(
            h=h, weight=mod.weight.detach(), bias=None if getattr(mod, "bias", None) is None else mod.bias.detach()
        )

    missing = "reference=False"
    if reference and dtype in NOISE_FLOOR_RULES:
        try:
            with fp32_replica(module, hf_model, dtype, device) as replica:
                missing = "the parameters cannot be upcast"
                if replica is not None:
                    with torch.autocast(device.type, enabled=False), reference_precision(device, reference_tf32):
                        _run_alone(replica, replica, calls, device, keep, "sdpa")  # flash-attn has no fp32
        except Fp32ReferenceError as e:  # same model on every rank: every rank fails here alike
            missing = str(e)
    found: dict = {}

    def compare(mod: torch.nn.Module, h: torch.Tensor, hidden: torch.Tensor) -> None:
        found["dtype"] = mod.forward(hidden[:1, :1]).dtype  # .forward: no hooks (this runs inside one)
        out = [h.new_zeros(0, len(TOKEN_COLUMNS), dtype=torch.float32)]
        for i in range(0, h.shape[0], chunk):
            alone = mod.forward(h[i : i + chunk])
            with reference_precision(device, reference_tf32):
                r = None if "h" not in ref else _fp32_head(ref["weight"], ref["bias"], ref["h"][i : i + chunk])
            out.append(token_stats(packed_logits[packed_index[i : i + chunk]], alone, r))
        found["stats"] = torch.cat(out)

    _run_alone(module, hf_model, calls, device, compare)
    if reference and found["dtype"] in NOISE_FLOOR_RULES and "h" not in ref and not _warned_fallback:
        _warned_fallback = True
        logger.warning(
            "RCE check: %s logits but no fp32 reference (%s); using the relative fallback bound TOLERANCES[%s]",
            found["dtype"],
            missing,
            found["dtype"],
        )
    return found["stats"], found["dtype"]


def rce_spot_check(
    module: torch.nn.Module,
    hf_model: torch.nn.Module,
    packed_logits: torch.Tensor,
    row_start: torch.Tensor,
    input_ids: Sequence[torch.Tensor],
    response_masks: Sequence[torch.Tensor],
    records: Sequence[Sequence[CallRecord]],
    chunk: int = 256,
    reference: bool = True,
    reference_tf32: bool = True,
) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple[str, ...]]:
    """The in-training RCE check of one micro-batch (what the actor engine runs on an audit step).

    Args:
        module / hf_model: the model as the engine calls it (FSDP-wrapped or not) and the HF model inside.
        packed_logits: (M, V) the packed forward's logits with rows concatenated (a view, not a copy).
        row_start: (B,) int64 -- where row b starts in ``packed_logits``.
        input_ids / response_masks: per row b, (L_b,) and (R_b,) (see :func:`record_calls`).
        records: per row b, its calls as the agent loop recorded them (:class:`CallRecord`).

    Returns per row b its calls' :data:`STAT_COLUMNS` (n_calls_b, 5) and bounds (n_calls_b,), float32 on
    the CPU, and the record mismatches found (descriptions).
    """
    calls = record_calls(records, input_ids, response_masks)
    device = packed_logits.device
    packed_index = row_start.to(device)[calls.row.to(device)] + calls.packed_pos.to(device)
    tokens, dtype = alone_pass_stats(
        module, hf_model, packed_logits, packed_index, calls, chunk, reference, reference_tf32
    )
    stats, bound = per_call_stats(tokens, calls.call, len(calls.calls), dtype, calls.bad)
    rows: list[list[int]] = [[] for _ in input_ids]
    for i, (b, _) in enumerate(calls.calls):
        rows[b].append(i)
    pick = [torch.tensor(ix, dtype=torch.long, device=stats.device) for ix in rows]
    return [stats[ix].cpu() for ix in pick], [bound[ix].cpu() for ix in pick], calls.problems


@dataclass(frozen=True)
class CallSummary:
    """The verdict over many calls' :data:`STAT_COLUMNS` and bounds: ``failed`` calls (audited > bound,
    or not finite), ``worst_ratio`` = max audited / bound (> 1 fails), the largest packed-vs-alone
    difference, the largest noise floor (NaN: fp32 rule or fallback), the largest KL and the lowest
    top-1 agreement of any call; ``floor_ratio`` (printed ``k_needed``) = max over calls of
    ``|l_packed - l_ref| / |l_alone - l_ref|``, the smallest ``k`` that would pass them with eps = 0."""

    calls: int
    failed: int
    worst_ratio: float
    worst_bound: float
    max_abs_diff: float
    noise_floor: float
    max_kl: float
    min_top1: float
    floor_ratio: float = float("nan")

    @property
    def passed(self) -> bool:
        return self.failed == 0

    def text(self) -> str:
        return (
            f"calls={self.calls} failed={self.failed} worst_diff_over_bound={self.worst_ratio:.3g} "
            f"max_abs_diff={self.max_abs_diff:.3e} noise_floor={self.noise_floor:.3e} "
            f"max_kl={self.max_kl:.3e} min_top1={self.min_top1:.4f} k_needed={self.floor_ratio:.3g}"
        )


def summarize(stats: Sequence[torch.Tensor], bounds: Sequence[torch.Tensor]) -> CallSummary:
    """:class:`CallSummary` of per-row (or per-batch) :data:`STAT_COLUMNS` (n, 5) and bounds (n,)."""
    s = torch.cat([x.reshape(-1, len(STAT_COLUMNS)).float() for x in stats]) if stats else torch.zeros(0, 5)
    b = torch.cat([x.reshape(-1).float() for x in bounds]) if bounds else torch.zeros(0)
    if s.shape[0] == 0:
        return CallSummary(0, 0, 0.0, float("nan"), 0.0, float("nan"), 0.0, 1.0)
    audited = s[:, 0]
    failed = int(((audited > b) | ~torch.isfinite(audited)).sum())
    ratio = audited / b.clamp(min=1e-30)
    worst = int(torch.nan_to_num(ratio, nan=float("inf")).argmax())
    floor = s[:, 2]
    has_floor = ~torch.isnan(floor)
    usable = has_floor & (floor > 0) & torch.isfinite(audited)
    return CallSummary(
        int(s.shape[0]),
        failed,
        float(ratio[worst]),
        float(b[worst]),
        float(s[:, 1].max()),
        float(floor[has_floor].max()) if has_floor.any() else float("nan"),
        float(s[:, 3].max()),
        float(s[:, 4].min()),
        float((audited[usable] / floor[usable]).max()) if usable.any() else float("nan"),
    )
