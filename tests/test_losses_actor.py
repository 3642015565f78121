"""The combined MemOPD actor loss through verl's actor-loss interface (verl_memopd.losses.actor).

Batches use verl's V1 NO_PADDING layout (jagged nested tensors); the "model" is a tiny
embedding + output head so that model outputs can be recomputed for any micro-batch split.
"""

import os
import tempfile
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.metric import Metric
from verl.utils.py_functional import append_to_dict
from verl.workers.config import ActorConfig
from verl.workers.utils.losses import ppo_loss

from verl_memopd.fields import STUDENT_LOGITS_STREAM
from verl_memopd.losses import get_divergence, naive_divergence
from verl_memopd.losses.actor import (
    LossInputError,
    OPDLossConfig,
    assign_global_teacher_counts,
    memopd_actor_loss,
    opd_loss,
)
from verl_memopd.supervision import get_transport, nest_payload

V, ROWS, H, HT = 41, 48, 8, 10  # vocabulary, padded head rows, student / teacher hidden
PROMPT_LENS, RESP_LENS = [3, 5, 2, 4, 6, 3], [7, 4, 9, 5, 6, 8]
ENTROPY_COEFF, COEF, TEMP = 0.01, 0.7, 0.8


def _nested(tensors):
    return torch.nested.as_nested_tensor(tensors, layout=torch.jagged)


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": (0.5 * torch.randn(ROWS, H, generator=g)).requires_grad_(),
        "head": torch.randn(ROWS, H, generator=g).requires_grad_(),
        "t_emb": 0.5 * torch.randn(ROWS, HT, generator=g),
        "t_head": torch.randn(ROWS + 16, HT, generator=g),
    }


