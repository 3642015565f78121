"""Divergences between the student's and the teacher's next-token distributions: per-chunk maths.

Every divergence here is a sum of pointwise terms over the support (vocabulary entries, or
the K + 1 bins of the top-k transport)::

    D(p_S, p_T) = sum_j f(a_j, b_j)        a = log p_S, b = log p_T   (normalised log-probs)

A divergence supplies only ``f`` and ``g = df/da`` elementwise on a chunk (given ``a, b`` and
``p = exp(a), q = exp(b)``, which the kernel has anyway); the chunked kernels
(:mod:`verl_memopd.losses.chunked`) own normalisation, chunking and the softmax Jacobian
(``dD/dz_j = (g_j - p_S,j * sum_k g_k) / T`` for student logits ``z`` at temperature ``T``).
Zero-probability entries contribute 0 (``0 * log 0 = 0``); an entry where one side has mass and
the other has none gives +inf, the true value.

For the whole-vocabulary fast path (a token chunk's full rows at once, logits from a linear head and
therefore finite) a divergence also supplies ``row_terms``: per row its value ``D``, the gradient
already through the softmax, ``G = dD/dz`` (per unit weight, at temperature 1), and the reverse /
forward KL diagnostics, in as few (n, V) passes and buffers as its maths allows (on a GPU this step
is memory-bound: every pass over an (n, V) fp32 block costs about as much as the matmuls' share).
The base class derives them from ``pointwise``; ``reverse_kl`` and ``forward_kl`` write them in
closed form (p = exp(a), q = exp(b); sum_j p_j = 1)::

    reverse KL   d = a - b,  D = sum_j p_j d_j,  G = p d - p D          3.5 (n, V) buffers at most
    forward KL   D = sum_j q_j (b_j - a_j),      G = p - q

Each divergence also has ``reference``: the same quantity written plainly with
``torch.nn.functional`` over full (A, V) log-probs -- the naive path the kernels are tested
and benchmarked against.

Registered names: ``reverse_kl`` (default; KL(p_S || p_T), the MemOPD loss), ``forward_kl``
(KL(p_T || p_S)) and ``jsd`` (generalised Jensen-Shannon, parameter ``beta``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
import torch.nn.functional as F

from verl_memopd.registry import Registry

__all__ = ["Divergence", "RowTerms", "DIVERGENCES", "register_divergence", "get_divergence"]


def _rowdot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(n, c), (n, c) -> (n,) row-wise dot products, without an (n, c) product buffer (a batched
    matrix-vector product: slower than ``_row_sum_of_product`` on a GPU, used where no scratch is free)."""
    return torch.bmm(x.unsqueeze(1), y.unsqueeze(2)).view(-1)


