"""Chunked full-vocabulary divergence kernels: one base owns chunking and gradients.

A supervised batch has A positions; the student's logits there are ``z_S = hidden @ W_S[:V].T``
(or given as dense logits) and the teacher's arrive through a transport
(:mod:`verl_memopd.supervision`). No (A, V) fp32 buffer is ever formed: positions are taken
``token_chunk_size`` at a time and the vocabulary ``vocab_chunk_size`` columns at a time::

    for each token chunk (n rows):
        pass 1  over vocab chunks: online log-sum-exp of z_S / T and z_T / T      -> lse_S, lse_T
        pass 2  over vocab chunks: a = z_S/T - lse_S, b = z_T/T - lse_T;
                D += sum f(a, b);  c += sum g(a, b);  diagnostics               -> D, c (n,)
        pass 3  over vocab chunks (when gradients are needed):
                dL/dz_S = w * (g - p_S * c) / T  ->  accumulate dL/dhidden, dL/dW_S

Gradients are formed during the forward call (Liger-Kernel's chunked-loss pattern), so the
loss takes the per-token weights ``w`` and returns the scalar ``sum_i w_i * D_i``; backward only
scales the stored gradients. With ``vocab_chunk_size=None`` (default) a token chunk's (n, V)
logits are formed once and reused by the three passes; with a vocab chunk, every pass
recomputes its (n, c) block (3 student and 3 teacher matmuls instead of 1: less memory, more
time). Peak extra memory ~ 8 * n * min(c, V) * 4 bytes, plus the fp32 gradient of W_S.

The ``topk`` transport's K + 1 bins use :class:`_StudentBins` (chunked log-sum-exp over all and
over the non-top-k tokens, custom backward) and :class:`_BinDivergence` (pointwise maths with
``g``), composed by autograd.

Shapes: A positions, n token-chunk rows, c vocab-chunk columns, H hidden, V agreed vocabulary,
V_rows >= V head rows (padding rows are excluded from every softmax: logits of -inf), K top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from verl_memopd.losses.divergences import Divergence, get_divergence
from verl_memopd.supervision import HiddenTarget, TopKTarget

__all__ = ["Chunking", "StudentLogits", "DivergenceResult", "divergence_loss", "naive_divergence"]


@dataclass(frozen=True)
class Chunking:
    """Chunk sizes. token_chunk_size: positions per chunk (default 256). vocab_chunk_size:
    columns per chunk, None = the whole vocabulary (default; each token chunk's logits formed once)."""

    token_chunk_size: int = 256
    vocab_chunk_size: Optional[int] = None

    def __post_init__(self) -> None:
        if self.token_chunk_size < 1 or (self.vocab_chunk_size is not None and self.vocab_chunk_size < 1):
            raise ValueError(f"Chunking: chunk sizes must be >= 1, got {self}")

    def vocab_ranges(self, vocab_size: int) -> list[slice]:
        step = self.vocab_chunk_size or vocab_size
        return [slice(s, min(s + step, vocab_size)) for s in range(0, vocab_size, step)]


@dataclass(frozen=True)
class StudentLogits:
    """The student's scores at the A supervised positions, in one of two forms.

    Attributes:
        vocab_size: V; only logit columns [0, V) enter the softmax.
        hidden: (A, H) final post-norm hidden states, with ``head_weight`` (V_rows, H): the
            logits ``hidden @ head_weight.T`` are formed chunk by chunk, never for all A at once.
        logits: (A, V_rows) dense logits instead (the engine already has them).
        Neither form is temperature-scaled; the loss divides by the rollout temperature.
    """

    vocab_size: int
    hidden: Optional[torch.Tensor] = None
    head_weight: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        linear = self.hidden is not None and self.head_weight is not None and self.logits is None
        dense = self.logits is not None and self.hidden is None and self.head_weight is None
        if not (linear or dense):
            raise ValueError("StudentLogits: give either hidden + head_weight, or logits (not both, not neither)")
        x = self.hidden if linear else self.logits
        rows = self.head_weight.shape[0] if linear else self.logits.shape[-1]
        if x.dim() != 2 or (linear and (self.head_weight.dim() != 2 or self.head_weight.shape[1] != x.shape[1])):
            raise ValueError(
                f"StudentLogits: expected hidden (A, H) + head_weight (V_rows, H) or logits (A, V_rows); got "
                f"{tuple(x.shape)}" + (f" and {tuple(self.head_weight.shape)}" if linear else "")
            )
        if rows < self.vocab_size:
            raise ValueError(f"StudentLogits: {rows} vocabulary rows, fewer than vocab_size {self.vocab_size}")

    @property
    def tensors(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(x, w): (hidden, head_weight) or (logits, None) -- the form the kernels take."""
        return (self.hidden, self.head_weight) if self.logits is None else (self.logits, None)

    @property
    def num_tokens(self) -> int:
        return self.tensors[0].shape[0]


@dataclass(frozen=True)
class DivergenceResult:
    """loss: scalar ``sum_i w_i * min(D_i, clamp)`` (differentiable). The rest are (A,) and detached:
    per_token D_i; reverse_kl, forward_kl (over the transport's support: exact for ``hidden``, over
    K + 1 bins for ``topk`` -- a lower bound of the full KL); teacher_top_mass / student_top_mass:
    teacher and student probability of the teacher's ``top_tokens`` most likely tokens."""

    loss: torch.Tensor
    per_token: torch.Tensor
    reverse_kl: torch.Tensor
    forward_kl: torch.Tensor
    teacher_top_mass: torch.Tensor
    student_top_mass: torch.Tensor


_REVERSE_KL, _FORWARD_KL = get_divergence("reverse_kl"), get_divergence("forward_kl")
_STATS = 5  # per-token columns: D, reverse KL, forward KL, teacher top mass, student top mass


def _block(x: torch.Tensor, w: Optional[torch.Tensor], rows: slice, cols: slice) -> torch.Tensor:
    """(n, c) fp32 logits of rows x cols: x[rows] @ w[cols].T (in the inputs' dtype), or x[rows, cols]."""
    return (x[rows, cols] if w is None else x[rows] @ w[cols].T).float()


def _online_lse(blocks: Callable[[slice], torch.Tensor], ranges: list[slice]) -> torch.Tensor:
    """Log-sum-exp over all columns, one (n, c) block at a time -> (n, 2): (max m, log sum exp(z - m)).

    Kept as two parts so that log-probs are ``(z - m) - s``: with logits near 1e4, folding m + s
    into one fp32 number would round away ~1e-3 of every log-prob.
    """
    out = None
    for cols in ranges:
        z = blocks(cols)
        m = z.max(dim=-1).values
        part = torch.stack([m, torch.log(torch.exp(z - m[:, None]).sum(-1))], -1)
        out = part if out is None else _merge_lse(out, part)
    return out


def _merge_lse(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Combine two (n, 1 + j) parts: column 0 the max m, columns 1.. log-sum-exps relative to m."""
    m = torch.maximum(x[:, :1], y[:, :1])

    def shift(part: torch.Tensor) -> torch.Tensor:  # where() keeps -inf - -inf from becoming nan
        return torch.where(part[:, :1] == m, part[:, 1:], part[:, 1:] + (part[:, :1] - m))

    return torch.cat([m, torch.logaddexp(shift(x), shift(y))], -1)


def _log_normalise(z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """(n, c) logits and (n, 2) lse parts -> (n, c) log-probs."""
    return (z - lse[:, :1]) - lse[:, 1:]


def _merge_top(best: Optional[tuple], b: torch.Tensor, a: torch.Tensor, k: int) -> tuple:
    """Keep the k largest teacher log-probs b (and the student's a at the same tokens) seen so far."""
    vals, idx = b.topk(min(k, b.shape[-1]), dim=-1)
    cand = (vals, a.gather(-1, idx))
    if best is not None:
        cand = tuple(torch.cat(p, dim=-1) for p in zip(best, cand))
        vals, idx = cand[0].topk(min(k, cand[0].shape[-1]), dim=-1)
        cand = (vals, cand[1].gather(-1, idx))
    return cand


@dataclass(frozen=True)
class _Plan:
    divergence: Divergence
    vocab_size: int
    chunking: Chunking
    clamp: Optional[float]
    top_tokens: int


class _FullVocabDivergence(torch.autograd.Function):
    """Exact full-vocabulary divergence against a HiddenTarget; gradients formed in forward."""

    @staticmethod
    def forward(ctx, plan: _Plan, weights, s_x, s_w, t_h, t_w, inv_temp):
        """weights (A,), s_x (A, H | V_rows), s_w (V_rows, H) | None, t_h (A, H_t), t_w (V_rows_t, H_t),
        inv_temp (A,) -> loss (), stats (A, 5)."""
        grads_needed = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        grad_x = torch.zeros_like(s_x, dtype=torch.float32) if grads_needed else None
        grad_w = torch.zeros_like(s_w, dtype=torch.float32) if grads_needed and s_w is not None else None
        stats = s_x.new_zeros((s_x.shape[0], _STATS), dtype=torch.float32)
        loss = torch.zeros((), dtype=torch.float32, device=s_x.device)
        for start in range(0, s_x.shape[0], plan.chunking.token_chunk_size):
            rows = slice(start, start + plan.chunking.token_chunk_size)
            loss += _full_vocab_chunk(plan, rows, (s_x, s_w, t_h, t_w), inv_temp, weights, stats, grad_x, grad_w)
        ctx.grads = (grad_x, grad_w)
        ctx.dtypes = (s_x.dtype, None if s_w is None else s_w.dtype)
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, grad_loss, grad_stats):
        grad_x, grad_w = (None if g is None else (g * grad_loss).to(dt) for g, dt in zip(ctx.grads, ctx.dtypes))
        return None, None, grad_x, grad_w, None, None, None


def _full_vocab_chunk(plan, rows, tensors, inv_temp, weights, stats, grad_x, grad_w) -> torch.Tensor:
    """One token chunk of :class:`_FullVocabDivergence`; fills stats[rows] and the gradients."""
    s_x, s_w, t_h, t_w = tensors
    ranges = plan.chunking.vocab_ranges(plan.vocab_size)
    inv_t = inv_temp[rows, None]
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def logits(cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
        if cols.start in cache:
            return cache[cols.start]
        pair = (_block(s_x, s_w, rows, cols) * inv_t, _block(t_h, t_w, rows, cols) * inv_t)
        if len(ranges) == 1:
            cache[cols.start] = pair
        return pair

    lse_s = _online_lse(lambda c: logits(c)[0], ranges)
    lse_t = _online_lse(lambda c: logits(c)[1], ranges)

    def logprobs(cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
        z_s, z_t = logits(cols)
        return _log_normalise(z_s, lse_s), _log_normalise(z_t, lse_t)

    acc, top = stats.new_zeros((lse_s.shape[0], 3)), None  # D, c = sum g, reverse KL
    fkl = acc.new_zeros(lse_s.shape[0])
    for cols in ranges:
        a, b = logprobs(cols)
        f, g = plan.divergence.pointwise(a, b, with_grad=True)
        acc += torch.stack([f.sum(-1), g.sum(-1), _REVERSE_KL.pointwise(a, b)[0].sum(-1)], dim=-1)
        fkl += _FORWARD_KL.pointwise(a, b)[0].sum(-1)
        top = _merge_top(top, b, a, plan.top_tokens)
    div, gsum = acc[:, 0], acc[:, 1]
    stats[rows] = torch.stack([div, acc[:, 2], fkl, top[0].exp().sum(-1), top[1].exp().sum(-1)], dim=-1)
    w = weights[rows].float()
    if plan.clamp is not None:
        w_grad, chunk_loss = w * (div <= plan.clamp), (w * div.clamp(max=plan.clamp)).sum()
    else:
        w_grad, chunk_loss = w, (w * div).sum()
    if grad_x is not None:
        scale = (w_grad * inv_temp[rows])[:, None]
        for cols in ranges:
            a, b = logprobs(cols)
            g = plan.divergence.pointwise(a, b, with_grad=True)[1]
            grad_z = (g - a.exp() * gsum[:, None]) * scale  # (n, c)
            _accumulate(grad_z, rows, cols, s_x, s_w, grad_x, grad_w)
    return chunk_loss


def _accumulate(grad_z, rows, cols, x, w, grad_x, grad_w) -> None:
    """Chain rule through the logits block: into grad_x (and grad_w for the linear form)."""
    if w is None:
        grad_x[rows, cols] += grad_z
        return
    grad_x[rows] += (grad_z.to(w.dtype) @ w[cols]).float()
    grad_w[cols] += (grad_z.T.to(x.dtype) @ x[rows]).float()


class _StudentBins(torch.autograd.Function):
    """Student log-probs of the K top-k bins and the tail bin: (A, K + 1), chunked, custom backward."""

    @staticmethod
    def forward(ctx, plan: _Plan, ids, s_x, s_w, inv_temp):
        """ids (A, K) long, s_x (A, H | V_rows), s_w (V_rows, H) | None, inv_temp (A,) -> (A, K + 1)."""
        out, lses = [], []
        for start in range(0, s_x.shape[0], plan.chunking.token_chunk_size):
            rows = slice(start, start + plan.chunking.token_chunk_size)
            lse, z_ids = None, None  # lse (n, 3): max m, log-sum-exp over all / over non-top-k, relative to m
            for cols in plan.chunking.vocab_ranges(plan.vocab_size):
                z, in_chunk, excluded = _bin_block(s_x, s_w, ids, inv_temp, rows, cols)
                m = z.max(dim=-1, keepdim=True).values
                sums = torch.stack([torch.exp(z - m).sum(-1), torch.exp(z - m).masked_fill(excluded, 0.0).sum(-1)], -1)
                part = torch.cat([m, sums.log()], -1)
                lse = part if lse is None else _merge_lse(lse, part)
                picked = z.gather(-1, (ids[rows] - cols.start).clamp(0, z.shape[-1] - 1))
                z_ids = torch.where(in_chunk, picked, z_ids if z_ids is not None else picked)
            out.append(torch.cat([_log_normalise(z_ids, lse), lse[:, 2:] - lse[:, 1:2]], -1))
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
        for start in range(0, s_x.shape[0], plan.chunking.token_chunk_size):
            rows = slice(start, start + plan.chunking.token_chunk_size)
            g_ids, g_tail, g_all = grad_bins[rows, :-1], grad_bins[rows, -1:], grad_bins[rows].sum(-1, keepdim=True)
            m, s_all, s_tail = lses[rows, :1], lses[rows, 1:2], lses[rows, 2:]
            for cols in plan.chunking.vocab_ranges(plan.vocab_size):
                z, in_chunk, excluded = _bin_block(s_x, s_w, ids, inv_temp, rows, cols)
                # d a_tail / dz_j = [j not top-k] exp(z_j - tail lse) - p_j;  d a_k / dz_j = [j = id_k] - p_j
                tail_share = torch.where(excluded, 0.0, g_tail * torch.exp((z - m) - s_tail))
                grad_z = tail_share - g_all * torch.exp((z - m) - s_all)
                local = (ids[rows] - cols.start).clamp(0, z.shape[-1] - 1)
                grad_z.scatter_add_(-1, local, torch.where(in_chunk, g_ids, 0.0))
                _accumulate(grad_z * inv_temp[rows, None], rows, cols, s_x, s_w, grad_x, grad_w)
        return None, None, grad_x.to(s_x.dtype), None if s_w is None else grad_w.to(s_w.dtype), None


def _bin_block(s_x, s_w, ids, inv_temp, rows, cols):
    """z (n, c) = logits/T; in_chunk (n, K): the id falls in cols; excluded (n, c): column is a top-k id."""
    z = _block(s_x, s_w, rows, cols) * inv_temp[rows, None]
    n, c = z.shape
    in_chunk = (ids[rows] >= cols.start) & (ids[rows] < cols.stop)
    local = torch.where(in_chunk, ids[rows] - cols.start, c)  # ids outside cols go to a spare column c
    excluded = z.new_zeros((n, c + 1), dtype=torch.bool).scatter_(-1, local, True)[:, :c]
    return z, in_chunk, excluded


class _BinDivergence(torch.autograd.Function):
    """sum over bins of f(a, b), gradient g: a (A, K + 1) student, b (A, K + 1) teacher -> (A,)."""

    @staticmethod
    def forward(ctx, divergence: Divergence, a, b):
        f, g = divergence.pointwise(a, b, with_grad=True)
        ctx.save_for_backward(g)
        return f.sum(-1)

    @staticmethod
    def backward(ctx, grad_d):
        (g,) = ctx.saved_tensors
        return None, g * grad_d[:, None], None


# --- public entry -----------------------------------------------------------------------------
def divergence_loss(
    divergence: Divergence,
    student: StudentLogits,
    target: HiddenTarget | TopKTarget,
    weights: torch.Tensor,
    temperature: torch.Tensor,
    chunking: Chunking = Chunking(),
    clamp: Optional[float] = None,
    top_tokens: int = 8,
) -> DivergenceResult:
    """Weighted divergence at A supervised positions, never forming (A, V) at once.

    Args:
        divergence: per-chunk maths (:func:`get_divergence`).
        student: the student's logits at the A positions (hidden + head, or dense).
        target: the teacher's distribution there, from a transport's ``decode``.
        weights: (A,) non-negative per-token weights (e.g. dp_size / global teacher-token count).
        temperature: (A,) the rollout temperature of each position (> 0); divides both sides' logits.
            (The ``topk`` transport applied it teacher-side when encoding.)
        chunking: token / vocabulary chunk sizes.
        clamp: optional per-token cap on D_i (> 0): contributes min(D_i, clamp), no gradient above it.
        top_tokens: how many of the teacher's most likely tokens the mass diagnostics cover (default 8).
    """
    a = student.num_tokens
    if target.num_tokens != a or weights.shape != (a,) or temperature.shape != (a,):
        raise ValueError(
            f"divergence_loss: student has {a} positions, target {target.num_tokens}, weights "
            f"{tuple(weights.shape)}, temperature {tuple(temperature.shape)}; all must be A = {a}"
        )
    if target.vocab_size != student.vocab_size:
        raise ValueError(f"divergence_loss: target vocab_size {target.vocab_size} != student vocab_size {student.vocab_size}")
    if a and not bool((temperature > 0).all()):
        raise ValueError("divergence_loss: temperature must be > 0 at every position")
    if clamp is not None and not clamp > 0:
        raise ValueError(f"divergence_loss: clamp = {clamp} must be > 0 (or None)")
    if top_tokens < 1:
        raise ValueError(f"divergence_loss: top_tokens = {top_tokens} must be >= 1")
    if type(target) not in _KERNELS:
        raise TypeError(f"divergence_loss: no kernel for {type(target).__name__}; known targets: {[t.__name__ for t in _KERNELS]}")
    plan = _Plan(divergence, student.vocab_size, chunking, clamp, top_tokens)
    return _KERNELS[type(target)](plan, student, target, weights, 1.0 / temperature.float())


def _hidden_kernel(plan, student, target: HiddenTarget, weights, inv_temp) -> DivergenceResult:
    s_x, s_w = student.tensors
    loss, stats = _FullVocabDivergence.apply(plan, weights.detach(), s_x, s_w, target.hidden, target.head_weight, inv_temp)
    return DivergenceResult(loss, *stats.unbind(-1))


def _topk_kernel(plan, student, target: TopKTarget, weights, inv_temp) -> DivergenceResult:
    s_x, s_w = student.tensors
    a = _StudentBins.apply(plan, target.ids, s_x, s_w, inv_temp)  # (A, K + 1)
    b = torch.cat([target.logprobs, target.tail_logprob[:, None]], -1)
    div = _BinDivergence.apply(plan.divergence, a, b)
    kept = div if plan.clamp is None else div.clamp(max=plan.clamp)
    with torch.no_grad():
        a_d = a.detach()
        top_b, idx = target.logprobs.topk(min(plan.top_tokens, b.shape[-1] - 1), dim=-1)
        stats = (
            div.detach(),
            _REVERSE_KL.pointwise(a_d, b)[0].sum(-1),
            _FORWARD_KL.pointwise(a_d, b)[0].sum(-1),
            top_b.exp().sum(-1),
            a_d.gather(-1, idx).exp().sum(-1),
        )
    return DivergenceResult((weights.detach().float() * kept).sum(), *stats)


_KERNELS: dict[type, Callable[..., DivergenceResult]] = {HiddenTarget: _hidden_kernel, TopKTarget: _topk_kernel}


def naive_divergence(
    divergence: Divergence,
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    vocab_size: int,
    temperature: torch.Tensor,
) -> torch.Tensor:
    """Reference: (A, V_rows_s) and (A, V_rows_t) logits -> (A,) divergence, all in one (A, V) piece.

    Padded rows (columns >= vocab_size) are set to -inf before the softmax, explicitly.
    """

    def logp(logits: torch.Tensor) -> torch.Tensor:
        z = logits.float() / temperature.float()[:, None]
        z = z.masked_fill(torch.arange(z.shape[-1], device=z.device) >= vocab_size, -math.inf)
        return torch.log_softmax(z, dim=-1)[:, :vocab_size]

    return divergence.reference(logp(student_logits), logp(teacher_logits))
