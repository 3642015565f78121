"""The combined MemOPD actor loss, through verl's actor-loss interface.

    L = c_PPO * (L_PPO(m_act) - alpha * H(m_act)) + lambda * L_OPD(m_T),   L_OPD = (1 / sum m_T) * sum_j m_T,j * D_j

``c_PPO`` is ``memopd.ppo_coef`` (1: the method; 0: on-policy distillation alone).

``L_PPO - alpha*H`` is verl's own ``ppo_loss`` (policy-loss registry, ``actor.entropy_coeff`` =
alpha, verl's KL loss if configured); ``D_j`` is the full-vocabulary divergence at action
position j (:mod:`verl_memopd.losses.chunked`). Installed with the worker's loss hook, exactly
like verl's ``ppo_loss`` / ``distillation_ppo_loss``::

    worker.set_loss_fn(partial(memopd_actor_loss, config=actor_config, opd_config=OPDLossConfig(...)))

The engine calls ``loss_fn(model_output=..., data=micro_batch, dp_group=...)`` once per
micro-batch and back-propagates each result. L_OPD is normalised by the teacher-token count of
the whole mini-batch on all data-parallel ranks (and multiplied by ``dp_size``, as verl's
``agg_loss`` does, because FSDP averages gradients over ranks), so summed gradients do not
depend on how the mini-batch is split. L_OPD is always this token mean over m_T (the method's
definition), whatever ``actor.loss_agg_mode`` does to the PPO term. Metrics are partial sums
over that same count (``AggregationType.SUM``), so verl's aggregation yields exact global means.

The engine should put the ``memopd_*`` entries into ``model_output`` only when this loss
consumes them (``train_batch``): for forward-only calls verl's ``postprocess_batch_func``
concatenates every model-output key as a nested tensor.

Inputs -- verl's V1 NO_PADDING layout: jagged nested tensors, one row per episode::

    data (micro-batch TensorDict)
      prompts (B, P*), responses (B, R*), response_mask (B, R*) = m_act     verl
      temperature: float or (B,) -- the rollout temperature                  verl
      dp_size: int                                                           verl (engine)
      memopd_teacher_mask (B, R*) 0/1 = m_T, m_T <= m_act                   ours
      memopd_teacher_num_tokens: int, sum of m_T over the mini-batch on     ours: call
          all DP ranks (non-tensor)                                          assign_global_teacher_counts
      memopd_call_index (B, R*) int -- call t of each response token        ours, optional
      memopd_teacher_num_tokens_per_call: tuple[int] (non-tensor)           with memopd_call_index
      the transport's payload at the m_T positions, in order (B, A_b*, ...) teacher worker group
          hidden: memopd_teacher_hidden (B, A_b*, H_t)
          topk:   memopd_teacher_topk_ids, memopd_teacher_topk_logprobs (B, A_b*, K),
                  memopd_teacher_tail_logprob (B, A_b*)
    model_output (the actor engine's forward; besides verl's log_probs / entropy)
      the student, either
        memopd_hidden (B, L*, H)  final post-norm hidden states, aligned like log_probs
                                  (sequence position j predicts token j + 1), and
        memopd_lm_head_weight (V_rows, H)  the live output head (gradients flow into it);
      or
        memopd_logits (B, L*, V_rows)  unscaled logits, same alignment;
      memopd_teacher_head_weight (V_rows_t, H_t)  frozen copy of the teacher head ('hidden' only)
      memopd_logits_stream  the model's logits tensor itself ((1, N, V) stream or (B, L, V) padded), which both
                            verl's log-probs and ``memopd_logits`` are views of; optional: with it, audit
                            steps report each term's gradient norm w.r.t. the logits (:func:`term_grad_norms`)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.losses import ppo_loss

from verl_memopd.fields import (
    CALL_INDEX,
    STUDENT_HEAD,
    STUDENT_HIDDEN,
    STUDENT_LOGITS,
    STUDENT_LOGITS_STREAM,
    TEACHER_HEAD,
    TEACHER_MASK,
    TEACHER_NUM_TOKENS,
    TEACHER_NUM_TOKENS_PER_CALL,
)
from verl_memopd.losses.chunked import Chunking, DivergenceResult, StudentLogits, divergence_loss
from verl_memopd.losses.divergences import get_divergence
from verl_memopd.supervision import get_transport

__all__ = [
    "OPDLossConfig",
    "LossInputError",
    "assign_global_teacher_counts",
    "opd_loss",
    "memopd_actor_loss",
    "term_grad_norms",
]


class LossInputError(ValueError):
    """The actor loss received data or model outputs that break the documented contract."""


@dataclass(frozen=True)
class OPDLossConfig:
    """The teacher branch of the actor loss. Every field but ``vocab_size`` is the ``memopd.distill`` key of the same
    name (``trainer.config.MemopdConfig.opd_loss_config`` copies them by name; the defaults agree, a test holds them).

    Attributes:
        vocab_size: V agreed by student and teacher (``supervision.check_vocab_agreement``).
        coef: lambda >= 0, the distillation weight (0: PPO only; teacher fields are not read).
        divergence: registered divergence name (default ``reverse_kl``, the paper's).
        jsd_beta: beta of ``jsd`` (default 0.5); must stay at its default for other divergences.
        transport: registered transport name the teacher used (default ``hidden``).
        token_clamp: optional cap on each token's divergence (> 0); None (default) = no cap.
        token_chunk_size / vocab_chunk_size: see :class:`~verl_memopd.losses.chunked.Chunking`.
        top_mass_tokens: teacher tokens covered by the mass metrics ``memopd/{teacher,student}_top_mass`` (default
            8; 0 = no such metrics, no top-k pass).
    """

    vocab_size: int
    coef: float = 1.0
    divergence: str = "reverse_kl"
    jsd_beta: float = 0.5
    transport: str = "hidden"
    token_clamp: Optional[float] = None
    token_chunk_size: int = Chunking.token_chunk_size
    vocab_chunk_size: Optional[int] = None
    top_mass_tokens: int = 8

    def __post_init__(self) -> None:
        if self.vocab_size < 1 or not self.coef >= 0:
            raise ValueError(f"OPDLossConfig: vocab_size = {self.vocab_size} must be >= 1 and coef = {self.coef} >= 0")
        if self.divergence != "jsd" and self.jsd_beta != 0.5:
            raise ValueError(f"OPDLossConfig: jsd_beta is set but divergence is {self.divergence!r}, not 'jsd'")
        self.make_divergence(), get_transport(self.transport), self.chunking  # unknown names / bad sizes raise here
        if self.token_clamp is not None and not self.token_clamp > 0:
            raise ValueError(f"OPDLossConfig: token_clamp = {self.token_clamp} must be > 0 or None")
        if self.top_mass_tokens < 0:
            raise ValueError(
                f"OPDLossConfig: top_mass_tokens = {self.top_mass_tokens} must be >= 0 (0 = no top-mass metrics)"
            )

    def make_divergence(self):
        return get_divergence(self.divergence, **({"beta": self.jsd_beta} if self.divergence == "jsd" else {}))

    @property
    def chunking(self) -> Chunking:
        return Chunking(self.token_chunk_size, self.vocab_chunk_size)


# --- layout helpers ---------------------------------------------------------------------------
def _values(data: TensorDict, key: str, where: str) -> torch.Tensor:
    if key not in data.keys():
        raise LossInputError(f"{where}: data has no {key!r} (see verl_memopd.losses.actor for the contract)")
    t = data[key]
    if not (isinstance(t, torch.Tensor) and t.is_nested):
        raise LossInputError(f"{where}: data[{key!r}] must be a jagged nested tensor (verl NO_PADDING layout)")
    return t


def _non_tensor(data: TensorDict, key: str, who: str):
    value = tu.get_non_tensor_data(data=data, key=key, default=None)
    if value is None:
        raise LossInputError(f"data has no {key!r}; it is set by {who} before the micro-batch split")
    return value


def assign_global_teacher_counts(data: TensorDict, dp_group=None) -> None:
    """Set ``memopd_teacher_num_tokens`` (and the per-call counts) for a whole mini-batch.

    Call once per mini-batch, before it is split into micro-batches (where verl's engine sets
    ``batch_num_tokens``); with ``dp_group`` the counts are summed over the data-parallel ranks.
    """
    mask = _values(data, TEACHER_MASK, "assign_global_teacher_counts").values().bool()
    calls = (
        _values(data, CALL_INDEX, "assign_global_teacher_counts").values()[mask].long()
        if CALL_INDEX in data.keys()
        else None
    )
    num_calls = torch.tensor([0 if calls is None or calls.numel() == 0 else int(calls.max()) + 1], device=mask.device)
    if dp_group is not None:
        dist.all_reduce(num_calls, op=dist.ReduceOp.MAX, group=dp_group)
    per_call = (
        torch.bincount(calls, minlength=int(num_calls)) if calls is not None else mask.new_zeros(0, dtype=torch.long)
    )
    counts = torch.cat([mask.sum().view(1), per_call])
    if dp_group is not None:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=dp_group)
    tu.assign_non_tensor(data, **{TEACHER_NUM_TOKENS: int(counts[0])})
    if calls is not None:
        tu.assign_non_tensor(data, **{TEACHER_NUM_TOKENS_PER_CALL: tuple(counts[1:].tolist())})


@dataclass(frozen=True)
class _Positions:
    """The micro-batch's A teacher positions. seq_index (A,): row in the (sum L_b, ...)
    model outputs that predicts the token; row (A,): batch row; row_counts (B,): A_b."""

    seq_index: torch.Tensor
    row: torch.Tensor
    row_counts: torch.Tensor
    call: Optional[torch.Tensor]


def _teacher_positions(data: TensorDict) -> _Positions:
    where = "memopd loss"
    teacher = _values(data, TEACHER_MASK, where)
    action = _values(data, "response_mask", where)
    prompt_lens = _values(data, "prompts", where).offsets().diff()
    resp_lens = _values(data, "responses", where).offsets().diff()
    for key, t in ((TEACHER_MASK, teacher), ("response_mask", action)):
        if not torch.equal(t.offsets().diff(), resp_lens):
            raise LossInputError(
                f"{where}: {key} row lengths {t.offsets().diff().tolist()} != responses {resp_lens.tolist()}"
            )
    m_t, m_act = teacher.values().bool(), action.values().bool()
    row = torch.repeat_interleave(torch.arange(len(resp_lens), device=m_t.device), resp_lens)
    if (m_t & ~m_act).any():
        raise LossInputError(
            f"{where}: teacher mask must satisfy m_T <= m_act (response_mask); violated in rows "
            f"{sorted(set(row[m_t & ~m_act].tolist()))[:8]}"
        )
    pos_in_resp = torch.arange(m_t.numel(), device=m_t.device) - teacher.offsets()[:-1].repeat_interleave(resp_lens)
    seq_start = torch.cat([prompt_lens.new_zeros(1), (prompt_lens + resp_lens).cumsum(0)[:-1]])
    seq_index = (seq_start + prompt_lens)[row] + pos_in_resp - 1  # the position that predicts the token
    call = _values(data, CALL_INDEX, where).values()[m_t].long() if CALL_INDEX in data.keys() else None
    return _Positions(seq_index[m_t], row[m_t], torch.bincount(row[m_t], minlength=len(resp_lens)), call)


def _student(model_output: dict, pos: _Positions, total_tokens: int, vocab_size: int) -> StudentLogits:
    def rows_of(key: str) -> torch.Tensor:
        t = model_output[key]
        tokens = t.values() if t.is_nested else t
        if tokens.shape[0] != total_tokens:
            raise LossInputError(
                f"model_output[{key!r}] has {tokens.shape[0]} token rows; prompts + responses have {total_tokens}"
            )
        return tokens.index_select(0, pos.seq_index)

    if STUDENT_HIDDEN in model_output and STUDENT_HEAD in model_output:
        return StudentLogits(vocab_size, hidden=rows_of(STUDENT_HIDDEN), head_weight=model_output[STUDENT_HEAD])
    if STUDENT_LOGITS in model_output:
        return StudentLogits(vocab_size, logits=rows_of(STUDENT_LOGITS))
    raise LossInputError(
        f"model_output needs the student as {STUDENT_HIDDEN!r} + {STUDENT_HEAD!r}, or {STUDENT_LOGITS!r}; "
        f"it has {sorted(model_output)}"
    )


def _temperature(data: TensorDict, pos: _Positions) -> torch.Tensor:
    temp = _non_tensor(data, "temperature", "verl's trainer (the rollout temperature)")
    if isinstance(temp, torch.Tensor) and temp.dim() == 1:
        return temp.float()[pos.row]
    return torch.full(pos.row.shape, float(temp), device=pos.row.device)


# --- the loss ---------------------------------------------------------------------------------
def opd_loss(opd_config: OPDLossConfig, model_output: dict, data: TensorDict) -> tuple[torch.Tensor, dict]:
    """L_OPD for one micro-batch, normalised over the global teacher-token count -> (loss, metrics)."""
    pos = _teacher_positions(data)
    total = int(
        _values(data, "prompts", "memopd loss").offsets()[-1] + _values(data, "responses", "memopd loss").offsets()[-1]
    )
    transport = get_transport(opd_config.transport)
    payload = {}
    for key in transport.payload_keys:
        nested = _values(data, key, f"transport {opd_config.transport!r}")
        if not torch.equal(nested.offsets().diff().to(pos.row_counts.device), pos.row_counts):
            raise LossInputError(
                f"data[{key!r}] has {nested.offsets().diff().tolist()} tokens per row; the teacher mask has "
                f"{pos.row_counts.tolist()}"
            )
        payload[key] = nested.values()
    target = transport.decode(payload, model_output.get(TEACHER_HEAD), opd_config.vocab_size)
    global_count = int(_non_tensor(data, TEACHER_NUM_TOKENS, "assign_global_teacher_counts"))
    dp_size = int(_non_tensor(data, "dp_size", "verl's engine"))
    if global_count < 1:
        raise LossInputError(
            f"empty teacher mask: {TEACHER_NUM_TOKENS} = 0 over the mini-batch, but opd coef = {opd_config.coef}"
        )
    if len(pos.row) > global_count:
        raise LossInputError(
            f"{len(pos.row)} teacher tokens in this micro-batch > {TEACHER_NUM_TOKENS} = {global_count}"
        )
    student = _student(model_output, pos, total, opd_config.vocab_size)
    weight = dp_size / global_count
    result = divergence_loss(
        opd_config.make_divergence(),
        student,
        target,
        torch.full(pos.row.shape, weight, device=pos.row.device),
        _temperature(data, pos),
        opd_config.chunking,
        opd_config.token_clamp,
        opd_config.top_mass_tokens,
    )
    return result.loss, _metrics(opd_config, result, pos, data, weight, dp_size)


def _metrics(opd_config, result: DivergenceResult, pos: _Positions, data, weight: float, dp_size: int) -> dict:
    """Partial sums of global means (SUM aggregation): exact after verl sums micro-batches."""

    def part(per_token: torch.Tensor) -> Metric:
        return Metric(AggregationType.SUM, per_token.sum() * weight)

    metrics = {
        "memopd/distill_loss": Metric(AggregationType.SUM, result.loss.detach()),
        "memopd/reverse_kl": part(result.reverse_kl),
        "memopd/forward_kl": part(result.forward_kl),
    }
    if opd_config.top_mass_tokens:
        metrics["memopd/teacher_top_mass"] = part(result.teacher_top_mass)
        metrics["memopd/student_top_mass"] = part(result.student_top_mass)
    if opd_config.token_clamp is not None:
        metrics["memopd/clamped_frac"] = part((result.per_token > opd_config.token_clamp).float())
    if pos.call is not None:
        per_call = _non_tensor(data, TEACHER_NUM_TOKENS_PER_CALL, "assign_global_teacher_counts")
        for t, count in enumerate(per_call):
            if count:
                kl = result.reverse_kl[pos.call == t].sum() * dp_size / count
                metrics[f"memopd/reverse_kl_call/{t}"] = Metric(AggregationType.SUM, kl)
    return metrics


def _padding_only(data: TensorDict) -> bool:
    """A mini-batch of verl's synthetic padding rows only (``batch_num_tokens``: action tokens on all
    DP ranks = 0): nothing to distil, and verl's PPO term is 0 too. A mini-batch WITH action tokens
    but no teacher tokens still fails in :func:`opd_loss` (it would train without its teacher)."""
    return int(tu.get_non_tensor_data(data=data, key="batch_num_tokens", default=1)) == 0


def term_grad_norms(policy_loss: torch.Tensor, distill: torch.Tensor, logits: torch.Tensor) -> dict:
    """The gradient norm of each loss term, unweighted, w.r.t. the student's ``logits`` (the tensor both terms are
    computed from: every parameter gradient is this gradient pulled back through the same network, so the two
    norms compare the terms' pull on the model). Backward passes through the loss ops only (not the model), for
    audit steps. ``distill`` must be an evaluation of L_OPD of its own (the chunked divergence hands its fused
    gradients over once, to the one backward that consumes them). Metrics ``memopd/grad_norm_logits/{ppo,opd}``
    (mean over micro-batches)."""
    norms = {}
    for name, term in (("ppo", policy_loss), ("opd", distill)):
        grad = (
            torch.autograd.grad(term, logits, retain_graph=True, allow_unused=True)[0] if term.requires_grad else None
        )
        value = torch.zeros((), device=logits.device) if grad is None else grad.float().norm()
        norms[f"memopd/grad_norm_logits/{name}"] = Metric(AggregationType.MEAN, value.detach())
    return norms


def memopd_actor_loss(
    config,
    opd_config: OPDLossConfig,
    model_output: dict,
    data: TensorDict,
    dp_group=None,
    ppo_coef: float = 1.0,
    grad_norms: bool = False,
):
    """verl actor-loss hook: ``c_PPO * (L_PPO(m_act) - alpha*H) + lambda*L_OPD(m_T)`` -> (loss, metrics).

    ``config`` is verl's ActorConfig (policy loss, clip ratios, ``entropy_coeff`` = alpha, loss
    aggregation); ``opd_config`` the teacher branch; ``ppo_coef`` = c_PPO (``memopd.ppo_coef``). Same
    signature as verl's ``ppo_loss`` (plus the keywords). ``grad_norms``: also report each term's gradient
    norm (:func:`term_grad_norms`) when the model output carries ``memopd_logits_stream``.
    """
    policy_loss, metrics = ppo_loss(config, model_output, data, dp_group)
    if opd_config.coef == 0 or _padding_only(data):
        return ppo_coef * policy_loss, metrics
    distill, opd_metrics = opd_loss(opd_config, model_output, data)
    metrics.update(opd_metrics)
    if grad_norms and STUDENT_LOGITS_STREAM in model_output:
        probe, _ = opd_loss(opd_config, model_output, data)  # a second L_OPD: the first one's gradients are the step's
        metrics.update(term_grad_norms(policy_loss, probe, model_output[STUDENT_LOGITS_STREAM]))
    return ppo_coef * policy_loss + opd_config.coef * distill, metrics
