"""In-training audits of the layout (``memopd.audit``), run on every N-th step: the trainer's wiring.

The maths lives below the trainer, in ``verl_memopd.audit`` (no verl); this module moves the data.

RCE check (actor, old-log-prob forward)
    Packed layout only. The method's Rollout Context Equivalence: at every action token, the
    full-vocabulary logits of the packed forward must equal those of the call run alone. The alone
    pass is rebuilt from the **invocation records** the agent loop wrote (``extra_fields``'
    ``memopd_episode``: each call's ``prompt_ids + response_ids``, positions 0..n-1), never from the
    packed rows, so a packer fault that keeps the rows self-consistent (a segment boundary off by one,
    a scrambled block) fails it. On an audit step the trainer copies each row's records into three
    row fields (:func:`put_rce_records`, before the old-log-prob forward); the actor engine
    (:func:`engine_rce_fields`) runs every call of the micro-batch alone under the model's **stock**
    attention (sdpa; flash_attention_2 on CUDA when flash-attn is installed), in one extra forward (a second
    one, upcast to fp32, for bf16 / fp16 parameters), pairs the k-th recorded action token with the row's k-th
    ``response_mask`` token (ids checked) and compares the logits in place, ``chunk`` tokens at a time.
    Per row the engine returns each call's figures (``memopd_rce_max_abs_diff``: (n_calls, 5),
    ``verl_memopd.audit.STAT_COLUMNS``) and bound (``memopd_rce_tolerance``: (n_calls,)); the rule is
    ``verl_memopd.rce``'s (fp32: 1e-4 + 2^-15 of the call's largest logit; bf16 / fp16: the measured noise floor,
    ``|l_packed - l_ref32| <= 3 |l_alone - l_ref32| + 4 ulps``). Under FSDP mixed precision the fp32
    reference is a replica filled unit by unit from the fp32 shards (``verl_memopd.fp32_reference``). The
    trainer reports
    ``memopd/audit/rce_*`` and, on a call above its bound, raises :class:`RceAuditError` or warns
    (``memopd.audit.on_failure``).

Aligned-vs-flat teacher KL (teacher + actor loss)
    Packed layout only. The teacher scores the step's rows a second time under the flat layout (persistent history,
    the paper's baseline) into ``memopd_teacher_hidden_flat``; the actor loss reports
    ``KL(p_T aligned || p_T flat)`` per teacher-supervised token: how far the baseline's
    supervision is from the state the student sampled in. With ``memopd.teacher.state=flat`` the
    supervision is the flat one and the audit pass scores the aligned rows instead
    (``memopd_teacher_hidden_aligned``); the metric is the same KL, aligned || flat.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.nn.functional as F

from verl_memopd.audit import (
    STAT_COLUMNS,
    CallRecord,
    RceAuditError,
    decode_records,
    encode_records,
    rce_spot_check,
    records_of_episode,
    stock_attention,
    summarize,
)
from verl_memopd.fields import (
    RCE_FIELD,
    RCE_FLAG,
    RCE_TOLERANCE_FIELD,
    RECORD_FIELDS,
    TEACHER_HIDDEN_ALIGNED,
    TEACHER_HIDDEN_FLAT,
    TEACHER_OUTPUT_KEY,
)
from verl_memopd.trainer.config import AUDIT_ON_FAILURE

__all__ = [
    "RCE_FLAG",
    "RCE_FIELD",
    "RCE_TOLERANCE_FIELD",
    "RECORD_FIELDS",
    "TEACHER_OUTPUT_KEY",
    "TEACHER_HIDDEN_FLAT",
    "TEACHER_HIDDEN_ALIGNED",
    "RceAuditError",
    "record_fields",
    "put_rce_records",
    "micro_batch_records",
    "engine_rce_fields",
    "rce_check",
    "rce_metrics",
    "stock_attention",
    "teacher_layout_kl",
]

logger = logging.getLogger(__name__)


def record_fields(extra_fields: Sequence[dict], tags: Sequence[dict], keys: Sequence[str]) -> list[dict]:
    """Per row, its recorded calls as :data:`RECORD_FIELDS` tensors, from the agent loop's ``extra_fields``
    (``memopd_episode``: ``Episode.to_dict()``). verl's padding rows (tag ``is_padding``; they copy a real
    row's ``extra_fields``) get no calls."""
    from verl_memopd.fields import EPISODE

    rows = []
    for extra, tag, key in zip(extra_fields, tags, keys):
        calls: list[CallRecord] = []
        if not tag.get("is_padding", False):
            if not hasattr(extra, "__contains__") or EPISODE not in extra:  # a dict, or another mapping
                raise RceAuditError(
                    f"row {key}: no {EPISODE!r} in extra_fields; the RCE check rebuilds each "
                    f"call from the memory agent's invocation records"
                )
            try:
                calls = records_of_episode(extra[EPISODE]["invocations"])
            except (KeyError, TypeError, ValueError) as e:
                raise RceAuditError(f"row {key}: {EPISODE} has no usable invocation records: {e}") from e
        rows.append({RECORD_FIELDS[k]: v for k, v in encode_records(calls).items()})
    return rows


