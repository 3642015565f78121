"""RCE: packed == independent per-call forwards (logits and gradients); no leakage; flat deviates."""

import copy
import dataclasses
import re

import pytest
import torch
from transformers import AttentionInterface

from verl_memopd import audit, rce
from verl_memopd.attention import BACKENDS, HF_NAMES, attention_implementation, forward_layout, hf_name
from verl_memopd.bench.tiny import student_model
from verl_memopd.packing import build_layout, pack_episode
from verl_memopd.rce import EpisodeShape, random_episodes, rce_audit, reference_logits, reversed_block_packer, self_test
from verl_memopd.rce.__main__ import main as rce_cli
from verl_memopd.records import Episode
from verl_memopd.segments import segment_meta

VOCAB = 256
SHAPE = EpisodeShape(prefix_len=(4, 24), chunk_len=(1, 12), response_len=(1, 10))


@pytest.fixture(scope="module")
def model():
    return student_model(VOCAB)


@pytest.mark.parametrize("seed", [0, 1])
def test_packed_logits_equal_per_call_logits(model, seed):
    report = rce_audit(model, random_episodes(16, VOCAB, seed, SHAPE), batch_episodes=6)
    assert report.passed and report.max_abs_diff <= 1e-4
    assert report.action_tokens > 100
    assert report.flat_max_abs_diff > 0.05  # the persistent-history misalignment is real
    assert model.config._attn_implementation == "sdpa"


def _action_loss(model, layout, weights):
    logits = forward_layout(model, layout)
    logprobs = torch.log_softmax(logits.float(), -1).gather(1, layout.action_ids.unsqueeze(1)).squeeze(1)
    return (logprobs * weights).sum()


@pytest.mark.parametrize("seed", [2, 3])
def test_packed_gradients_equal_per_call_gradients(model, seed):
    episodes = random_episodes(5, VOCAB, seed, SHAPE)
    weights = torch.rand(
        build_layout("per_call", episodes).action_index.numel(), generator=torch.Generator().manual_seed(seed)
    )
    grads = {}
    for name, impl in (("per_call", "sdpa"), ("packed", hf_name("torch")), ("flat", "sdpa")):
        model.zero_grad()
        with attention_implementation(model, impl):
            _action_loss(model, build_layout(name, episodes, VOCAB), weights).backward()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    flat_moved = 0.0
    for n, ref in grads["per_call"].items():
        torch.testing.assert_close(grads["packed"][n], ref, atol=1e-5, rtol=1e-4, msg=n)
        flat_moved = max(flat_moved, (grads["flat"][n] - ref).abs().max().item())
    assert flat_moved > 1e-3


@torch.no_grad()
def test_perturbing_a_call_does_not_move_the_next_calls_logits(model):
    gen = torch.Generator().manual_seed(4)
    episode = next(ep for ep in random_episodes(20, VOCAB, 4, SHAPE) if len(ep.invocations) >= 3)
    t = 1
    old = episode.invocations[t]
    context = torch.randint(VOCAB, (len(old.prompt_ids) - episode.prefix_len,), generator=gen).tolist()
    response = torch.randint(VOCAB, (len(old.response_ids),), generator=gen).tolist()
    new = dataclasses.replace(old, prompt_ids=episode.prefix_ids + tuple(context), response_ids=tuple(response))
    assert new.prompt_ids != old.prompt_ids and new.response_ids != old.response_ids
    perturbed = Episode(
        episode.episode_id,
        episode.uid,
        episode.prefix_ids,
        episode.invocations[:t] + (new,) + episode.invocations[t + 1 :],
    )

    def call_logits(name, impl, ep):
        layout = build_layout(name, [ep], VOCAB)
        with attention_implementation(model, impl):
            return forward_layout(model, layout)[layout.action_origin[:, 1] > t]

    packed = [call_logits("packed", hf_name("torch"), ep) for ep in (episode, perturbed)]
    flat = [call_logits("flat", "sdpa", ep) for ep in (episode, perturbed)]
    assert packed[0].shape[0] > 0
    assert (packed[0] - packed[1]).abs().max().item() <= 1e-6
    assert (flat[0] - flat[1]).abs().max().item() > 0.05


def test_random_episodes_carry_memory_into_the_next_call():
    for ep in random_episodes(10, VOCAB, 5, SHAPE):
        for prev, t in zip(ep.invocations, range(1, len(ep.invocations))):
            memory = prev.memory_ids
            assert ep.context_ids(t)[: len(memory)] == memory
            assert len(ep.context_ids(t)) > len(memory)  # plus a new chunk


