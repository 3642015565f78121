"""In-training audits of the layout (``memopd.audit``), run on every N-th step.

RCE spot-check (actor, old-log-prob forward)
    Packed layout only. The method's Rollout Context Equivalence: at every action token, the
    full-vocabulary logits of the packed forward must equal those of the call run alone,
    ``[q, x_t, a_t]`` with positions 0..n-1. The alone pass must not share the code it audits: it
    runs under the model's **stock** attention (``sdpa`` on CPU, transformers' own
    ``flash_attention_2`` on CUDA when flash-attn is installed; :func:`stock_attention`), never a
    ``memopd_*`` backend, on right-padded rows ``(S, L)`` built from the packed rows' tokens and
    segment ids (:func:`alone_calls`), with positions 0..n-1 rather than the rows' restored ones.
    All calls of a micro-batch go in one extra forward, so every data-parallel rank makes the same
    number of forwards. Logits are formed only at the action tokens, ``chunk`` tokens at a time,
    from the final hidden states the model hands its output head (:func:`alone_pass_diffs`), and
    compared with the packed forward's logits read in place: no second (N, V) tensor exists.
    Per row the engine returns each call's max abs logit difference (``memopd_rce_max_abs_diff``)
    and its tolerance (``memopd_rce_tolerance``: the dtype's ``verl_memopd.rce.TOLERANCES`` bound),
    both (B, n_calls*); the trainer reports ``memopd/audit/rce_*`` and, on a call above its
    tolerance, raises :class:`RceAuditError` or warns (``memopd.audit.on_failure``).

Aligned-vs-flat teacher KL (teacher + actor loss)
    Packed layout only. The teacher scores the step's rows a second time under the flat layout (persistent history,
    the paper's baseline) into ``memopd_teacher_hidden_flat``; the actor loss reports
    ``KL(p_T aligned || p_T flat)`` per teacher-supervised token: how far the baseline's
    supervision is from the state the student sampled in. With ``memopd.teacher.state=flat`` the
    supervision is the flat one and the audit pass scores the aligned rows instead
    (``memopd_teacher_hidden_aligned``); the metric is the same KL, aligned || flat.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from verl_memopd.attention import attention_implementation
from verl_memopd.rce import TOLERANCES
from verl_memopd.trainer.config import AUDIT_ON_FAILURE

logger = logging.getLogger(__name__)


#: non-tensor flag on the old-log-prob batch: run the RCE spot-check in the actor engine
RCE_FLAG = "memopd_audit_rce"
#: per-row output of the RCE spot-check: max |logit_packed - logit_alone| of each call, (n_calls,)
RCE_FIELD = "memopd_rce_max_abs_diff"
#: per-row output of the RCE spot-check: the dtype's tolerance for each call's difference, (n_calls,)
RCE_TOLERANCE_FIELD = "memopd_rce_tolerance"
#: non-tensor option of a teacher batch: the TransferQueue field its hidden states go to
TEACHER_OUTPUT_KEY = "memopd_teacher_output_key"
TEACHER_HIDDEN_FLAT = "memopd_teacher_hidden_flat"
#: the audit pass of ``memopd.teacher.state=flat``: the supervision is flat, the audit scores the aligned rows
TEACHER_HIDDEN_ALIGNED = "memopd_teacher_hidden_aligned"


class RceAuditError(RuntimeError):
    """The in-training RCE spot-check found a call whose packed logits differ from the call run alone."""


@dataclass(frozen=True)
class AloneCalls:
    """Every call of a micro-batch's packed rows as its own sequence ``[q ; block_t]``, right-padded.

    Shapes: S calls, L = longest ``[q ; block_t]``, A action tokens (in row, call, token order).

    Attributes:
        input_ids: (S, L) int64 -- ``q`` then call t's block, padded with the row's first token.
        position_ids: (S, L) int64 -- 0..L-1 on every row (real tokens at 0..n-1, padding after).
        alone_index: (A,) int64 -- flat ``S * L`` index of the position predicting each action token.
        row: (A,) int64 -- the packed row b of each action token.
        packed_pos: (A,) int64 -- index in row b of the position predicting it in the packed forward.
        call: (A,) int64 -- which of the S calls it belongs to.
        calls: per call s, ``(b, t)``: row and call index t (segment ``t + 1``).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    alone_index: torch.Tensor
    row: torch.Tensor
    packed_pos: torch.Tensor
    call: torch.Tensor
    calls: tuple[tuple[int, int], ...]


