"""RCE: packed == independent per-call forwards (logits and gradients); no leakage; flat deviates."""

import dataclasses
import re

import pytest
import torch
from transformers import Qwen2ForCausalLM

from verl_memopd import rce
from verl_memopd.attention import attention_implementation, forward_layout, hf_name
from verl_memopd.packing import build_layout
from verl_memopd.rce import EpisodeShape, random_episodes, rce_audit
from verl_memopd.records import Episode
from verl_memopd.tiny import student_config

VOCAB = 256
SHAPE = EpisodeShape(prefix_len=(4, 24), chunk_len=(1, 12), response_len=(1, 10))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(student_config(vocab_size=VOCAB)).eval()


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
