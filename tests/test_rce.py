"""RCE: packed == independent per-call forwards (logits and gradients); no leakage; flat deviates."""

import dataclasses
import re

import pytest
import torch
from transformers import AttentionInterface

from verl_memopd import rce
from verl_memopd.attention import BACKENDS, HF_NAMES, attention_implementation, forward_layout, hf_name
from verl_memopd.packing import build_layout
from verl_memopd.rce import EpisodeShape, random_episodes, rce_audit, reference_logits, reversed_block_packer, self_test
from verl_memopd.records import Episode
from verl_memopd.tiny import student_model

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
    weights = torch.rand(build_layout("per_call", episodes).action_index.numel(),
                         generator=torch.Generator().manual_seed(seed))
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
    perturbed = Episode(episode.episode_id, episode.uid, episode.prefix_ids,
                        episode.invocations[:t] + (new,) + episode.invocations[t + 1:])

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
    assert rce.main(["--episodes", "6", "--seed", "3"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.fullmatch(r"RCE episodes=6 max_abs_diff=(\S+) flat_max_abs_diff=(\S+)", last)
    assert m and float(m.group(1)) <= 1e-4 < float(m.group(2))
    monkeypatch.setitem(rce.TOLERANCES, torch.float32, rce.Tolerance(atol=1e-12, rtol=0.0))
    assert rce.main(["--episodes", "6", "--seed", "3"]) == 1  # a diff above tolerance fails the audit


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


def test_self_test_catches_both_faults_and_leaves_no_backend_behind(model):
    result = self_test(model, random_episodes(6, VOCAB, 10, SHAPE))
    assert result.packer_fault_detected and result.backend_fault_detected and result.clean_pass, result.lines()
    assert result.spot_check["backend_fault"][0] > 0 and result.spot_check["clean"][2] < 1e-5
    assert "selftest_scale_fault" not in BACKENDS and "memopd_selftest_scale_fault" not in HF_NAMES.values()
    assert "memopd_selftest_scale_fault" not in AttentionInterface._global_mapping
    assert re.fullmatch(r"RCE self-test packer_fault_detected=1 backend_fault_detected=1 clean_pass=1",
                        result.lines()[-1])


def test_cli_self_test_prints_the_contract_line(capsys, monkeypatch):
    assert rce.main(["--self-test", "--episodes", "4", "--seed", "1"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == \
        "RCE self-test packer_fault_detected=1 backend_fault_detected=1 clean_pass=1"
    monkeypatch.setitem(rce.TOLERANCES, torch.float32, rce.Tolerance(atol=1e-12, rtol=0.0))  # both audits too strict
    assert rce.main(["--self-test", "--episodes", "4", "--seed", "1"]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("clean_pass=0")