def _batch(params, transport="hidden", seed=1, temperature=TEMP):
    """A verl actor micro-batch: B rows, teacher payload at m_T positions, global counts set."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, V, (p,), generator=g) for p in PROMPT_LENS]
    responses = [torch.randint(0, V, (r,), generator=g) for r in RESP_LENS]
    m_act = [(torch.rand(r, generator=g) < 0.75).long() for r in RESP_LENS]
    m_t = [m * (torch.rand(len(m), generator=g) < 0.8).long() for m in m_act]
    m_t[3] = torch.zeros_like(m_t[3])  # a row without teacher tokens
    calls = [torch.sort(torch.randint(0, 3, (r,), generator=g)).values for r in RESP_LENS]
    td = TensorDict(
        {
            "prompts": _nested(prompts),
            "responses": _nested(responses),
            "input_ids": _nested([torch.cat(pr) for pr in zip(prompts, responses)]),
            "response_mask": _nested(m_act),
            "loss_mask": _nested(m_act),
            "old_log_probs": _nested([-torch.rand(r, generator=g) - 1.0 for r in RESP_LENS]),
            "advantages": _nested([torch.randn(r, generator=g) for r in RESP_LENS]),
            "memopd_teacher_mask": _nested(m_t),
            "memopd_call_index": _nested(calls),
        },
        batch_size=[len(PROMPT_LENS)],
    )
    # the teacher's final hidden states at the positions that predict the m_T tokens, in row order
    t_hidden = torch.cat(
        [
            params["t_emb"][torch.cat([p, r])[len(p) - 1 + torch.nonzero(m).flatten()]]
            for p, r, m in zip(prompts, responses, m_t)
        ]
    )
    counts = torch.stack([m.sum() for m in m_t])
    temps = (
        torch.full((len(t_hidden),), temperature)
        if isinstance(temperature, float)
        else temperature.repeat_interleave(counts)
    )
    payload = get_transport(transport, **({"k": V} if transport == "topk" else {})).encode(
        t_hidden, params["t_head"], V, temps
    )
    for key, value in nest_payload(payload, counts).items():
        td[key] = value
    tu.assign_non_tensor(
        td,
        temperature=temperature,
        dp_size=1,
        batch_num_tokens=int(td["loss_mask"].values().sum()),
        global_batch_size=None,
    )
    assign_global_teacher_counts(td)
    return td


def _model_output(params, data, stream=False):
    """What the actor engine returns for a micro-batch (log_probs/entropy as verl; memopd_* as documented);
    ``stream``: also the tensor every output is computed from (here the hidden states, (sum L, H))."""
    ids = data["input_ids"]
    temp = data["temperature"]
    temp = temp.repeat_interleave(ids.offsets().diff()) if isinstance(temp, torch.Tensor) else torch.tensor(temp)
    hidden = params["emb"][ids.values()]  # (sum L, H): position j predicts token j + 1
    logits = (hidden @ params["head"].T) / temp.reshape(-1, 1)
    logp = torch.log_softmax(logits, -1)
    labels = torch.roll(ids.values(), -1)
    nest = partial(torch.nested.nested_tensor_from_jagged, offsets=ids.offsets())
    return {
        "log_probs": nest(logp.gather(-1, labels[:, None]).squeeze(-1)),
        "entropy": nest(-(logp.exp() * logp).sum(-1)),
        "memopd_hidden": nest(hidden),
        "memopd_lm_head_weight": params["head"],
        "memopd_teacher_head_weight": params["t_head"],
        **({STUDENT_LOGITS_STREAM: hidden} if stream else {}),
    }


def _actor_config():
    return ActorConfig(strategy="fsdp2", ppo_micro_batch_size_per_gpu=1, rollout_n=1, entropy_coeff=ENTROPY_COEFF)


def _run(params, micro_batches, opd, dp_size=1):
    """Forward + backward per micro-batch as verl's engine does; returns (sum of losses, grads, metrics)."""
    config, total, metrics = _actor_config(), 0.0, {}
    for mb in micro_batches:
        tu.assign_non_tensor(mb, dp_size=dp_size)
        loss, mets = memopd_actor_loss(config, opd, _model_output(params, mb), mb)
        loss.backward()
        total += float(loss.detach())
        append_to_dict(metrics, mets)  # as verl's engine collects micro-batch metrics
    grads = {k: p.grad.clone() for k, p in params.items() if p.requires_grad}
    for p in params.values():
        p.grad = None
    return total, grads, {k: Metric.aggregate_dp([v]) for k, v in metrics.items() if isinstance(v, Metric)}


def _hand_reference(params, data):
    """L_PPO(m_act) - alpha*H + lambda*L_OPD(m_T), written out per token."""
    ppo, ent, opd, n_act, n_t = 0.0, 0.0, 0.0, 0, 0
    div = get_divergence("reverse_kl")
    for b in range(len(PROMPT_LENS)):
        p, r = data["prompts"][b], data["responses"][b]
        seq = torch.cat([p, r])
        pred = seq[len(p) - 1 : len(seq) - 1]  # tokens whose states predict the response tokens
        logits = params["emb"][pred] @ params["head"].T / TEMP
        logp = torch.log_softmax(logits, -1)
        lp = logp.gather(-1, r[:, None]).squeeze(-1)
        ratio = torch.exp(lp - data["old_log_probs"][b])
        adv = data["advantages"][b]
        clipped = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        pg = torch.where(adv < 0, torch.minimum(clipped, -adv * 3.0), clipped)
        m_act, m_t = data["response_mask"][b].bool(), data["memopd_teacher_mask"][b].bool()
        ppo = ppo + pg[m_act].sum()
        ent = ent + (-(logp.exp() * logp).sum(-1))[m_act].sum()
        t_logits = params["t_emb"][pred] @ params["t_head"].T
        opd = (
            opd + naive_divergence(div, logits[m_t] * TEMP, t_logits[m_t], V, torch.full((int(m_t.sum()),), TEMP)).sum()
        )
        n_act, n_t = n_act + int(m_act.sum()), n_t + int(m_t.sum())
    return ppo / n_act - ENTROPY_COEFF * ent / n_act + COEF * opd / n_t