def alone_calls(input_ids: Sequence[torch.Tensor], segment_ids: Sequence[torch.Tensor],
                response_masks: Sequence[torch.Tensor]) -> AloneCalls:
    """Lay out each packed row's calls alone. Per row b: ``input_ids`` / ``segment_ids`` (L_b,)
    (0 = q, t+1 = call t) and verl's ``response_mask`` (R_b,), response token j at row index
    ``P_b + j`` with ``P_b = L_b - R_b``. A row without call blocks (verl's padding rows) adds
    nothing; a micro-batch without any call still gets one 1-token sequence (one forward per
    micro-batch on every rank). The restored ``position_ids`` are not used: alone, a call sits at 0..n-1."""
    seqs, alone, row_of, packed, call_of, calls = [], [], [], [], [], []
    for b, (tok, seg, rmask) in enumerate(zip(input_ids, segment_ids, response_masks)):
        p = tok.numel() - rmask.numel()
        action = torch.zeros_like(seg, dtype=torch.bool)
        action[p:] = rmask.bool()
        for t in range(int(seg[p:].max()) if seg.numel() > p else 0):
            block = torch.nonzero(seg == t + 1, as_tuple=True)[0]
            if block.numel() == 0:
                continue
            s = len(seqs)
            seqs.append(torch.cat([tok[:p], tok[block]]))
            targets = torch.nonzero(action[block], as_tuple=True)[0]  # indices within the block
            alone.append((s, p + targets - 1))
            row_of.append(torch.full_like(targets, b))
            packed.append(block[targets] - 1)
            call_of.append(torch.full_like(targets, s))
            calls.append((b, t))
    device = input_ids[0].device
    if not seqs:
        seqs = [input_ids[0][:1]]
    width = max(x.numel() for x in seqs)
    ids = torch.stack([F.pad(x, (0, width - x.numel()), value=int(x[0])) for x in seqs])
    alone_index = torch.cat([s * width + j for s, j in alone]) if alone else torch.zeros(0, dtype=torch.long)

    def cat(parts: list) -> torch.Tensor:
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)

    return AloneCalls(ids, torch.arange(width, device=device).expand(len(seqs), width).contiguous(),
                      alone_index.to(device), cat(row_of), cat(packed), cat(call_of), tuple(calls))