def _row_sum_of_product(x: torch.Tensor, y: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """(n, V) x, y -> (n,) sum_j x_j y_j, the product written into ``scratch`` (n, V; may be x or y)."""
    return torch.mul(x, y, out=scratch).sum(-1)


def _grad_buffer(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where a gradient of ``dtype`` goes: ``like`` itself when the dtypes agree, else a new (n, V) buffer."""
    return like if like.dtype == dtype else torch.empty_like(like, dtype=dtype)


@dataclass(frozen=True)
class RowTerms:
    """What ``Divergence.row_terms`` returns for n whole-vocabulary rows.

    value (n,): D per row. grad (n, V): dD/dz, the gradient with respect to the (temperature-scaled)
    student logits, softmax Jacobian applied, per unit weight. reverse_kl, forward_kl (n,): the
    diagnostics KL(p_S || p_T) and KL(p_T || p_S)."""

    value: torch.Tensor
    grad: torch.Tensor
    reverse_kl: torch.Tensor
    forward_kl: torch.Tensor


class Divergence(ABC):
    """Pointwise maths of one divergence. Shapes: (n, c) chunks, or (A, V) in ``reference``."""

    name: ClassVar[str]

    @abstractmethod
    def pointwise(
        self, a: torch.Tensor, b: torch.Tensor, p: torch.Tensor, q: torch.Tensor, with_grad: bool = False
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """a, b: (n, c) fp32 student / teacher log-probs, p = exp(a), q = exp(b) (given, not
        recomputed) -> f (n, c) and g = df/da (n, c, a new tensor the caller may overwrite) or None."""

    def row_terms(self, a: torch.Tensor, b: torch.Tensor, grad_dtype: torch.dtype = torch.float32) -> RowTerms:
        """a, b: (n, V) fp32 student / teacher log-probs over the whole vocabulary (finite) ->
        :class:`RowTerms`, ``grad`` in ``grad_dtype`` (the head's: the matmuls that consume it run in it).
        May overwrite ``a`` and ``b`` (the caller is done with them); ``grad`` may share their storage.
        This default derives everything from ``pointwise``."""
        p, q = a.exp(), b.exp()
        f, g = self.pointwise(a, b, p, q, with_grad=True)
        value = f.sum(-1)
        d = torch.sub(a, b, out=f)  # f's storage
        rkl, fkl = _row_sum_of_product(p, d, a), -_row_sum_of_product(q, d, b)
        del f, d
        gsum = g.sum(-1, keepdim=True)
        return RowTerms(value, torch.addcmul(g, p, gsum, value=-1.0, out=_grad_buffer(g, grad_dtype)), rkl, fkl)

    @abstractmethod
    def reference(self, student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
        """student_logp, teacher_logp: (A, V) full log-probs -> (A,) divergence (autograd-friendly)."""


DIVERGENCES = Registry("divergence")
register_divergence = DIVERGENCES.register


def get_divergence(name: str, **params: Any) -> Divergence:
    """Build the divergence registered as ``name`` (``params``: e.g. ``beta`` for jsd)."""
    return DIVERGENCES.build(name, **params)


def _weighted_log_ratio(logp: torch.Tensor, log_other: torch.Tensor, prob: torch.Tensor) -> torch.Tensor:
    """prob * (logp - log_other), with 0 where prob == 0 (the nan of 0 * inf) and +inf kept."""
    out = (logp - log_other).mul_(prob)
    return out.nan_to_num_(nan=0.0, posinf=math.inf, neginf=-math.inf)


@register_divergence("reverse_kl")
@dataclass(frozen=True)
class ReverseKL(Divergence):
    """KL(p_S || p_T) = sum_j p_S,j (a_j - b_j): mode-seeking, over the student's own samples."""

    def pointwise(self, a, b, p, q, with_grad=False):
        f = _weighted_log_ratio(a, b, p)
        return f, (f + p) if with_grad else None  # g = p_S (a - b + 1)

    def row_terms(self, a, b, grad_dtype=torch.float32):
        q = b.exp()
        d = torch.sub(a, b, out=b)  # b's storage: d = a - b
        fkl = q.mul_(d).sum(-1).neg_()  # sum_j q_j (b_j - a_j)
        del q
        p = a.exp()
        pd = torch.mul(p, d, out=a)  # a's storage: p d
        value = pd.sum(-1)  # D = sum_j p_j d_j
        grad = torch.addcmul(pd, p, value[:, None], value=-1.0, out=_grad_buffer(pd, grad_dtype))  # p d - p D
        return RowTerms(value, grad, value, fkl)

    def reference(self, student_logp, teacher_logp):
        return F.kl_div(teacher_logp, student_logp, reduction="none", log_target=True).sum(-1)


@register_divergence("forward_kl")
@dataclass(frozen=True)
class ForwardKL(Divergence):
    """KL(p_T || p_S) = sum_j p_T,j (b_j - a_j): mass-covering."""

    def pointwise(self, a, b, p, q, with_grad=False):
        return _weighted_log_ratio(b, a, q), -q if with_grad else None  # g = -p_T

    def row_terms(self, a, b, grad_dtype=torch.float32):
        p, q = a.exp(), b.exp()
        d = torch.sub(b, a, out=b)  # b's storage: d = b - a
        value = _row_sum_of_product(q, d, a)  # D = sum_j q_j d_j
        rkl = _row_sum_of_product(p, d, a).neg_()
        return RowTerms(value, torch.sub(p, q, out=_grad_buffer(a, grad_dtype)), rkl, value)

    def reference(self, student_logp, teacher_logp):
        return F.kl_div(student_logp, teacher_logp, reduction="none", log_target=True).sum(-1)


@register_divergence("jsd")
@dataclass(frozen=True)
class GeneralizedJSD(Divergence):
    """beta * KL(p_T || M) + (1 - beta) * KL(p_S || M) with M = beta * p_T + (1 - beta) * p_S.

    beta in (0, 1) (default 0.5: the symmetric Jensen-Shannon divergence, bounded by log 2).
    """

    beta: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.beta < 1.0:
            raise ValueError(f"jsd: beta = {self.beta} must be strictly between 0 and 1")

    def pointwise(self, a, b, p, q, with_grad=False):
        log_m = torch.logaddexp(b + math.log(self.beta), a + math.log1p(-self.beta))
        student_term = _weighted_log_ratio(a, log_m, p).mul_(1.0 - self.beta)
        f = _weighted_log_ratio(b, log_m, q).mul_(self.beta).add_(student_term)
        return f, student_term if with_grad else None  # g = (1 - beta) p_S (a - log M)

    def reference(self, student_logp, teacher_logp):
        log_m = torch.logsumexp(
            torch.stack([teacher_logp + math.log(self.beta), student_logp + math.log1p(-self.beta)]), dim=0
        )
        kl_t = F.kl_div(log_m, teacher_logp, reduction="none", log_target=True).sum(-1)
        kl_s = F.kl_div(log_m, student_logp, reduction="none", log_target=True).sum(-1)
        return self.beta * kl_t + (1.0 - self.beta) * kl_s
