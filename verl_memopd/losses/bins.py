"""The ``topk`` transport's divergence: student and teacher coarsened to K + 1 bins.

The teacher sent its top-K token log-probs and the log of the remaining mass (the tail bin).
The student's bins are taken on the same K tokens, plus its own tail::

    a_k    = z_S[id_k] / T - lse_S                       k = 1..K      (A, K)
    a_tail = lse_S over the tokens not in ids - lse_S                  (A,)

:class:`_StudentBins` computes them chunk by chunk (token x vocabulary chunks; no (A, V)
buffer) and back-propagates with a recomputing pass::

    d a_k / dz_j    = [j = id_k] - p_j
    d a_tail / dz_j = [j not in ids] * exp(z_j - lse_tail) - p_j

:class:`_BinDivergence` applies the divergence's pointwise maths over the K + 1 bins (its own
``g`` as the gradient, so 0 * log 0 bins stay 0). At K = V the tail is empty on both sides
(-inf) and the result equals the exact full-vocabulary divergence; for K < V a KL over bins is
a lower bound of the full KL (data-processing inequality).

Shapes: A positions, K top-k, n / c token / vocabulary chunk sizes, H hidden, V vocabulary.
"""

from __future__ import annotations

import torch

from verl_memopd.losses.chunked import (
    DivergenceResult,
    Plan,
    StudentLogits,
    accumulate_grad,
    logits_block,
    lse_parts,
    merge_lse,
    register_target_kernel,
    top_mass,
)
from verl_memopd.losses.divergences import Divergence, get_divergence
from verl_memopd.supervision import TopKTarget

__all__: list[str] = []  # registers the TopKTarget kernel of verl_memopd.losses.chunked.divergence_loss

_REVERSE_KL, _FORWARD_KL = get_divergence("reverse_kl"), get_divergence("forward_kl")


def _bin_block(s_x, s_w, ids, inv_temp, rows, cols):
    """z (n, c) = logits / T; in_chunk (n, K): id falls in cols; excluded (n, c): column is a top-k id."""
    z = logits_block(s_x, s_w, rows, cols, inv_temp[rows, None])
    n, c = z.shape
    in_chunk = (ids[rows] >= cols.start) & (ids[rows] < cols.stop)
    local = torch.where(in_chunk, ids[rows] - cols.start, c)  # ids outside cols go to a spare column c
    excluded = z.new_zeros((n, c + 1), dtype=torch.bool).scatter_(-1, local, True)[:, :c]
    return z, in_chunk, excluded


class _StudentBins(torch.autograd.Function):
    """Student log-probs of the K top-k bins and the tail bin: (A, K + 1), chunked, custom backward."""

    @staticmethod
    def forward(ctx, plan: Plan, ids, s_x, s_w, inv_temp):
        """ids (A, K) long, s_x (A, H | V_rows), s_w (V_rows, H) | None, inv_temp (A,) -> (A, K + 1)."""
        out, lses = [], []
        for rows in plan.chunking.token_ranges(s_x.shape[0]):
            lse, z_ids = None, None  # lse (n, 3): max m, log-sum-exp over all / over non-top-k, relative to m
            for cols in plan.chunking.vocab_ranges(plan.vocab_size):
                z, in_chunk, excluded = _bin_block(s_x, s_w, ids, inv_temp, rows, cols)
                picked = z.gather(-1, (ids[rows] - cols.start).clamp(0, z.shape[-1] - 1))
                z_ids = torch.where(in_chunk, picked, picked if z_ids is None else z_ids)
                lse = merge_lse(lse, lse_parts(z, excluded))
            out.append(torch.cat([(z_ids - lse[:, :1]) - lse[:, 1:2], lse[:, 2:] - lse[:, 1:2]], -1))
            lses.append(lse)
        ctx.save_for_backward(ids, s_x, s_w, inv_temp, torch.cat(lses))
        ctx.plan = plan
        return torch.cat(out)

    @staticmethod
    def backward(ctx, grad_bins):
        ids, s_x, s_w, inv_temp, lses = ctx.saved_tensors
        plan = ctx.plan
        grad_x = torch.zeros_like(s_x, dtype=torch.float32)
        grad_w = None if s_w is None else torch.zeros_like(s_w, dtype=torch.float32)
        grad_bins = grad_bins.float()
        for rows in plan.chunking.token_ranges(s_x.shape[0]):
            g_ids, g_tail, g_all = grad_bins[rows, :-1], grad_bins[rows, -1:], grad_bins[rows].sum(-1, keepdim=True)
            m, s_all, s_tail = lses[rows, :1], lses[rows, 1:2], lses[rows, 2:]
            for cols in plan.chunking.vocab_ranges(plan.vocab_size):
                z, in_chunk, excluded = _bin_block(s_x, s_w, ids, inv_temp, rows, cols)
                tail_share = torch.where(excluded, 0.0, g_tail * torch.exp((z - m) - s_tail))
                grad_z = tail_share.sub_(g_all * torch.exp((z - m) - s_all))
                local = (ids[rows] - cols.start).clamp(0, z.shape[-1] - 1)
                grad_z.scatter_add_(-1, local, torch.where(in_chunk, g_ids, 0.0))
                accumulate_grad(grad_z.mul_(inv_temp[rows, None]), rows, cols, s_x, s_w, grad_x, grad_w)
        return None, None, grad_x.to(s_x.dtype), None if s_w is None else grad_w.to(s_w.dtype), None


class _BinDivergence(torch.autograd.Function):
    """sum over bins of f(a, b), gradient g: a (A, K + 1) student, b (A, K + 1) teacher -> (A,)."""

    @staticmethod
    def forward(ctx, divergence: Divergence, a, b):
        f, g = divergence.pointwise(a, b, a.exp(), b.exp(), with_grad=True)
        ctx.save_for_backward(g)
        return f.sum(-1)

    @staticmethod
    def backward(ctx, grad_d):
        (g,) = ctx.saved_tensors
        return None, g * grad_d[:, None], None


@register_target_kernel(TopKTarget)
def _topk_kernel(plan: Plan, student: StudentLogits, target: TopKTarget, weights, inv_temp) -> DivergenceResult:
    s_x, s_w = student.tensors
    a = _StudentBins.apply(plan, target.ids, s_x, s_w, inv_temp)  # (A, K + 1)
    b = torch.cat([target.logprobs, target.tail_logprob[:, None]], -1)
    div = _BinDivergence.apply(plan.divergence, a, b)
    kept = div if plan.clamp is None else div.clamp(max=plan.clamp)
    with torch.no_grad():
        a_d, p, q = a.detach(), a.detach().exp(), b.exp()
        top = None
        if plan.top_tokens:
            top_b, idx = target.logprobs.topk(min(plan.top_tokens, target.logprobs.shape[-1]), dim=-1)
            top = (top_b, a_d.gather(-1, idx))
        stats = (
            div.detach(),
            _REVERSE_KL.pointwise(a_d, b, p, q)[0].sum(-1),
            _FORWARD_KL.pointwise(a_d, b, p, q)[0].sum(-1),
            *top_mass(top, div.detach()),
        )
    return DivergenceResult((weights.detach().float() * kept).sum(), *stats)
