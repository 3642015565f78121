"""The whole-vocabulary fast path of the chunked divergence (``chunked._fused_rows`` + ``Divergence.row_terms``).

A linear student head with ``vocab_chunk_size=None`` runs the fast path; a vocabulary chunk as wide as V
runs the general three-pass kernel on the same numbers. Both must agree with each other and with the naive
loss for every registered divergence, with per-token weights and temperatures, a clamp, padded head rows,
and in bf16 (the GPU setting). ``row_terms``' closed forms must equal the base class's derivation from
``pointwise``.
"""

import pytest
import torch

from verl_memopd.losses import Chunking, StudentLogits, divergence_loss, get_divergence, naive_divergence
from verl_memopd.losses.divergences import Divergence
from verl_memopd.supervision import HiddenTarget

A, H, HT, V, S_ROWS, T_ROWS = 29, 12, 20, 83, 90, 96
DIVS = [("reverse_kl", {}), ("forward_kl", {}), ("jsd", {"beta": 0.3})]


def _case(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hs = (0.5 * torch.randn(A, H, generator=g)).to(dtype).requires_grad_()
    ws = torch.randn(S_ROWS, H, generator=g).to(dtype).requires_grad_()
    ht, wt = (0.5 * torch.randn(A, HT, generator=g)).to(dtype), torch.randn(T_ROWS, HT, generator=g).to(dtype)
    temp = 0.5 + torch.rand(A, generator=g)
    weights = torch.rand(A, generator=g)
    return hs, ws, ht, wt, temp, weights


def _run(div, case, chunking, clamp=None):
    hs, ws, ht, wt, temp, weights = case
    res = divergence_loss(
        div,
        StudentLogits(V, hidden=hs, head_weight=ws),
        HiddenTarget(ht, wt, V),
        weights,
        temp,
        chunking,
        clamp=clamp,
        top_tokens=5,
    )
    grads = torch.autograd.grad(res.loss, (hs, ws))
    return res, grads


@pytest.mark.parametrize("name,params", DIVS)
@pytest.mark.parametrize("clamped", [False, True])
def test_fast_path_equals_general_kernel_and_naive(name, params, clamped):
    div, case = get_divergence(name, **params), _case(seed=1)
    hs, ws, ht, wt, temp, weights = case
    naive = naive_divergence(div, hs @ ws.T, ht @ wt.T, V, temp)
    clamp = float(naive.detach().median()) + 1e-3 if clamped else None
    fast, fast_grads = _run(div, case, Chunking(7, None), clamp)
    general, general_grads = _run(div, case, Chunking(7, V), clamp)
    ref_loss = (weights * (naive if clamp is None else naive.clamp(max=clamp))).sum()
    ref_grads = torch.autograd.grad(ref_loss, (hs, ws))
    torch.testing.assert_close(fast.loss, ref_loss, rtol=1e-5, atol=1e-5)
    for got, other, want in zip(fast_grads, general_grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got, other, rtol=1e-4, atol=1e-5)
    for field in ("per_token", "reverse_kl", "forward_kl", "teacher_top_mass", "student_top_mass"):
        torch.testing.assert_close(getattr(fast, field), getattr(general, field), rtol=1e-5, atol=1e-5)
    assert fast_grads[1][V:].abs().max() == 0  # padded head rows untouched
    if clamped:
        assert fast_grads[0][naive.detach() > clamp].abs().max() == 0


@pytest.mark.parametrize("name,params", DIVS)
def test_fast_path_in_bf16_is_as_close_to_exact_as_the_general_kernel(name, params):
    div, case = get_divergence(name, **params), _case(seed=2, dtype=torch.bfloat16)
    hs, ws, ht, wt, temp, weights = case
    exact_inputs = [t.detach().float().requires_grad_() for t in (hs, ws)]
    exact = (
        weights * naive_divergence(div, exact_inputs[0] @ exact_inputs[1].T, ht.float() @ wt.float().T, V, temp)
    ).sum()
    exact_grads = torch.autograd.grad(exact, exact_inputs)
    fast, fast_grads = _run(div, case, Chunking(8, None))
    general, general_grads = _run(div, case, Chunking(8, V))
    assert all(g.dtype == torch.bfloat16 for g in fast_grads)
    assert abs(float(fast.loss - exact)) <= 2 * abs(float(general.loss - exact)) + 1e-4
    for got, other, want in zip(fast_grads, general_grads, exact_grads):
        scale = float(want.abs().max())
        assert float((got.float() - want).abs().max()) <= 2 * float((other.float() - want).abs().max()) + 1e-2 * scale


@pytest.mark.parametrize("name,params", [("reverse_kl", {}), ("forward_kl", {})])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_closed_form_row_terms_equal_the_generic_derivation(name, params, grad_dtype):
    div = get_divergence(name, **params)
    g = torch.Generator().manual_seed(3)
    a, b = (torch.log_softmax(3 * torch.randn(6, 50, generator=g), -1) for _ in range(2))
    closed = div.row_terms(a.clone(), b.clone(), grad_dtype)
    generic = Divergence.row_terms(div, a.clone(), b.clone(), grad_dtype)
    assert closed.grad.dtype == generic.grad.dtype == grad_dtype
    for field in ("value", "grad", "reverse_kl", "forward_kl"):
        torch.testing.assert_close(
            getattr(closed, field).float(),
            getattr(generic, field).float(),
            rtol=1e-5,
            atol=1e-6 if grad_dtype == torch.float32 else 1e-2,
        )
    # the gradient is the derivative of D through the softmax: check against autograd
    z = a.clone().requires_grad_()
    value = div.reference(torch.log_softmax(z, -1), b).sum()
    torch.testing.assert_close(
        closed.grad.float(),
        torch.autograd.grad(value, z)[0],
        rtol=1e-4,
        atol=1e-6 if grad_dtype == torch.float32 else 1e-2,
    )


@pytest.mark.parametrize("chunking", [Chunking(7, None), Chunking(7, V)])
def test_without_top_mass_the_loss_and_gradients_are_unchanged(chunking):
    """top_tokens=0 skips the top-k pass (fast path and general kernel): loss, gradients and KLs as with it,
    the two top-mass results NaN."""
    div, case = get_divergence("reverse_kl"), _case(seed=3)
    hs, ws, ht, wt, temp, weights = case
    with_top, grads = _run(div, case, chunking)
    without = divergence_loss(
        div, StudentLogits(V, hidden=hs, head_weight=ws), HiddenTarget(ht, wt, V), weights, temp, chunking, top_tokens=0
    )
    for got, want in zip(torch.autograd.grad(without.loss, (hs, ws)), grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for field in ("per_token", "reverse_kl", "forward_kl"):
        torch.testing.assert_close(getattr(without, field), getattr(with_top, field), rtol=0, atol=0)
    assert without.teacher_top_mass.isnan().all() and without.student_top_mass.isnan().all()
    assert (with_top.teacher_top_mass > 0).all()