# --- the combined loss ----------------------------------------------------------------------------
def test_combined_loss_matches_hand_computed_reference():
    params = _params()
    data = _batch(params)
    loss, grads, _ = _run(
        params, [data], OPDLossConfig(vocab_size=V, coef=COEF, token_chunk_size=4, vocab_chunk_size=11)
    )
    ref = _hand_reference(params, data)
    ref_grads = torch.autograd.grad(ref, (params["emb"], params["head"]))
    torch.testing.assert_close(torch.tensor(loss), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads["emb"], ref_grads[0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grads["head"], ref_grads[1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("split", ["chunk2", "chunk3", "uneven"])
def test_micro_batch_split_invariance_of_loss_gradients_and_metrics(split):
    params = _params()
    data = _batch(params)
    opd = OPDLossConfig(vocab_size=V, coef=COEF, divergence="jsd", jsd_beta=0.4, token_chunk_size=5)
    whole = _run(params, [data], opd)
    if split == "uneven":  # like verl's dynamic batch size: index_select groups
        parts = [tu.index_select_tensor_dict(data, idx) for idx in ([3], [4, 0], [1, 5, 2])]  # [3]: no m_T tokens
    else:
        parts = tu.chunk_tensordict(data, int(split[-1]))
    pieces = _run(params, parts, opd)
    assert pieces[0] == pytest.approx(whole[0], rel=1e-5)
    for k in whole[1]:
        torch.testing.assert_close(pieces[1][k], whole[1][k], rtol=1e-4, atol=1e-7)
    assert pieces[2].keys() == whole[2].keys()
    for k in ("memopd/distill_loss", "memopd/reverse_kl", "memopd/reverse_kl_call/0", "memopd/student_top_mass"):
        assert pieces[2][k] == pytest.approx(whole[2][k], rel=1e-5)


def test_data_parallel_split_invariance():
    """Two simulated DP ranks (dp_size=2, global counts): FSDP's gradient average == one rank."""
    params = _params()
    data = _batch(params)
    opd = OPDLossConfig(vocab_size=V, coef=COEF)
    whole = _run(params, [data], opd)
    ranks = [_run(params, [tu.index_select_tensor_dict(data, idx)], opd, dp_size=2) for idx in ([0, 1, 2], [3, 4, 5])]
    assert (ranks[0][0] + ranks[1][0]) / 2 == pytest.approx(whole[0], rel=1e-5)
    for k in whole[1]:
        torch.testing.assert_close((ranks[0][1][k] + ranks[1][1][k]) / 2, whole[1][k], rtol=1e-4, atol=1e-7)
    for k in ("memopd/reverse_kl", "memopd/teacher_top_mass"):  # verl averages SUM metrics over ranks
        assert (ranks[0][2][k] + ranks[1][2][k]) / 2 == pytest.approx(whole[2][k], rel=1e-5)


def test_metrics_are_global_means():
    params = _params()
    data = _batch(params)
    _, _, metrics = _run(params, tu.chunk_tensordict(data, 2), OPDLossConfig(vocab_size=V, coef=COEF))
    rkl, calls = [], []
    for b in range(len(PROMPT_LENS)):
        p, r = data["prompts"][b], data["responses"][b]
        pred = torch.cat([p, r])[len(p) - 1 : -1]
        m_t = data["memopd_teacher_mask"][b].bool()
        s, t = params["emb"][pred][m_t] @ params["head"].T, params["t_emb"][pred][m_t] @ params["t_head"].T
        rkl.append(
            naive_divergence(get_divergence("reverse_kl"), s, t, V, torch.full((int(m_t.sum()),), TEMP)).detach()
        )
        calls.append(data["memopd_call_index"][b][m_t])
    rkl, calls = torch.cat(rkl), torch.cat(calls)
    assert metrics["memopd/reverse_kl"] == pytest.approx(float(rkl.mean()), rel=1e-5)
    assert metrics["memopd/distill_loss"] == pytest.approx(float(rkl.mean()), rel=1e-5)
    for t in range(3):
        assert metrics[f"memopd/reverse_kl_call/{t}"] == pytest.approx(float(rkl[calls == t].mean()), rel=1e-5)
    assert 0 < metrics["memopd/student_top_mass"] < 1 and 0 < metrics["memopd/teacher_top_mass"] < 1
    _, _, without = _run(params, [data], OPDLossConfig(vocab_size=V, coef=COEF, top_mass_tokens=0))
    assert not {"memopd/student_top_mass", "memopd/teacher_top_mass"} & without.keys()  # 0: not logged
    assert without["memopd/reverse_kl"] == pytest.approx(metrics["memopd/reverse_kl"], rel=1e-6)


def test_topk_transport_at_k_equal_v_and_per_sample_temperature():
    params = _params()
    temps = torch.tensor([0.7, 1.0, 1.3, 0.9, 1.1, 0.8])
    opd = OPDLossConfig(vocab_size=V, coef=COEF, token_chunk_size=6)
    hidden = _run(params, [_batch(params, temperature=temps)], opd)
    topk = _run(
        params, [_batch(params, "topk", temperature=temps)], OPDLossConfig(vocab_size=V, coef=COEF, transport="topk")
    )
    assert topk[0] == pytest.approx(hidden[0], rel=1e-5)
    for k in hidden[1]:
        torch.testing.assert_close(topk[1][k], hidden[1][k], rtol=1e-4, atol=1e-6)


def test_coef_zero_is_ppo_only_and_reads_no_teacher_fields():
    params = _params()
    data = _batch(params)
    bare = data.exclude("memopd_teacher_mask", "memopd_teacher_hidden")
    loss, _ = memopd_actor_loss(
        _actor_config(), OPDLossConfig(vocab_size=V, coef=0.0), _model_output(params, bare), bare
    )
    want, _ = ppo_loss(_actor_config(), _model_output(params, data), data)
    torch.testing.assert_close(loss, want)


def test_a_mini_batch_of_verl_padding_rows_only_is_ppo_only():
    params = _params()
    data = _batch(params)
    padding = data.clone()  # verl's synthetic rows: no action tokens, hence no teacher tokens, on any rank
    padding["response_mask"] = padding["loss_mask"] = _nested(
        [torch.zeros_like(m) for m in data["response_mask"].unbind()]
    )
    padding["memopd_teacher_mask"] = _nested([torch.zeros_like(m) for m in data["memopd_teacher_mask"].unbind()])
    tu.assign_non_tensor(padding, batch_num_tokens=0, memopd_teacher_num_tokens=0)
    loss, metrics = _call(params, padding)
    want, _ = ppo_loss(_actor_config(), _model_output(params, padding), padding)  # verl's own term (0/0 there)
    torch.testing.assert_close(loss, want, equal_nan=True)
    assert not any(k.startswith("memopd/") for k in metrics)


# --- bad input -------------------------------------------------------------------------------------
def _call(params, data, **opd):
    return memopd_actor_loss(_actor_config(), OPDLossConfig(vocab_size=V, **opd), _model_output(params, data), data)


def test_bad_inputs_raise_errors_that_name_the_problem():
    params = _params()
    data = _batch(params)
    bad = data.clone()
    m_t = [m.clone() for m in bad["memopd_teacher_mask"].unbind()]
    m_t[2] = torch.ones_like(m_t[2])  # row 2 has context tokens (m_act = 0)
    bad["memopd_teacher_mask"] = _nested(m_t)
    with pytest.raises(LossInputError, match=r"m_T <= m_act .* rows \[2\]"):
        _call(params, bad)
    empty = data.clone()
    tu.assign_non_tensor(empty, memopd_teacher_num_tokens=0)
    with pytest.raises(LossInputError, match="empty teacher mask"):
        _call(params, empty)
    uncounted = data.exclude("memopd_teacher_num_tokens")
    with pytest.raises(LossInputError, match="'memopd_teacher_num_tokens'.*assign_global_teacher_counts"):
        _call(params, uncounted)
    short, counts = data.clone(), data["memopd_teacher_hidden"].offsets().diff()
    counts[0] -= 1  # the teacher dropped one of row 0's tokens
    short["memopd_teacher_hidden"] = nest_payload({"h": data["memopd_teacher_hidden"].values()[1:]}, counts)["h"]
    with pytest.raises(LossInputError, match="tokens per row; the teacher mask has"):
        _call(params, short)
    no_student = {k: v for k, v in _model_output(params, data).items() if k != "memopd_hidden"}
    with pytest.raises(LossInputError, match="memopd_hidden.*memopd_lm_head_weight.*memopd_logits"):
        memopd_actor_loss(_actor_config(), OPDLossConfig(vocab_size=V), no_student, data)
    with pytest.raises(ValueError, match="transport 'logits'; valid supervision transports: hidden, topk"):
        OPDLossConfig(vocab_size=V, transport="logits")
    with pytest.raises(ValueError, match=r"unknown divergence 'rkl'"):
        OPDLossConfig(vocab_size=V, divergence="rkl")
    with pytest.raises(ValueError, match="jsd_beta is set but divergence is 'reverse_kl'"):
        OPDLossConfig(vocab_size=V, jsd_beta=0.3)


# --- real collectives -----------------------------------------------------------------------------
def _count_worker(rank, init_file, rows, expected):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    data = tu.index_select_tensor_dict(_batch(_params()), rows[rank])
    assign_global_teacher_counts(data, dp_group=dist.group.WORLD)
    got = (data["memopd_teacher_num_tokens"], tu.get(data, "memopd_teacher_num_tokens_per_call"))
    dist.destroy_process_group()
    assert got == expected, (rank, got, expected)


@pytest.mark.timeout(120)
def test_global_teacher_counts_sum_over_data_parallel_ranks():
    data = _batch(_params())
    expected = (data["memopd_teacher_num_tokens"], tu.get(data, "memopd_teacher_num_tokens_per_call"))
    assert expected[0] == sum(expected[1]) > 0
    with tempfile.TemporaryDirectory() as tmp:
        args = (os.path.join(tmp, "store"), ([0, 3], [1, 2, 4, 5]), expected)
        mp.start_processes(_count_worker, args=args, nprocs=2, start_method="fork")  # fork: no re-import of verl


# --- the PPO weight (memopd.ppo_coef) and the per-term gradient norms ------------------------------
@pytest.mark.parametrize("ppo_coef", [0.0, 0.5])
def test_ppo_coef_scales_only_the_ppo_term(ppo_coef):
    params = _params()
    data = _batch(params)
    opd = OPDLossConfig(vocab_size=V, coef=COEF)
    full, _ = memopd_actor_loss(_actor_config(), opd, _model_output(params, data), data)
    scaled, _ = memopd_actor_loss(_actor_config(), opd, _model_output(params, data), data, ppo_coef=ppo_coef)
    ppo, _ = ppo_loss(_actor_config(), _model_output(params, data), data)
    torch.testing.assert_close(scaled, full - (1 - ppo_coef) * ppo)
    assert abs(float(ppo.detach())) > 1e-3  # the PPO term is not zero on this batch: the check above can fail


def test_without_a_ppo_term_the_advantage_never_reaches_the_gradient():
    """What lets the ppo_coef=0 arms drop the critic (experiment ``ArmsConfig.critic_free``): GAE's or GRPO's
    advantages, or any others, give the same actor loss and the same gradients, bit for bit."""
    params = _params()
    data = _batch(params)
    opd = OPDLossConfig(vocab_size=V, coef=COEF)
    results = []
    for scale in (1.0, -7.0):
        batch = data.clone()
        batch["advantages"] = data["advantages"] * scale + 0.5
        loss, _ = memopd_actor_loss(_actor_config(), opd, _model_output(params, batch), batch, ppo_coef=0.0)
        loss.backward()
        results.append((loss.detach(), {k: params[k].grad.clone() for k in ("emb", "head")}))
        ppo, _ = ppo_loss(_actor_config(), _model_output(params, batch), batch)
        assert abs(float(ppo.detach())) > 1e-3  # the PPO term is not zero on either batch: the check below can fail
        params["emb"].grad = params["head"].grad = None
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    with_ppo = [memopd_actor_loss(_actor_config(), opd, _model_output(params, b), b)[0] for b in (data, batch)]
    assert not torch.equal(with_ppo[0].detach(), with_ppo[1].detach())  # with the PPO term they would differ


def test_term_grad_norms_equal_separate_backward_passes():
    params = _params()
    data = _batch(params)
    out = _model_output(params, data, stream=True)
    stream = out[STUDENT_LOGITS_STREAM]  # both terms are computed from it
    opd = OPDLossConfig(vocab_size=V, coef=COEF)
    loss, metrics = memopd_actor_loss(_actor_config(), opd, out, data, grad_norms=True)
    loss.backward()  # the step's own backward still works after the norms' passes, and gives the same gradients
    got = {k: params[k].grad.clone() for k in ("emb", "head")}
    params["emb"].grad = params["head"].grad = None
    _, want_grads, _ = _run(params, [data], opd)
    for k in got:
        torch.testing.assert_close(got[k], want_grads[k])
    out = _model_output(params, data, stream=True)  # a fresh graph (the same values: no optimizer step)
    stream = out[STUDENT_LOGITS_STREAM]
    ppo, _ = ppo_loss(_actor_config(), out, data)
    distill, _ = opd_loss(opd, out, data)
    for name, term in (("ppo", ppo), ("opd", distill)):
        want = torch.autograd.grad(term, stream, retain_graph=True)[0].norm()
        got = torch.as_tensor(Metric.aggregate_dp([metrics[f"memopd/grad_norm_logits/{name}"]]))
        torch.testing.assert_close(got.float(), want)
    assert Metric.aggregate_dp([metrics["memopd/grad_norm_logits/ppo"]]) != Metric.aggregate_dp(
        [metrics["memopd/grad_norm_logits/opd"]]
    )
    _, plain = memopd_actor_loss(_actor_config(), opd, _model_output(params, data), data, grad_norms=True)
    assert not any(k.startswith("memopd/grad_norm_logits") for k in plain)  # no stream: nothing reported


def test_opd_alone_halves_the_reverse_kl_of_a_fixed_batch_in_20_adam_steps():
    """One fixed batch, zero advantages (the PPO term has no gradient), 20 Adam steps on the actor loss: the
    student's reverse KL to the teacher at the m_T tokens must fall by more than half."""
    params = _params()
    data = _batch(params)
    data["advantages"] = _nested([torch.zeros(r) for r in RESP_LENS])
    opd = OPDLossConfig(vocab_size=V, coef=1.0)
    trainable = [params["emb"], params["head"]]
    adam = torch.optim.Adam(trainable, lr=0.05)
    kls = []
    for _ in range(21):
        loss, metrics = memopd_actor_loss(_actor_config(), opd, _model_output(params, data), data)
        kls.append(float(Metric.aggregate_dp([metrics["memopd/reverse_kl"]])))
        adam.zero_grad()
        loss.backward()
        adam.step()
    assert kls[-1] < 0.5 * kls[0], f"reverse KL {kls[0]:.4f} -> {kls[-1]:.4f} after 20 Adam steps"