def put_rce_records(batch) -> None:
    """Write the step's :func:`record_fields` into TransferQueue (a KVBatchMeta ``batch``), for the
    actor's old-log-prob forward to read."""
    import transfer_queue as tq
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
    rows = record_fields(data["extra_fields"], batch.tags, [str(k) for k in batch.keys])
    tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=list_of_dict_to_tensordict(rows))


def micro_batch_records(micro_batch) -> list[list[CallRecord]]:
    """Per row of a verl micro-batch, its recorded calls (:data:`RECORD_FIELDS`, jagged)."""
    missing = [f for f in RECORD_FIELDS.values() if f not in micro_batch.keys()]
    if missing:
        raise RceAuditError(
            f"RCE check: the micro-batch has no {missing}; the trainer writes them on audit steps "
            f"(verl_memopd.trainer.audit.put_rce_records) from the agent's invocation records"
        )
    ids, action, lengths = (micro_batch[RECORD_FIELDS[k]].unbind() for k in ("ids", "action", "lengths"))
    return [decode_records(i, a, n) for i, a, n in zip(ids, action, lengths)]


def engine_rce_fields(
    module: torch.nn.Module, logits: torch.Tensor, micro_batch, use_rmpad: bool, chunk: int = 256
) -> dict[str, torch.Tensor]:
    """The RCE check of one actor micro-batch (``MemopdLMEngine``): packed ``logits`` (1, N, V) stream or
    (B, L, V) padded, read in place; ``module`` the engine's model (FSDP-wrapped or not). Returns per row
    each call's figures (B, n_calls*, 5) and bounds (B, n_calls*), jagged."""
    ids = micro_batch["input_ids"].unbind()
    lengths = micro_batch["input_ids"].offsets().diff().to(logits.device)
    row_start = (
        (torch.cumsum(lengths, 0) - lengths)
        if use_rmpad
        else torch.arange(lengths.numel(), device=logits.device) * logits.shape[1]
    )
    hf_model = getattr(module, "_fsdp_wrapped_module", module)  # FSDP1 wraps; FSDP2 does not
    stats, bounds, problems = rce_spot_check(
        module,
        hf_model,
        logits.flatten(0, 1),
        row_start,
        ids,
        micro_batch["response_mask"].unbind(),
        micro_batch_records(micro_batch),
        chunk,
    )
    for problem in problems[:5]:
        logger.warning("RCE check: %s", problem)
    return {
        RCE_FIELD: torch.nested.as_nested_tensor(stats, layout=torch.jagged),
        RCE_TOLERANCE_FIELD: torch.nested.as_nested_tensor(bounds, layout=torch.jagged),
    }