def test_cli_prints_the_rce_line_and_exit_status(capsys, monkeypatch):
    assert rce_cli(["--episodes", "6", "--seed", "3"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.fullmatch(r"RCE episodes=6 max_abs_diff=(\S+) flat_max_abs_diff=(\S+)", last)
    assert m and float(m.group(1)) <= 1e-4 < float(m.group(2))
    monkeypatch.setitem(rce.TOLERANCES, torch.float32, rce.Tolerance(atol=1e-12, rtol=0.0))
    assert rce_cli(["--episodes", "6", "--seed", "3"]) == 1  # a diff above tolerance fails the audit


@torch.no_grad()
def test_reference_is_each_call_alone_from_its_record(model):
    """reference_logits == one plain forward per invocation of ``prompt_ids + response_ids`` (no padding, no
    batching, no packer), at the positions predicting its action tokens, in (episode, call, k) order."""
    episodes = random_episodes(4, VOCAB, 8, SHAPE)
    expected = []
    for ep in episodes:
        for inv in ep.invocations:
            ids = torch.tensor([list(inv.prompt_ids + inv.response_ids)])
            logits = model(input_ids=ids, use_cache=False).logits[0]
            expected += [logits[len(inv.prompt_ids) + k - 1] for k, m in enumerate(inv.action_mask) if m]
    ref = reference_logits(model, episodes, batch_calls=3)
    torch.testing.assert_close(ref, torch.stack(expected), atol=1e-5, rtol=1e-5)
    assert ref.shape[0] == build_layout("packed", episodes, VOCAB).action_index.numel()


def test_a_packer_fault_fails_the_offline_audit(model):
    """A packer that reverses one call block: the records-only reference does not share the bug."""
    episodes = random_episodes(6, VOCAB, 9, SHAPE)
    clean = rce_audit(model, episodes)
    faulty = rce_audit(model, episodes, pack=reversed_block_packer)
    assert clean.passed and not faulty.passed and faulty.max_abs_diff > 0.05, (clean, faulty)

    def drops_an_action(name, eps, vocab):  # action tokens missing from the packed layout: infinite difference
        return build_layout(name, eps[1:] if name == "packed" else eps, vocab)

    assert rce_audit(model, episodes, pack=drops_an_action).max_abs_diff == float("inf")


@pytest.fixture(scope="module")
def sharp():
    """The self-test's model: the tiny student with sharpened attention (``rce.SELF_TEST_QK_SCALE``)."""
    return rce.sharpen_attention(student_model(VOCAB), rce.SELF_TEST_QK_SCALE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_self_test_detects_every_fault_with_both_audits_and_leaves_no_backend_behind(sharp, dtype):
    model = copy.deepcopy(sharp).to(dtype)
    result = self_test(model, random_episodes(5, VOCAB, 10, SHAPE))
    assert result.ok, result.lines()
    assert set(result.faults) == set(rce.ROW_FAULTS) | set(rce.BACKEND_FAULTS) and len(result.faults) == 7
    for case in result.faults:  # every fault fails some call by a clear margin, in both audits
        assert result.offline[case].calls.worst_ratio > 3 and result.in_training[case].calls.worst_ratio > 3, case
    assert result.offline["clean"].calls.worst_ratio < 0.5 and result.in_training["clean"].calls.worst_ratio < 0.5
    if dtype == torch.bfloat16:  # the noise-floor rule ran: an fp32 reference, a positive floor
        assert result.offline["clean"].calls.noise_floor > 0 and result.in_training["clean"].calls.noise_floor > 0
    leftovers = [n for n in BACKENDS if n.startswith("selftest_")] + [
        n for n in AttentionInterface._global_mapping if "selftest_" in n
    ]
    assert not leftovers and not [n for n in HF_NAMES.values() if "selftest_" in n]
    name = str(dtype).replace("torch.", "")
    assert re.fullmatch(
        rf"RCE self-test dtype={name} faults=7 detected_offline=7 detected_in_training=7 "
        rf"clean_pass=1",
        result.lines()[-1],
    )
    assert model.get_input_embeddings().weight.dtype == dtype  # the fp32 reference put the weights back


def test_at_default_init_bf16_rounding_hides_the_position_fault_and_the_rule_says_so(model):
    """The tiny student at its default init has near-uniform attention: shifting positions moves its
    logits less than bf16 rounding does. The rule does not pretend otherwise (this is why the self-test
    sharpens attention); the same fault on the sharpened model is caught (test above)."""
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    episodes = random_episodes(5, VOCAB, 10, SHAPE)
    fault = rce_audit(bf16, episodes, pack=rce.faulty_packer(rce.ROW_FAULTS["positions_shifted_calls_ge_2"]))
    fp32_fault = rce_audit(model, episodes, pack=rce.faulty_packer(rce.ROW_FAULTS["positions_shifted_calls_ge_2"]))
    assert not fp32_fault.passed  # fp32 sees it
    assert fault.calls.noise_floor >= 0.5 * fp32_fault.max_abs_diff  # bf16's own error is of the fault's size


def test_cli_self_test_prints_the_contract_line(capsys, monkeypatch):
    assert rce_cli(["--self-test", "--episodes", "4", "--seed", "1"]) == 0
    assert (
        capsys.readouterr().out.strip().splitlines()[-1]
        == "RCE self-test dtype=float32 faults=7 detected_offline=7 detected_in_training=7 clean_pass=1"
    )
    monkeypatch.setitem(rce.TOLERANCES, torch.float32, rce.Tolerance(atol=1e-12, rtol=0.0))  # both audits too strict
    assert rce_cli(["--self-test", "--episodes", "4", "--seed", "1"]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("clean_pass=0")


def test_packer_faults_keep_the_rows_self_consistent():
    """The boundary fault changes which block a token belongs to, with positions to match: the layout checks
    (segment_meta with positions) accept it, so only an audit that does not trust the packer can see it."""
    episodes = random_episodes(6, VOCAB, 12, SHAPE)
    moved = 0
    for ep in episodes:
        row = pack_episode(ep)
        faulty = rce.ROW_FAULTS["segment_boundary_off_by_one"](row)
        assert faulty.prompt_ids + faulty.response_ids == row.prompt_ids + row.response_ids
        segment_meta(
            torch.tensor(faulty.segment_ids),
            torch.zeros(len(faulty.segment_ids), dtype=torch.long),
            torch.tensor(faulty.position_ids),
        )  # consistent: no LayoutError
        moved += sum(a != b for a, b in zip(row.segment_ids, faulty.segment_ids))
    assert moved > 0


def test_noise_floor_rule_is_k_times_the_floor_plus_eps_per_call():
    """per_call_stats: bf16 calls are judged on |packed - ref32| against 3 * |alone - ref32| + 4 ulps of the
    call's largest reference logit; fp32 calls on |packed - alone| against 1e-4 + 2^-15 of the call's largest
    logit; a bad call is infinite."""
    rule = audit.NOISE_FLOOR_RULES[torch.bfloat16]
    assert (rule.k, rule.eps_ulps, rule.unit) == (3.0, 4.0, 2.0**-8)
    ref = torch.tensor([[1.0, -2.0, 0.5], [0.25, 0.0, 4.0]])
    alone = ref + torch.tensor([[0.01, 0.0, 0.0], [0.0, 0.002, 0.0]])
    packed = ref + torch.tensor([[0.0, 0.02, 0.0], [0.0, 0.0, 0.05]])
    tokens = audit.token_stats(packed, alone, ref)
    stats, bound = audit.per_call_stats(
        tokens, torch.tensor([0, 1]), 3, torch.bfloat16, torch.tensor([False, False, True])
    )
    torch.testing.assert_close(bound[:2], torch.tensor([3 * 0.01 + 4 * 2**-8 * 2.0, 3 * 0.002 + 4 * 2**-8 * 4.0]))
    torch.testing.assert_close(stats[:2, 0], torch.tensor([0.02, 0.05]))  # audited: packed vs the fp32 reference
    torch.testing.assert_close(stats[:2, 2], torch.tensor([0.01, 0.002]))  # the noise floor
    assert stats[2, 0] == float("inf") and stats[2, 4] == 1.0  # bad call; no tokens: top-1 agreement 1
    summary = audit.summarize([stats], [bound])  # 0.02 <= 0.0613 and 0.05 <= 0.0685 pass; the bad call fails
    assert summary.failed == 1 and summary.calls == 3 and summary.worst_ratio == float("inf")
    tight = audit.per_call_stats(tokens, torch.tensor([0, 1]), 2, torch.bfloat16)[1] * 0.3
    assert audit.summarize([stats[:2]], [tight]).failed == 2
    fp32, tol = audit.per_call_stats(audit.token_stats(packed, alone, None), torch.tensor([0, 1]), 2, torch.float32)
    torch.testing.assert_close(tol, 1e-4 + 2**-15 * torch.tensor([2.01, 4.0]))  # max |alone| per call
    assert torch.isnan(fp32[:, 2]).all()
    torch.testing.assert_close(fp32[:, 0], torch.tensor([0.02, 0.05]))  # audited: packed vs alone


def test_kl_and_top1_are_the_distribution_level_figures():
    alone = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    packed = torch.tensor([[2.0, 0.0, -1.0], [1.5, 1.0, 0.0]])
    tokens = audit.token_stats(packed, alone, None)
    la, lp = torch.log_softmax(alone, -1), torch.log_softmax(packed, -1)
    torch.testing.assert_close(tokens[:, 3], (la.exp() * (la - lp)).sum(-1).clamp(min=0))
    assert tokens[:, 4].tolist() == [1.0, 0.0]
    stats, _ = audit.per_call_stats(tokens, torch.tensor([0, 0]), 1, torch.float32)
    assert stats[0, 4] == 0.5 and stats[0, 3] == tokens[1, 3]


def test_upcast_to_fp32_runs_fp32_and_restores_the_weights_bit_for_bit(model):
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    before = {n: p.clone() for n, p in bf16.named_parameters()}
    with audit.upcast_to_fp32(bf16) as upcast:
        assert upcast and all(p.dtype == torch.float32 for p in bf16.parameters())
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, before[n]) for n, p in bf16.named_parameters())
    wrapped = torch.nn.Module()
    wrapped._fsdp_wrapped_module = bf16  # an FSDP1 wrapper: sharded parameters are not upcast
    with audit.upcast_to_fp32(wrapped) as upcast:
        assert not upcast and next(bf16.parameters()).dtype == torch.bfloat16