def stock_attention(device: torch.device) -> str:
    """The reference attention of the alone pass: transformers' ``flash_attention_2`` on CUDA when
    flash-attn is installed (the model's own flash path), else ``sdpa``."""
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def _compare_chunked(head: torch.nn.Module, hidden: torch.Tensor, packed_logits: torch.Tensor,
                     packed_index: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per action token: max |l_packed - l_alone| and max |l_alone| over the vocabulary, (A,) float32.
    ``hidden`` (A, H) alone final hidden states; ``packed_logits`` (M, V) read at ``packed_index`` (A,).
    At most (chunk, V) logits of each side exist at once."""
    diff, ref = [hidden.new_zeros(0, dtype=torch.float32)], [hidden.new_zeros(0, dtype=torch.float32)]
    for i in range(0, hidden.shape[0], chunk):
        alone = head.forward(hidden[i:i + chunk])  # .forward: no hooks (this runs inside one)
        packed = packed_logits[packed_index[i:i + chunk]]  # (chunk, V) copy; index_select is ~10x slower on CPU
        diff.append((packed.float() - alone.float()).abs().amax(-1))
        ref.append(alone.float().abs().amax(-1))
    return torch.cat(diff), torch.cat(ref)


@torch.no_grad()
def alone_pass_diffs(module: torch.nn.Module, hf_model: torch.nn.Module, packed_logits: torch.Tensor,
                     packed_index: torch.Tensor, calls: AloneCalls, chunk: int = 256
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """Run ``calls`` alone in one forward of ``module`` (the engine's model, FSDP-wrapped or not; ``hf_model``
    the HF model inside it) under :func:`stock_attention`, and compare at the action tokens.

    ``packed_logits``: (M, V) the packed forward's logits, rows flattened; ``packed_index``: (A,) the row of
    each action token's prediction in it. The comparison runs in a pre-hook of the output head, where
    the head's weights are gathered even under FSDP (FSDP2 unshards in its own pre-hook, registered first;
    FSDP1 inside its forward, around the module hooked here); the head itself then projects nothing.
    Returns per action token ``(max_abs_diff (A,), max_abs_alone_logit (A,))`` float32 and the logits' dtype.
    """
    head = hf_model.get_output_embeddings()
    head = getattr(head, "_fsdp_wrapped_module", head)  # an FSDP1-wrapped head: hook the module inside (unsharded)
    found: dict = {}

    def compare(mod: torch.nn.Module, args: tuple) -> tuple:
        hidden = args[0]  # (S, L, H): final normed hidden states of the alone rows
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, calls.alone_index.to(hidden.device))
        found["dtype"] = mod.forward(hidden[:1, :1]).dtype
        found["diff"], found["ref"] = _compare_chunked(mod, h, packed_logits, packed_index.to(hidden.device), chunk)
        return (hidden[:, :0],) + tuple(args[1:])

    handle = head.register_forward_pre_hook(compare)
    device = packed_logits.device
    try:
        with attention_implementation(hf_model, stock_attention(device)):
            module(input_ids=calls.input_ids.to(device), position_ids=calls.position_ids.to(device),
                   attention_mask=None, use_cache=False)
    finally:
        handle.remove()
    if "diff" not in found:
        raise RceAuditError("RCE spot-check: the model never called its output head (fused kernels?); the audit "
                            "needs the plain lm_head path (actor_rollout_ref.model.use_fused_kernels=false)")
    return found["diff"], found["ref"], found["dtype"]


def per_call(calls: AloneCalls, diff: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
             n_rows: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per row b, each call's max abs difference and its tolerance (``TOLERANCES[dtype]`` bound on the
    call's largest alone logit), both (n_calls_b,) float32 in call order (a call without action tokens: 0, atol)."""
    if dtype not in TOLERANCES:
        raise KeyError(f"RCE spot-check: no tolerance for logits of dtype {dtype}; known: "
                       f"{', '.join(map(str, TOLERANCES))}")
    tol = TOLERANCES[dtype]
    s = len(calls.calls)
    call = calls.call.to(diff.device)
    call_diff = torch.zeros(s, device=diff.device).scatter_reduce(0, call, diff, "amax")
    call_ref = torch.zeros(s, device=diff.device).scatter_reduce(0, call, ref, "amax")
    bound = tol.atol + tol.rtol * call_ref
    rows: list[list[int]] = [[] for _ in range(n_rows)]
    for i, (b, _) in enumerate(calls.calls):
        rows[b].append(i)
    pick = [torch.tensor(ix, dtype=torch.long, device=diff.device) for ix in rows]
    return [call_diff[ix].cpu() for ix in pick], [bound[ix].cpu() for ix in pick]


