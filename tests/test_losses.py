"""Chunked full-vocabulary divergences (verl_memopd.losses.chunked / divergences) vs the naive path."""

import pytest
import torch

from verl_memopd.losses import (
    Chunking,
    StudentLogits,
    divergence_loss,
    get_divergence,
    naive_divergence,
    register_divergence,
)
from verl_memopd.losses.divergences import DIVERGENCES
from verl_memopd.supervision import HiddenTarget

# Awkward on purpose: A is not a multiple of the token chunk, V not a multiple of the vocab
# chunk, and both heads carry padded rows beyond V.
A, H, V, S_ROWS, T_ROWS = 37, 16, 97, 103, 128
CHUNKINGS = [Chunking(8, None), Chunking(5, 13), Chunking(64, 40)]
DIVS = [("reverse_kl", {}), ("forward_kl", {}), ("jsd", {"beta": 0.3})]


def _case(seed=0, scale=0.4):
    g = torch.Generator().manual_seed(seed)
    hs = (scale * torch.randn(A, H, generator=g)).requires_grad_()
    ws = torch.randn(S_ROWS, H, generator=g).requires_grad_()
    ht, wt = scale * torch.randn(A, H, generator=g), torch.randn(T_ROWS, H, generator=g)
    temp = 0.5 + torch.rand(A, generator=g)  # per-token rollout temperatures
    weights = torch.rand(A, generator=g)
    return hs, ws, ht, wt, temp, weights


def _naive(div, hs, ws, ht, wt, temp, weights, clamp=None):
    per_token = naive_divergence(div, hs @ ws.T, ht @ wt.T, V, temp)
    kept = per_token if clamp is None else per_token.clamp(max=clamp)
    return (weights * kept).sum(), per_token


