"""Chunked full-vocabulary divergences: one base owns chunking and gradients.

A supervised batch has A positions; the student's logits there are ``z_S = hidden @ W_S[:V].T``
(or given as dense logits) and the teacher's arrive through a transport
(:mod:`verl_memopd.supervision`). No (A, V) fp32 buffer is ever formed: positions are taken
``token_chunk_size`` at a time and the vocabulary ``vocab_chunk_size`` columns at a time::

    for each token chunk (n rows):
        pass 1  over vocab chunks: online log-sum-exp of z_S / T and z_T / T      -> lse_S, lse_T
        pass 2  over vocab chunks: a = z_S/T - lse_S, b = z_T/T - lse_T, p = e^a, q = e^b;
                D += sum f(a, b);  c += sum g(a, b);  diagnostics               -> D, c (n,)
        pass 3  over vocab chunks (when gradients are needed):
                dL/dz_S = w * (g - p * c) / T  ->  accumulate dL/dhidden, dL/dW_S

Gradients are formed during the forward call (Liger-Kernel's chunked-loss pattern), so the
loss takes the per-token weights ``w`` and returns the scalar ``sum_i w_i * D_i``; backward only
scales the stored gradients. With ``vocab_chunk_size=None`` (default) a token chunk's (n, V)
logits are formed once and the three passes share them (normalised in place; ``g`` kept for
pass 3): peak extra memory ~ 6 * n * V * 4 bytes (one token chunk's a, b, p, q, f, g; the
previous chunk's are freed first). With a vocab chunk, every pass recomputes its (n, c) block:
~ 6 * n * c * 4 bytes, at 3 student and 3 teacher matmuls instead of 1. The only (V_rows, H)
buffer is W_S's gradient, accumulated in W_S's dtype and handed to autograd without a copy
(it becomes ``W_S.grad``): the memory the naive loss needs for that gradient too.

Fast path (a linear student head, ``vocab_chunk_size=None``: the default, and what the actor loss
runs): each token chunk goes through ``_fused_rows`` instead -- teacher logits (inputs' dtype, top
tokens taken there) and student logits (fp32 straight from the matmul on CUDA) into
``log_softmax(dtype=float32)``, then the divergence's closed-form ``row_terms`` (value, gradient
through the softmax, diagnostics), the temperature applied to the logits in fp32 only when it is not 1,
and the per-row factor w / T folded into the (n, H) sides of the gradient matmuls: ~3.5 fp32 (n, V)
buffers for reverse KL. Token chunks: 128 suits CPUs (``Chunking`` default); on a GPU 128-row chunks
leave the head matmuls memory-bound, ``CUDA_TOKEN_CHUNK`` = 512 (docs/deployment.md "GPU figures": 43.6 ms,
1.79 GiB for 4096 positions on an H200 against naive fp32's 256 ms, 16.3 GiB).

Other targets (the ``topk`` transport's K + 1 bins, :mod:`verl_memopd.losses.bins`) register a
kernel for their target type with :func:`register_target_kernel`.

Shapes: A positions, n token-chunk rows, c vocab-chunk columns, H hidden, V agreed vocabulary,
V_rows >= V head rows (padding rows are excluded from every softmax: logits of -inf), K top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from verl_memopd.losses.divergences import Divergence, _rowdot
from verl_memopd.registry import Registry
from verl_memopd.supervision import HiddenTarget

__all__ = [
    "CUDA_TOKEN_CHUNK",
    "Chunking",
    "StudentLogits",
    "DivergenceResult",
    "divergence_loss",
    "naive_divergence",
    "register_target_kernel",
    "TARGET_KERNELS",
]


#: Token chunk for CUDA (the GPU recipes' ``memopd.distill.token_chunk_size``, ``bench kl --device cuda``):
#: 128-row chunks leave a GPU's matmuls memory-bound (the head is re-read per chunk). On an H200 (bf16, the
#: 1-node recipe's shapes) 256 / 384 / 512 / 768 rows: 49.9 / 46.0 / 43.6 / 42.7 ms at 1.79 / 1.79 / 1.79 /
#: 2.13 GiB; 512 is the fastest that keeps >= 8x less memory than naive fp32.
CUDA_TOKEN_CHUNK = 512


@dataclass(frozen=True)
class Chunking:
    """Chunk sizes. token_chunk_size: positions per chunk (default 128). vocab_chunk_size:
    columns per chunk, None = the whole vocabulary (default; each token chunk's logits formed once)."""

    token_chunk_size: int = 128
    vocab_chunk_size: Optional[int] = None

    def __post_init__(self) -> None:
        if self.token_chunk_size < 1 or (self.vocab_chunk_size is not None and self.vocab_chunk_size < 1):
            raise ValueError(f"Chunking: chunk sizes must be >= 1, got {self}")

    def vocab_ranges(self, vocab_size: int) -> list[slice]:
        step = self.vocab_chunk_size or vocab_size
        return [slice(s, min(s + step, vocab_size)) for s in range(0, vocab_size, step)]

    def token_ranges(self, num_tokens: int) -> list[slice]:
        return [slice(s, s + self.token_chunk_size) for s in range(0, num_tokens, self.token_chunk_size)]


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
    teacher and student probability of the teacher's ``top_tokens`` most likely tokens (NaN when
    ``top_tokens`` = 0: not computed)."""

    loss: torch.Tensor
    per_token: torch.Tensor
    reverse_kl: torch.Tensor
    forward_kl: torch.Tensor
    teacher_top_mass: torch.Tensor
    student_top_mass: torch.Tensor


@dataclass(frozen=True)
class Plan:
    """What a target kernel needs besides tensors (built by :func:`divergence_loss`)."""

    divergence: Divergence
    vocab_size: int
    chunking: Chunking
    clamp: Optional[float]
    top_tokens: int


# --- block helpers (shared with verl_memopd.losses.bins) ------------------------------------------
def logits_block(
    x: torch.Tensor, w: Optional[torch.Tensor], rows: slice, cols: slice, inv_t: torch.Tensor
) -> torch.Tensor:
    """(n, c) fp32 logits / T of rows x cols: x[rows] @ w[cols].T (inputs' dtype) or x[rows, cols]; a new tensor."""
    z = x[rows, cols].to(torch.float32, copy=True) if w is None else (x[rows] @ w[cols].T).float()
    return z.mul_(inv_t)


def lse_parts(z: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(n, c) -> (n, 2): max m and log sum exp(z - m), over all columns and, with mask (n, c), over
    the unmasked ones -> (n, 3). Two parts, so that log-probs are ``(z - m) - s``: near 1e4,
    folding m + s into one fp32 number would round ~1e-3 off every log-prob."""
    m = z.max(dim=-1, keepdim=True).values
    e = torch.exp(z - m)
    sums = [e.sum(-1)]
    if mask is not None:
        sums.append(e.masked_fill_(mask, 0.0).sum(-1))
    return torch.cat([m, torch.stack(sums, -1).log()], -1)


def merge_lse(x: Optional[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    """Combine two (n, 1 + j) parts (column 0 the max m, the rest log-sum-exps relative to it)."""
    if x is None:
        return y
    m = torch.maximum(x[:, :1], y[:, :1])

    def shift(part: torch.Tensor) -> torch.Tensor:  # where() keeps -inf - -inf from becoming nan
        return torch.where(part[:, :1] == m, part[:, 1:], part[:, 1:] + (part[:, :1] - m))

    return torch.cat([m, torch.logaddexp(shift(x), shift(y))], -1)


def accumulate_grad(grad_z, rows, cols, x, w, grad_x, grad_w) -> None:
    """Chain rule through a logits block (grad_z (n, c) fp32, already / T): into grad_x (A, *) fp32 and
    grad_w (V_rows, H) in w's dtype, in place (``addmm_``: no (c, H) product buffer in fp32)."""
    if w is None:
        grad_x[rows, cols] += grad_z
        return
    if w.dtype == torch.float32 and x.dtype == torch.float32:
        grad_x[rows].addmm_(grad_z, w[cols])
        grad_w[cols].addmm_(grad_z.T, x[rows])
        return
    grad_x[rows] += (grad_z.to(w.dtype) @ w[cols]).float()
    grad_w[cols].addmm_(grad_z.T.to(x.dtype), x[rows])


def _merge_top(best: Optional[tuple], b: torch.Tensor, a: torch.Tensor, k: int) -> tuple:
    """Keep the k largest teacher log-probs b (and the student's a at the same tokens) seen so far."""
    vals, idx = b.topk(min(k, b.shape[-1]), dim=-1)
    cand = (vals, a.gather(-1, idx))
    if best is not None:
        both = tuple(torch.cat(pair, dim=-1) for pair in zip(best, cand))
        vals, idx = both[0].topk(min(k, both[0].shape[-1]), dim=-1)
        cand = (vals, both[1].gather(-1, idx))
    return cand


def top_mass(top: Optional[tuple], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher and student mass (n,) of the kept top log-probs ``(b, a)``; NaN without them (``top_tokens`` 0)."""
    if top is None:
        nan = torch.full_like(like, float("nan"))
        return nan, nan
    return top[0].exp().sum(-1), top[1].exp().sum(-1)


# --- the full-vocabulary kernel ---------------------------------------------------------------------
class _Blocks:
    """Normalised student / teacher blocks of one token chunk: (a, b, p, q) per vocab range.

    One range: computed once (in place) and kept. Several: recomputed on every request.
    """

    def __init__(self, plan: Plan, rows: slice, tensors: tuple, inv_t: torch.Tensor):
        self.ranges = plan.chunking.vocab_ranges(plan.vocab_size)
        self.rows, self.tensors, self.inv_t = rows, tensors, inv_t
        self.cached = None
        if len(self.ranges) == 1:
            (a, p), (b, q) = (_log_softmax_in_place(z) for z in self._logits(self.ranges[0]))
            self.cached = (a, b, p, q)
            return
        self.lse_s, self.lse_t = None, None
        for cols in self.ranges:
            z_s, z_t = self._logits(cols)
            self.lse_s, self.lse_t = merge_lse(self.lse_s, lse_parts(z_s)), merge_lse(self.lse_t, lse_parts(z_t))

    def _logits(self, cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
        s_x, s_w, t_h, t_w = self.tensors
        return logits_block(s_x, s_w, self.rows, cols, self.inv_t), logits_block(t_h, t_w, self.rows, cols, self.inv_t)

    def __call__(self, cols: slice) -> tuple[torch.Tensor, ...]:
        if self.cached is not None:
            return self.cached
        z_s, z_t = self._logits(cols)
        a = z_s.sub_(self.lse_s[:, :1]).sub_(self.lse_s[:, 1:2])
        b = z_t.sub_(self.lse_t[:, :1]).sub_(self.lse_t[:, 1:2])
        return a, b, a.exp(), b.exp()


def _log_softmax_in_place(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, c) logits over the whole vocabulary -> (log-probs in z's storage, probs): one exp."""
    z.sub_(z.max(dim=-1, keepdim=True).values)
    e = z.exp()
    log_sum = e.sum(-1, keepdim=True).log_()
    return z.sub_(log_sum), e.mul_(log_sum.neg().exp_())


class _FullVocabDivergence(torch.autograd.Function):
    """Exact full-vocabulary divergence against a HiddenTarget; gradients formed in forward."""

    @staticmethod
    def forward(ctx, plan: Plan, weights, s_x, s_w, t_h, t_w, inv_temp):
        """weights (A,), s_x (A, H | V_rows), s_w (V_rows, H) | None, t_h (A, H_t), t_w (V_rows_t, H_t),
        inv_temp (A,) -> loss (), stats (A, 5): D, reverse KL, forward KL, teacher / student top mass."""
        grads_needed = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        grad_x = torch.zeros_like(s_x, dtype=torch.float32) if grads_needed else None
        # the head's gradient: one (V_rows, H) buffer in the head's dtype, handed to autograd as is
        grad_w = torch.zeros_like(s_w) if grads_needed and s_w is not None else None
        stats = s_x.new_zeros((s_x.shape[0], 5), dtype=torch.float32)
        loss = torch.zeros((), dtype=torch.float32, device=s_x.device)
        fused = s_w is not None and plan.chunking.vocab_chunk_size is None
        unit_temp = fused and bool((inv_temp == 1).all())
        for rows in plan.chunking.token_ranges(s_x.shape[0]):
            if fused:
                loss += _fused_rows(
                    plan,
                    rows,
                    (s_x, s_w, t_h, t_w),
                    None if unit_temp else inv_temp[rows],
                    weights[rows].float(),
                    stats[rows],
                    grad_x,
                    grad_w,
                )
                continue
            blocks = _Blocks(plan, rows, (s_x, s_w, t_h, t_w), inv_temp[rows, None])
            loss += _full_vocab_chunk(plan, blocks, weights[rows].float(), stats[rows], grad_x, grad_w)
            del blocks  # else the next chunk's blocks are built while this one's are still held
        ctx.grads = (grad_x, grad_w)
        ctx.dtypes = (s_x.dtype, None if s_w is None else s_w.dtype)
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, grad_loss, grad_stats):
        # The usual case (grad_loss == 1) hands the stored gradients over without a copy. ctx lets go of
        # them first: autograd's AccumulateGrad adopts a gradient nobody else holds as ``param.grad``,
        # but clones one that is still referenced (a second (V_rows, H) buffer).
        stored, ctx.grads = ctx.grads, None
        unit = bool(grad_loss == 1)
        grads = [None if g is None else (g if unit else g.mul_(grad_loss)).to(dt) for g, dt in zip(stored, ctx.dtypes)]
        del stored
        return None, None, *grads, None, None, None


def _full_vocab_chunk(
    plan: Plan, blocks: _Blocks, w: torch.Tensor, stats: torch.Tensor, grad_x, grad_w
) -> torch.Tensor:
    """Passes 2 and 3 for one token chunk: fills stats (n, 5) and the gradients; returns its loss."""
    n = w.shape[0]
    div, gsum, rkl, fkl = (w.new_zeros(n) for _ in range(4))
    top, kept_g = None, None
    for cols in blocks.ranges:
        a, b, p, q = blocks(cols)
        f, g = plan.divergence.pointwise(a, b, p, q, with_grad=True)
        div += f.sum(-1)
        gsum += g.sum(-1)
        del f
        rkl += _rowdot(p, a) - _rowdot(p, b)  # no (n, c) difference buffer
        fkl += _rowdot(q, b) - _rowdot(q, a)
        top = _merge_top(top, b, a, plan.top_tokens) if plan.top_tokens else None
        kept_g = g if blocks.cached is not None else None
    stats.copy_(torch.stack([div, rkl, fkl, *top_mass(top, div)], dim=-1))
    w_grad = w if plan.clamp is None else w * (div <= plan.clamp)
    chunk_loss = (w * (div if plan.clamp is None else div.clamp(max=plan.clamp))).sum()
    if grad_x is not None:
        scale = w_grad[:, None] * blocks.inv_t  # (n, 1)
        for cols in blocks.ranges:
            a, b, p, q = blocks(cols)
            g = kept_g if kept_g is not None else plan.divergence.pointwise(a, b, p, q, with_grad=True)[1]
            grad_z = g.addcmul_(p, gsum[:, None], value=-1.0).mul_(scale)  # (n, c): w (g - p c) / T
            accumulate_grad(grad_z, blocks.rows, cols, *blocks.tensors[:2], grad_x, grad_w)
    return chunk_loss


def _fp32_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(n, H) @ (V, H).T -> (n, V) fp32. bf16/fp16 on CUDA: the matmul writes fp32 itself
    (``torch.mm(..., out_dtype=)``, torch >= 2.9), saving a conversion pass; else upcast after."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _MM_OUT_DTYPE[0]:
        try:
            return torch.mm(x, w.T, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE[0] = False
    return (x @ w.T).float()


_MM_OUT_DTYPE = [True]  # whether this torch's mm takes out_dtype (found out on first use)


def _fused_rows(
    plan: Plan,
    rows: slice,
    tensors: tuple,
    inv_t: Optional[torch.Tensor],
    w: torch.Tensor,
    stats: torch.Tensor,
    grad_x,
    grad_w,
) -> torch.Tensor:
    """One token chunk of a linear student head over the whole vocabulary, in few (n, V) passes.

    The teacher's logits (inputs' dtype) give the top tokens and go through ``log_softmax(...,
    dtype=float32)``; the student's come out of the matmul in fp32; the temperature (inv_t (n,),
    None when it is 1 everywhere: no pass at all) scales both in fp32. The divergence's ``row_terms``
    gives value, gradient (in the head's dtype) and diagnostics; the per-row factor w / T is folded
    into the (n, H) sides of the two gradient matmuls. Fills stats (n, 5) and the gradients; returns
    the chunk's loss. Logits are finite here (a linear head). Peak: ~3.5 fp32 (n, V) buffers for
    reverse KL."""
    s_x, s_w, t_h, t_w = tensors
    vocab = plan.vocab_size
    z_t = t_h[rows] @ t_w[:vocab].T  # (n, V), inputs' dtype
    # the top tokens' indices, from the logits: same order as the log-probs' (T > 0); on a GPU this top-k is
    # ~12% of the kernel's time at Qwen2.5-3B/7B shapes (H200 profile), hence top_tokens = 0 to skip it
    top_idx = z_t.topk(min(plan.top_tokens, vocab), dim=-1).indices if plan.top_tokens else None
    if inv_t is None:
        b = torch.log_softmax(z_t, dim=-1, dtype=torch.float32)
    else:
        b = torch.log_softmax(z_t.to(torch.float32, copy=True).mul_(inv_t[:, None]), dim=-1)
    del z_t
    z_s = _fp32_logits(s_x[rows], s_w[:vocab])
    a = torch.log_softmax(z_s if inv_t is None else z_s.mul_(inv_t[:, None]), dim=-1)
    del z_s
    top = None if top_idx is None else (b.gather(-1, top_idx), a.gather(-1, top_idx))
    grads = grad_x is not None
    terms = plan.divergence.row_terms(a, b, s_w.dtype if grads else torch.float32)
    del a, b  # the gradient may live in their storage; the rest goes back to the allocator
    div = terms.value
    stats.copy_(torch.stack([div, terms.reverse_kl, terms.forward_kl, *top_mass(top, div)], -1))
    w_grad = w if plan.clamp is None else w * (div <= plan.clamp)
    chunk_loss = (w * (div if plan.clamp is None else div.clamp(max=plan.clamp))).sum()
    if grads:
        g = terms.grad  # (n, V): dD/d(z / T), in the head's dtype
        del terms
        # dL/dx = (w / T) * (G @ W);  dL/dW = G.T @ (x * w / T)
        scale = (w_grad if inv_t is None else w_grad * inv_t)[:, None]  # (n, 1) fp32
        grad_x[rows] = (g @ s_w[:vocab]).to(grad_x.dtype).mul_(scale)
        grad_w[:vocab].addmm_(g.T, (s_x[rows] * scale).to(s_x.dtype))
    return chunk_loss


def _hidden_kernel(plan: Plan, student: StudentLogits, target: HiddenTarget, weights, inv_temp) -> DivergenceResult:
    s_x, s_w = student.tensors
    loss, stats = _FullVocabDivergence.apply(
        plan, weights.detach(), s_x, s_w, target.hidden, target.head_weight, inv_temp
    )
    return DivergenceResult(loss, *stats.unbind(-1))


# --- public entry -------------------------------------------------------------------------------------
#: teacher-target type -> ``kernel(plan, student, target, weights, inv_temp) -> DivergenceResult``
TARGET_KERNELS = Registry("divergence target type")
TARGET_KERNELS.add(HiddenTarget, _hidden_kernel)
#: decorator: register a kernel for a target type (``register_target_kernel(TopKTarget)``)
register_target_kernel = TARGET_KERNELS.register


def divergence_loss(
    divergence: Divergence,
    student: StudentLogits,
    target,
    weights: torch.Tensor,
    temperature: torch.Tensor,
    chunking: Chunking = Chunking(),
    clamp: Optional[float] = None,
    top_tokens: int = 8,
) -> DivergenceResult:
    """Weighted divergence at A supervised positions, never forming (A, V) at once.

    Args:
        divergence: per-chunk maths (:func:`~verl_memopd.losses.divergences.get_divergence`).
        student: the student's logits at the A positions (hidden + head, or dense).
        target: the teacher's distribution there, from a transport's ``decode`` (HiddenTarget, TopKTarget).
        weights: (A,) non-negative per-token weights (e.g. dp_size / global teacher-token count).
        temperature: (A,) the rollout temperature of each position (> 0); divides both sides' logits.
            (The ``topk`` transport applied it teacher-side when encoding.)
        chunking: token / vocabulary chunk sizes.
        clamp: optional per-token cap on D_i (> 0): contributes min(D_i, clamp), no gradient above it.
        top_tokens: how many of the teacher's most likely tokens the mass diagnostics cover (default 8; 0 =
            none: no top-k pass, the two top-mass results are NaN).
    """
    a = student.num_tokens
    if target.num_tokens != a or weights.shape != (a,) or temperature.shape != (a,):
        raise ValueError(
            f"divergence_loss: student has {a} positions, target {target.num_tokens}, weights "
            f"{tuple(weights.shape)}, temperature {tuple(temperature.shape)}; all must be A = {a}"
        )
    if target.vocab_size != student.vocab_size:
        raise ValueError(
            f"divergence_loss: target vocab_size {target.vocab_size} != student vocab_size {student.vocab_size}"
        )
    if a and not bool((temperature > 0).all()):
        raise ValueError("divergence_loss: temperature must be > 0 at every position")
    if clamp is not None and not clamp > 0:
        raise ValueError(f"divergence_loss: clamp = {clamp} must be > 0 (or None)")
    if top_tokens < 0:
        raise ValueError(f"divergence_loss: top_tokens = {top_tokens} must be >= 0")
    kernel = TARGET_KERNELS.lookup(type(target))
    plan = Plan(divergence, student.vocab_size, chunking, clamp, top_tokens)
    return kernel(plan, student, target, weights, 1.0 / temperature.float())


def naive_divergence(
    divergence: Divergence,
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    vocab_size: int,
    temperature: torch.Tensor,
) -> torch.Tensor:
    """Reference: (A, V_rows_s) and (A, V_rows_t) logits -> (A,) divergence, all in one (A, V) piece.

    Padded rows (columns >= vocab_size), if any, are set to -inf before the softmax, explicitly.
    """

    def logp(logits: torch.Tensor) -> torch.Tensor:
        z = logits.float() / temperature.float()[:, None]
        if z.shape[-1] > vocab_size:
            z = z.masked_fill(torch.arange(z.shape[-1], device=z.device) >= vocab_size, -math.inf)
        return torch.log_softmax(z, dim=-1)[:, :vocab_size]

    return divergence.reference(logp(student_logits), logp(teacher_logits))
