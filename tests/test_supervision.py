"""Teacher supervision transports and vocabulary agreement (verl_memopd.supervision)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from verl_memopd.fields import TEACHER_TAIL_LOGPROB, TEACHER_TOPK_IDS, TEACHER_TOPK_LOGPROBS
from verl_memopd.losses import Chunking, StudentLogits, divergence_loss, get_divergence, naive_divergence
from verl_memopd.supervision import (
    TRANSPORTS,
    HiddenTarget,
    SupervisionError,
    TopKTarget,
    VocabSpec,
    check_vocab_agreement,
    dense_logits_bytes_per_token,
    get_transport,
    nest_payload,
    payload_bytes_per_token,
    register_transport,
)

A, H, V, S_ROWS, T_ROWS = 23, 12, 61, 64, 128


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    hs = (0.5 * torch.randn(A, H, generator=g)).requires_grad_()
    ws = torch.randn(S_ROWS, H, generator=g).requires_grad_()
    ht, wt = 0.5 * torch.randn(A, H, generator=g), torch.randn(T_ROWS, H, generator=g)
    return hs, ws, ht, wt, 0.6 + torch.rand(A, generator=g), torch.rand(A, generator=g)


def _via(transport, hs, ws, ht, wt, temp, weights, div, chunking=Chunking(5, 17)):
    payload = transport.encode(ht, wt, V, temp)
    target = transport.decode(payload, wt, V)
    res = divergence_loss(div, StudentLogits(V, hidden=hs, head_weight=ws), target, weights, temp, chunking)
    return res, torch.autograd.grad(res.loss, (hs, ws))


def _exact(hs, ws, ht, wt, temp, weights, div):
    loss = (weights * naive_divergence(div, hs @ ws.T, ht @ wt.T, V, temp)).sum()
    return loss, torch.autograd.grad(loss, (hs, ws))


# --- transports --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["reverse_kl", "forward_kl", "jsd"])
def test_hidden_transport_is_exact(name):
    div = get_divergence(name)
    hs, ws, ht, wt, temp, weights = _case()
    res, grads = _via(get_transport("hidden"), hs, ws, ht, wt, temp, weights, div)
    loss, ref_grads = _exact(hs, ws, ht, wt, temp, weights, div)
    torch.testing.assert_close(res.loss, loss, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["reverse_kl", "forward_kl", "jsd"])
def test_topk_converges_to_exact_and_equals_it_at_k_equal_v(name):
    div = get_divergence(name)
    hs, ws, ht, wt, temp, weights = _case(seed=1)
    loss, ref_grads = _exact(hs, ws, ht, wt, temp, weights, div)
    errors = []
    for k in (1, 4, 16, 40, V):
        res, grads = _via(get_transport("topk", k=k, token_chunk_size=7), hs, ws, ht, wt, temp, weights, div)
        errors.append(
            float((res.per_token - naive_divergence(div, hs @ ws.T, ht @ wt.T, V, temp).detach()).abs().sum())
        )
        if name != "jsd":  # coarse-graining never increases a KL (data-processing inequality)
            assert float(res.loss) <= float(loss) + 1e-4
    assert errors == sorted(errors, reverse=True) and errors[0] > 100 * max(errors[-1], 1e-6)
    torch.testing.assert_close(res.loss, loss, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_topk_payload_is_the_teachers_top_tokens():
    _, _, ht, wt, temp, _ = _case(seed=2)
    payload = get_transport("topk", k=5).encode(ht, wt, V, temp)
    logp = torch.log_softmax((ht @ wt[:V].T) / temp[:, None], -1)
    top = logp.topk(5, dim=-1)
    assert torch.equal(payload[TEACHER_TOPK_IDS].long(), top.indices)
    torch.testing.assert_close(payload[TEACHER_TOPK_LOGPROBS], top.values)
    tail = torch.log1p(-top.values.exp().sum(-1))
    torch.testing.assert_close(payload[TEACHER_TAIL_LOGPROB], tail, rtol=1e-4, atol=1e-5)
    assert payload[TEACHER_TOPK_IDS].dtype == torch.int32


def test_padded_head_rows_are_excluded_on_both_sides():
    div = get_divergence("reverse_kl")
    hs, ws, ht, wt, temp, weights = _case(seed=3)
    with torch.no_grad():  # padding rows that would dominate any softmax they entered
        ws[V:] = 50.0
        wt[V:] = -50.0
    padded = divergence_loss(div, StudentLogits(V, hidden=hs, head_weight=ws), HiddenTarget(ht, wt, V), weights, temp)
    trimmed = divergence_loss(
        div, StudentLogits(V, hidden=hs, head_weight=ws[:V]), HiddenTarget(ht, wt[:V], V), weights, temp
    )
    torch.testing.assert_close(padded.per_token, trimmed.per_token)
    torch.testing.assert_close(padded.loss, _exact(hs, ws, ht, wt, temp, weights, div)[0], rtol=1e-5, atol=1e-5)


def test_byte_accounting_matches_encoded_payloads():
    hs, ws, ht, wt, temp, _ = _case(seed=4)
    hidden_bf16 = ht.to(torch.bfloat16)
    for transport, hidden in ((get_transport("hidden"), hidden_bf16), (get_transport("topk", k=9), ht)):
        payload = transport.encode(hidden, wt.to(hidden.dtype), V, temp)
        assert payload_bytes_per_token(payload) == transport.bytes_per_token(H, V, hidden.dtype)
    assert get_transport("hidden").bytes_per_token(3584, 152064, torch.bfloat16) == 7168
    assert dense_logits_bytes_per_token(152064, torch.bfloat16) == 304128


def test_nest_payload_rows():
    _, _, ht, wt, temp, _ = _case(seed=5)
    counts = torch.tensor([5, 0, 11, 7])
    nested = nest_payload(get_transport("hidden").encode(ht, wt, V, temp), counts)
    t = nested["memopd_teacher_hidden"]
    assert t.offsets().diff().tolist() == counts.tolist() and torch.equal(t.values(), ht)
    with pytest.raises(SupervisionError, match="row_counts sum to 22"):
        nest_payload({"x": ht}, torch.tensor([10, 12]))


def test_transport_errors_name_the_problem():
    hs, ws, ht, wt, temp, _ = _case(seed=6)
    with pytest.raises(ValueError, match="transport 'logit'; valid supervision transports: hidden, topk"):
        get_transport("logit")
    with pytest.raises(ValueError, match="already registered"):
        register_transport("hidden")(type("Again", (), {}))
    with pytest.raises(SupervisionError, match="needs the actor's frozen copy of the teacher head"):
        get_transport("hidden").decode({"memopd_teacher_hidden": ht}, None, V)
    with pytest.raises(SupervisionError, match=r"payload lacks \['memopd_teacher_tail_logprob'\]"):
        get_transport("topk").decode({TEACHER_TOPK_IDS: ht, TEACHER_TOPK_LOGPROBS: ht}, None, V)
    with pytest.raises(SupervisionError, match="k = 62 exceeds the vocabulary size 61"):
        get_transport("topk", k=V + 1).encode(ht, wt, V, temp)
    with pytest.raises(SupervisionError, match="head weight has 40 rows, fewer than the vocabulary size 61"):
        get_transport("hidden").encode(ht, wt[:40], V, temp)
    with pytest.raises(SupervisionError, match="must not require grad"):
        HiddenTarget(ht, wt.clone().requires_grad_(), V)
    assert set(TRANSPORTS) >= {"hidden", "topk"}


def test_topk_target_validation():
    ids = torch.tensor([[0, 1], [2, 3]])
    lps = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.5]]))
    tail = torch.log(torch.tensor([0.25, 0.0]))
    TopKTarget(ids, lps, tail, 4)  # valid, including a zero tail
    with pytest.raises(SupervisionError, match="ids repeat within a row"):
        TopKTarget(torch.tensor([[0, 0], [2, 3]]), lps, tail, 4)
    with pytest.raises(SupervisionError, match=r"ids outside the vocabulary \[0, 3\)"):
        TopKTarget(ids, lps, tail, 3)
    with pytest.raises(SupervisionError, match="mass \\+ tail mass must be 1"):
        TopKTarget(ids, lps, torch.log(torch.tensor([0.5, 0.1])), 4)
    with pytest.raises(SupervisionError, match="expected ids \\(A, K\\)"):
        TopKTarget(ids, lps[:1], tail, 4)


# --- vocabulary agreement ---------------------------------------------------------------------
class _Tok(SimpleNamespace):
    def __len__(self):
        return self.n


def test_vocab_agreement_allows_different_head_padding():
    student = VocabSpec("student", 151665, 151936, (151645,), 151643)
    teacher = VocabSpec("teacher", 151665, 152064, (151645,), 151643)
    assert check_vocab_agreement(student, teacher) == 151665


@pytest.mark.parametrize(
    "field,teacher_kwargs",
    [
        ("vocab_size: student 100 != teacher 101", dict(vocab_size=101, head_rows=128)),
        ("eos_token_ids: student \\(7,\\) != teacher \\(8,\\)", dict(eos_token_ids=(8,))),
        ("pad_token_id: student 0 != teacher None", dict(pad_token_id=None)),
    ],
)
def test_vocab_mismatch_names_the_field(field, teacher_kwargs):
    student = VocabSpec("student", 100, 128, (7,), 0)
    teacher = VocabSpec(
        **{**dict(name="teacher", vocab_size=100, head_rows=128, eos_token_ids=(7,), pad_token_id=0), **teacher_kwargs}
    )
    with pytest.raises(SupervisionError, match=field):
        check_vocab_agreement(student, teacher)


def test_vocab_spec_validation_and_hf_reading():
    with pytest.raises(SupervisionError, match="teacher: the output head has 90 rows but the tokenizer has 100"):
        VocabSpec("teacher", 100, 90, (7,))
    with pytest.raises(SupervisionError, match=r"student: eos_token_ids \[100\] outside the vocabulary"):
        VocabSpec("student", 100, 128, (100,))
    vocab = {f"t{i}": i for i in range(100)}
    tok = _Tok(n=100, eos_token_id=7, pad_token_id=0, get_vocab=lambda: vocab)
    spec = VocabSpec.from_hf("student", tok, SimpleNamespace(vocab_size=128), SimpleNamespace(eos_token_id=[7, 9]))
    assert dataclasses.replace(spec, vocab_digest=None) == VocabSpec("student", 100, 128, (7, 9), 0)
    swapped = {**vocab, "t1": 2, "t2": 1}  # same size, same special ids, different tokens
    other = VocabSpec.from_hf(
        "teacher",
        _Tok(n=100, eos_token_id=7, pad_token_id=0, get_vocab=lambda: swapped),
        SimpleNamespace(vocab_size=128),
        SimpleNamespace(eos_token_id=[7, 9]),
    )
    with pytest.raises(SupervisionError, match="vocab_digest: the tokenizers map tokens to different ids"):
        check_vocab_agreement(spec, other)
    assert check_vocab_agreement(spec, dataclasses.replace(other, vocab_digest=spec.vocab_digest)) == 100