def rce_check(
    stats: Sequence[torch.Tensor], bounds: Sequence[torch.Tensor], row_names: Sequence[str], on_failure: str
) -> dict[str, float]:
    """The check's verdict over a step: per row, each call's figures (n_calls, 5) against its bound (n_calls,).
    Returns ``memopd/audit/rce_failed_calls``, ``rce_pass`` (1.0 / 0.0) and ``rce_max_diff_over_tolerance``
    (how close the worst call came to failing; > 1 fails); on a failure raises
    :class:`RceAuditError` (``on_failure="raise"``) or logs a warning (``"warn"``), naming the worst calls."""
    if on_failure not in AUDIT_ON_FAILURE:
        raise ValueError(f"on_failure={on_failure!r}: expected one of {AUDIT_ON_FAILURE}")
    audited = [s.reshape(-1, len(STAT_COLUMNS))[:, 0] for s in stats]
    failures = [
        (float(d[t]), float(tol[t]), name, t)
        for d, tol, name in zip(audited, bounds, row_names)
        for t in range(d.numel())
        if d[t] > tol[t] or not torch.isfinite(d[t])
    ]
    if failures:
        failures.sort(key=lambda f: -f[0] / max(f[1], 1e-30))
        worst = "; ".join(
            f"row {name} call {t}: difference {d:.3e} > bound {tol:.3e}" for d, tol, name, t in failures[:5]
        )
        message = (
            f"RCE check failed on {len(failures)} call(s) (packed forward vs each call run alone from its "
            f"invocation record under stock attention, at action tokens; inf = the packed row's action "
            f"tokens do not match the record): {worst}"
        )
        if on_failure == "raise":
            raise RceAuditError(message + " (memopd.audit.on_failure=warn to log and continue)")
        logger.warning(message)
    summary = summarize(stats, bounds)
    return {
        "memopd/audit/rce_failed_calls": float(len(failures)),
        "memopd/audit/rce_pass": float(not failures),
        "memopd/audit/rce_max_diff_over_tolerance": summary.worst_ratio if summary.calls else 0.0,
    }


def rce_metrics(stats: Sequence[torch.Tensor]) -> dict[str, float]:
    """``memopd/audit/rce_*`` from the per-row, per-call figures (n_calls, 5): packed-vs-alone max / mean
    difference, calls checked, the largest KL(p_alone || p_packed), the lowest top-1 agreement and (bf16 /
    fp16 with an fp32 reference) the largest noise floor ``max |l_alone - l_ref32|``."""
    s = torch.cat([x.reshape(-1, len(STAT_COLUMNS)).float() for x in stats]) if stats else torch.zeros(0, 5)
    if s.shape[0] == 0:
        return {}
    out = {
        "memopd/audit/rce_max_abs_diff": float(s[:, 1].max()),
        "memopd/audit/rce_mean_abs_diff": float(s[:, 1].mean()),
        "memopd/audit/rce_calls_checked": float(s.shape[0]),
        "memopd/audit/rce_max_kl": float(s[:, 3].max()),
        "memopd/audit/rce_min_top1_agreement": float(s[:, 4].min()),
    }
    if not torch.isnan(s[:, 2]).all():
        out["memopd/audit/rce_noise_floor"] = float(torch.nan_to_num(s[:, 2], nan=0.0).max())
    return out


@torch.no_grad()
def teacher_layout_kl(head: torch.Tensor, aligned: torch.Tensor, flat: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """``KL(p_T aligned || p_T flat)`` per token from the teacher's final hidden states under the two
    layouts, both (A, H), and its output head (V_rows, H); exact over the vocabulary, ``chunk``
    tokens at a time. Returns (A,) float32."""
    if aligned.shape != flat.shape:
        raise ValueError(
            f"teacher_layout_kl: aligned {tuple(aligned.shape)} and flat {tuple(flat.shape)} "
            f"hidden states differ (both layouts must score the same tokens)"
        )
    out, w = [], head.float().T
    for i in range(0, aligned.shape[0], chunk):
        la = F.log_softmax(aligned[i : i + chunk].float() @ w, dim=-1)
        lf = F.log_softmax(flat[i : i + chunk].float() @ w, dim=-1)
        out.append((la.exp() * (la - lf)).sum(-1))
    return torch.cat(out) if out else aligned.new_zeros(0, dtype=torch.float32)