def rce_spot_check(module: torch.nn.Module, hf_model: torch.nn.Module, packed_logits: torch.Tensor,
                   row_start: torch.Tensor, input_ids: Sequence[torch.Tensor], segment_ids: Sequence[torch.Tensor],
                   response_masks: Sequence[torch.Tensor], chunk: int = 256
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The in-training RCE spot-check of one micro-batch (what ``MemopdLMEngine`` runs on an audit step).

    Args:
        module / hf_model: the model as the engine calls it (FSDP-wrapped or not) and the HF model inside.
        packed_logits: (M, V) the packed forward's logits with rows flattened (a view, not a copy).
        row_start: (B,) int64 -- where row b starts in ``packed_logits``.
        input_ids / segment_ids / response_masks: per row b, (L_b,), (L_b,), (R_b,) (see :func:`alone_calls`).

    Returns per row b each call's max abs logit difference and its tolerance, (n_calls_b,) float32.
    """
    calls = alone_calls(input_ids, segment_ids, response_masks)
    packed_index = row_start.to(packed_logits.device)[calls.row.to(packed_logits.device)] + \
        calls.packed_pos.to(packed_logits.device)
    diff, ref, dtype = alone_pass_diffs(module, hf_model, packed_logits, packed_index, calls, chunk)
    return per_call(calls, diff, ref, dtype, len(input_ids))


def rce_check(diffs: Sequence[torch.Tensor], tolerances: Sequence[torch.Tensor], row_names: Sequence[str],
              on_failure: str) -> dict[str, float]:
    """The spot-check's verdict over a step: per row, each call's difference (n_calls,) against its tolerance.
    Returns ``memopd/audit/rce_failed_calls``, ``rce_pass`` (1.0 / 0.0) and ``rce_max_diff_over_tolerance``
    (how close the worst call came to failing; > 1 fails); on a failure raises
    :class:`RceAuditError` (``on_failure="raise"``) or logs a warning (``"warn"``), naming the worst calls."""
    if on_failure not in AUDIT_ON_FAILURE:
        raise ValueError(f"on_failure={on_failure!r}: expected one of {AUDIT_ON_FAILURE}")
    failures = [(float(d[t]), float(tol[t]), name, t) for d, tol, name in zip(diffs, tolerances, row_names)
                for t in range(d.numel()) if d[t] > tol[t] or not torch.isfinite(d[t])]
    if failures:
        failures.sort(key=lambda f: -f[0] / max(f[1], 1e-30))
        worst = "; ".join(f"row {name} call {t}: max |logit_packed - logit_alone| = {d:.3e} > tolerance {tol:.3e}"
                          for d, tol, name, t in failures[:5])
        message = (f"RCE spot-check failed on {len(failures)} call(s) (packed forward vs each call run alone under "
                   f"stock attention, at action tokens): {worst}")
        if on_failure == "raise":
            raise RceAuditError(message + " (memopd.audit.on_failure=warn to log and continue)")
        logger.warning(message)
    ratio = max((float(d[t] / tol[t]) for d, tol in zip(diffs, tolerances) for t in range(d.numel())), default=0.0)
    return {"memopd/audit/rce_failed_calls": float(len(failures)), "memopd/audit/rce_pass": float(not failures),
            "memopd/audit/rce_max_diff_over_tolerance": ratio}


def rce_metrics(per_row: list[torch.Tensor]) -> dict[str, float]:
    """``memopd/audit/rce_*`` from the per-row, per-call max abs differences."""
    diffs = torch.cat([d.reshape(-1).float() for d in per_row])
    if diffs.numel() == 0:
        return {}
    return {"memopd/audit/rce_max_abs_diff": float(diffs.max()),
            "memopd/audit/rce_mean_abs_diff": float(diffs.mean()),
            "memopd/audit/rce_calls_checked": float(diffs.numel())}


@torch.no_grad()
def teacher_layout_kl(head: torch.Tensor, aligned: torch.Tensor, flat: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """``KL(p_T aligned || p_T flat)`` per token from the teacher's final hidden states under the two
    layouts, both (A, H), and its output head (V_rows, H); exact over the vocabulary, ``chunk``
    tokens at a time. Returns (A,) float32."""
    if aligned.shape != flat.shape:
        raise ValueError(f"teacher_layout_kl: aligned {tuple(aligned.shape)} and flat {tuple(flat.shape)} "
                         f"hidden states differ (both layouts must score the same tokens)")
    out, w = [], head.float().T
    for i in range(0, aligned.shape[0], chunk):
        la = F.log_softmax(aligned[i:i + chunk].float() @ w, dim=-1)
        lf = F.log_softmax(flat[i:i + chunk].float() @ w, dim=-1)
        out.append((la.exp() * (la - lf)).sum(-1))
    return torch.cat(out) if out else aligned.new_zeros(0, dtype=torch.float32)
