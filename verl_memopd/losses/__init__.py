"""Losses (stage 6): chunked full-vocabulary divergences and the combined MemOPD actor loss.

    divergences  per-chunk maths of reverse KL / forward KL / generalised JSD (registry by name)
    chunked      the chunked full-vocabulary kernel (token x vocabulary chunks, gradients in
                 forward) and divergence_loss, which dispatches on the teacher target's type
    bins         the top-k transport's K + 1 bins kernel (registered with chunked)
    actor        verl's actor-loss interface: L = L_PPO(m_act) - alpha*H + lambda*L_OPD(m_T)

``actor`` imports verl; import it explicitly (``verl_memopd.losses.actor``). This package
imports only torch.
"""

from verl_memopd.losses import bins  # noqa: F401  (registers the TopKTarget kernel)
from verl_memopd.losses.chunked import Chunking, DivergenceResult, StudentLogits, divergence_loss, naive_divergence
from verl_memopd.losses.divergences import DIVERGENCES, Divergence, get_divergence, register_divergence

__all__ = [
    "Chunking",
    "DivergenceResult",
    "StudentLogits",
    "divergence_loss",
    "naive_divergence",
    "DIVERGENCES",
    "Divergence",
    "get_divergence",
    "register_divergence",
]
