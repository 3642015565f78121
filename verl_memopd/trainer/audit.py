"""In-training audits of the layout (``memopd.audit``), run on every N-th step.

RCE spot-check (actor, old-log-prob forward)
    Packed layout only. The method's Rollout Context Equivalence: each call's block, run inside the packed row, must
    give the same full-vocabulary logits as the call run alone, ``[q, x_t, a_t]`` with its own
    positions and plain causal attention. The actor engine re-runs every call of the micro-batch
    alone -- all of them in one extra forward, so every data-parallel rank makes the same number
    of forwards -- and returns, per row, the max abs logit difference of each call
    (``memopd_rce_max_abs_diff``, (B, n_calls*)). The trainer reports ``memopd/audit/rce_*``.

Aligned-vs-flat teacher KL (teacher + actor loss)
    Packed layout only. The teacher scores the step's rows a second time under the flat layout (persistent history,
    the paper's baseline) into ``memopd_teacher_hidden_flat``; the actor loss reports
    ``KL(p_T aligned || p_T flat)`` per teacher-supervised token: how far the baseline's
    supervision is from the state the student sampled in. With ``memopd.teacher.state=flat`` the
    supervision is the flat one and the audit pass scores the aligned rows instead
    (``memopd_teacher_hidden_aligned``); the metric is the same KL, aligned || flat.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


#: non-tensor flag on the old-log-prob batch: run the RCE spot-check in the actor engine
RCE_FLAG = "memopd_audit_rce"
#: per-row output of the RCE spot-check: max |logit_packed - logit_alone| of each call, (n_calls,)
RCE_FIELD = "memopd_rce_max_abs_diff"
#: non-tensor option of a teacher batch: the TransferQueue field its hidden states go to
TEACHER_OUTPUT_KEY = "memopd_teacher_output_key"
TEACHER_HIDDEN_FLAT = "memopd_teacher_hidden_flat"
#: the audit pass of ``memopd.teacher.state=flat``: the supervision is flat, the audit scores the aligned rows
TEACHER_HIDDEN_ALIGNED = "memopd_teacher_hidden_aligned"


def rce_diffs(packed_logits: list[torch.Tensor], alone_logits: torch.Tensor,
              spans: list[list[tuple[torch.Tensor, int, int]]]) -> list[torch.Tensor]:
    """Per row, the max abs difference of each call's block logits: packed (L_b, V) per row vs
    the calls-alone stream (N', V). Returns (n_calls_b,) float32 per row."""
    out = []
    for logits, row_spans in zip(packed_logits, spans):
        diffs = [(logits[block].float() - alone_logits[start:end].float()).abs().max() for block, start, end in row_spans]
        out.append(torch.stack(diffs) if diffs else torch.zeros(0))
    return out


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