@pytest.mark.parametrize("name,params", DIVS)
@pytest.mark.parametrize("chunking", CHUNKINGS, ids=str)
def test_chunked_matches_naive_values_and_gradients(name, params, chunking):
    div = get_divergence(name, **params)
    hs, ws, ht, wt, temp, weights = _case()
    res = divergence_loss(
        div, StudentLogits(V, hidden=hs, head_weight=ws), HiddenTarget(ht, wt, V), weights, temp, chunking
    )
    grads = torch.autograd.grad(res.loss, (hs, ws))
    ref_loss, ref_tok = _naive(div, hs, ws, ht, wt, temp, weights)
    ref_grads = torch.autograd.grad(ref_loss, (hs, ws))
    torch.testing.assert_close(res.loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res.per_token, ref_tok.detach(), rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert ref_grads[1][V:].abs().max() == 0 and grads[1][V:].abs().max() == 0  # padded head rows untouched


@pytest.mark.parametrize("name,params", DIVS)
def test_dense_student_logits_match_naive(name, params):
    div = get_divergence(name, **params)
    hs, ws, ht, wt, temp, weights = _case(seed=1)
    logits = (hs @ ws.T).detach().requires_grad_()
    res = divergence_loss(div, StudentLogits(V, logits=logits), HiddenTarget(ht, wt, V), weights, temp, Chunking(6, 20))
    ref = (weights * naive_divergence(div, logits, ht @ wt.T, V, temp)).sum()
    torch.testing.assert_close(res.loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        torch.autograd.grad(res.loss, logits)[0], torch.autograd.grad(ref, logits)[0], rtol=1e-4, atol=1e-6
    )


def test_diagnostics_match_naive():
    hs, ws, ht, wt, temp, weights = _case(seed=2)
    res = divergence_loss(
        get_divergence("jsd"),
        StudentLogits(V, hidden=hs, head_weight=ws),
        HiddenTarget(ht, wt, V),
        weights,
        temp,
        Chunking(5, 13),
        top_tokens=6,
    )
    zs, zt = (hs @ ws[:V].T / temp[:, None]).detach(), ht @ wt[:V].T / temp[:, None]
    rkl = naive_divergence(get_divergence("reverse_kl"), zs * temp[:, None], zt * temp[:, None], V, temp)
    fkl = naive_divergence(get_divergence("forward_kl"), zs * temp[:, None], zt * temp[:, None], V, temp)
    top = zt.topk(6, dim=-1).indices
    torch.testing.assert_close(res.reverse_kl, rkl, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res.forward_kl, fkl, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res.teacher_top_mass, zt.softmax(-1).gather(-1, top).sum(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(res.student_top_mass, zs.softmax(-1).gather(-1, top).sum(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,params", DIVS)
def test_pointwise_gradient_is_derivative_of_term(name, params):
    div = get_divergence(name, **params)
    g = torch.Generator().manual_seed(3)
    a = torch.log_softmax(torch.randn(4, 50, generator=g, dtype=torch.float64), -1).requires_grad_()
    b = torch.log_softmax(torch.randn(4, 50, generator=g, dtype=torch.float64), -1)
    f, grad = div.pointwise(a, b, a.exp(), b.exp(), with_grad=True)
    torch.testing.assert_close(grad, torch.autograd.grad(f.sum(), a)[0])


@pytest.mark.parametrize("name,params", DIVS)
def test_student_equal_to_teacher_gives_zero(name, params):
    hs, ws, _, _, temp, weights = _case(seed=4)
    teacher = HiddenTarget(hs.detach().clone(), ws.detach()[:V].clone(), V)
    res = divergence_loss(
        get_divergence(name, **params),
        StudentLogits(V, hidden=hs, head_weight=ws),
        teacher,
        weights,
        temp,
        Chunking(8, 30),
    )
    grads = torch.autograd.grad(res.loss, (hs, ws))
    assert res.per_token.abs().max() < 1e-5 and res.loss.abs() < 1e-5
    assert max(g.abs().max() for g in grads) < 1e-5


@pytest.mark.parametrize("name,params", DIVS)
def test_extreme_logits_stay_finite(name, params):
    g = torch.Generator().manual_seed(5)
    n = 9
    signs = torch.where(torch.rand(n, V, generator=g) < 0.5, -1.0, 1.0)
    logits = (1e4 * signs * torch.rand(n, V, generator=g)).requires_grad_()  # student logits in [-1e4, 1e4]
    teacher_head = torch.eye(V)  # teacher logits = its hidden states: also +-1e4
    teacher_hidden = 1e4 * torch.where(torch.rand(n, V, generator=g) < 0.5, -1.0, 1.0)
    temp, weights = torch.ones(n), torch.ones(n)
    div = get_divergence(name, **params)
    res = divergence_loss(
        div,
        StudentLogits(V, logits=logits),
        HiddenTarget(teacher_hidden, teacher_head, V),
        weights,
        temp,
        Chunking(4, 10),
    )
    (grad,) = torch.autograd.grad(res.loss, logits)
    assert torch.isfinite(res.loss) and torch.isfinite(res.per_token).all() and torch.isfinite(grad).all()
    ref = (weights * naive_divergence(div, logits, teacher_hidden, V, temp)).sum()
    torch.testing.assert_close(res.loss, ref, rtol=1e-5, atol=1e-2)


def test_bf16_inputs_within_budget_of_plain_pytorch():
    """bf16 hidden/head (FSDP mixed precision): same error budget as plain PyTorch on the same inputs."""
    div = get_divergence("reverse_kl")
    hs, ws, ht, wt, temp, weights = _case(seed=8)
    hs16, ws16 = (t.detach().to(torch.bfloat16).requires_grad_() for t in (hs, ws))
    res = divergence_loss(
        div, StudentLogits(V, hidden=hs16, head_weight=ws16), HiddenTarget(ht, wt, V), weights, temp, Chunking(8, 30)
    )
    grads = torch.autograd.grad(res.loss, (hs16, ws16))
    plain, _ = _naive(div, hs16, ws16, ht, wt, temp, weights)  # plain PyTorch, bf16 matmuls
    plain_grads = torch.autograd.grad(plain, (hs16, ws16))
    exact, _ = _naive(div, *(t.detach().float().requires_grad_() for t in (hs16, ws16)), ht, wt, temp, weights)
    budget = 2 * float((plain - exact).abs().detach()) + 1e-6
    assert float((res.loss - exact).abs().detach()) <= budget
    assert all(g.dtype == torch.bfloat16 for g in grads)
    for got, want in zip(grads, plain_grads):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3)


def test_clamp_caps_value_and_stops_gradient():
    div = get_divergence("reverse_kl")
    hs, ws, ht, wt, temp, weights = _case(seed=6, scale=1.0)
    _, per_token = _naive(div, hs, ws, ht, wt, temp, weights)
    ordered = per_token.detach().sort().values
    clamp = float(ordered[A // 2 : A // 2 + 2].mean())  # between two tokens' values: no tie at the cap
    res = divergence_loss(
        div,
        StudentLogits(V, hidden=hs, head_weight=ws),
        HiddenTarget(ht, wt, V),
        weights,
        temp,
        Chunking(8, 30),
        clamp=clamp,
    )
    ref, _ = _naive(div, hs, ws, ht, wt, temp, weights, clamp=clamp)
    torch.testing.assert_close(res.loss, ref, rtol=1e-5, atol=1e-5)
    got, want = torch.autograd.grad(res.loss, hs)[0], torch.autograd.grad(ref, hs)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert got[per_token.detach() > clamp].abs().max() == 0


def test_no_gradient_pass_without_grad_inputs():
    hs, ws, ht, wt, temp, weights = _case(seed=7)
    with torch.no_grad():
        res = divergence_loss(
            get_divergence("reverse_kl"),
            StudentLogits(V, hidden=hs, head_weight=ws),
            HiddenTarget(ht, wt, V),
            weights,
            temp,
        )
    assert not res.loss.requires_grad
    torch.testing.assert_close(
        res.loss, _naive(get_divergence("reverse_kl"), hs, ws, ht, wt, temp, weights)[0].detach(), rtol=1e-5, atol=1e-5
    )


def test_registry_errors():
    with pytest.raises(ValueError, match=r"unknown divergence 'kl_typo'.*forward_kl.*jsd.*reverse_kl"):
        get_divergence("kl_typo")
    with pytest.raises(ValueError, match="already registered"):
        register_divergence("reverse_kl")(type("Again", (), {}))
    with pytest.raises(ValueError, match="beta = 1.0 must be strictly between 0 and 1"):
        get_divergence("jsd", beta=1.0)
    assert set(DIVERGENCES) >= {"reverse_kl", "forward_kl", "jsd"}


def test_bad_inputs_name_the_problem():
    hs, ws, ht, wt, temp, weights = _case()
    student, target, div = (
        StudentLogits(V, hidden=hs, head_weight=ws),
        HiddenTarget(ht, wt, V),
        get_divergence("reverse_kl"),
    )
    with pytest.raises(ValueError, match="either hidden \\+ head_weight, or logits"):
        StudentLogits(V, hidden=hs)
    with pytest.raises(ValueError, match="fewer than vocab_size 200"):
        StudentLogits(200, hidden=hs, head_weight=ws)
    with pytest.raises(ValueError, match="weights"):
        divergence_loss(div, student, target, weights[:-1], temp)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        divergence_loss(div, student, target, weights, torch.zeros(A))
    with pytest.raises(ValueError, match="clamp = -1"):
        divergence_loss(div, student, target, weights, temp, clamp=-1.0)
    with pytest.raises(ValueError, match="target vocab_size 96 != student vocab_size 97"):
        divergence_loss(div, student, HiddenTarget(ht, wt, V - 1), weights, temp)
    with pytest.raises(ValueError, match="chunk sizes must be >= 1"):
        Chunking(0)
    odd = type("OddTarget", (), {"num_tokens": A, "vocab_size": V})()
    with pytest.raises(KeyError, match="'OddTarget'; valid divergence target types: HiddenTarget, TopKTarget"):
        divergence_loss(div, student, odd, weights, temp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_gradient_is_one_buffer_in_the_heads_dtype_adopted_as_its_grad(dtype):
    """The only (V_rows, H) memory is the head's gradient itself: formed in the head's dtype and handed
    to autograd, which adopts it as ``.grad`` without a copy (a still-referenced gradient would be cloned)."""
    hs, ws, ht, wt, temp, weights = _case(seed=4)
    hs, ws = (t.detach().to(dtype).requires_grad_() for t in (hs, ws))
    seen = []
    ws.register_hook(lambda g: seen.append((g.data_ptr(), g.dtype)))  # keeps no reference to g
    div = get_divergence("reverse_kl")
    res = divergence_loss(div, StudentLogits(V, hidden=hs, head_weight=ws), HiddenTarget(ht, wt, V), weights, temp)
    res.loss.backward()
    assert seen == [(ws.grad.data_ptr(), dtype)]
