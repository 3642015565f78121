"""The memory agent with Hugging Face models (``experiment/hf_agent.py``): calls built as the training agent
loop builds them, the teacher taking over at call t, the held-out reverse KL, and KD rows."""

import subprocess
import sys

import pandas as pd
import pytest
import torch

from verl_memopd.agent.context import CallContext
from verl_memopd.experiment.hf_agent import agent_calls, handoff_f1, load_model, reverse_kl_on_calls, sft_rows
from verl_memopd.tasks.prompts import MemoryPrompts

TOKENS = {"memory_tokens": 16, "answer_tokens": 8}


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_agent_data")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "verl_memopd.tasks",
            "build",
            "--out",
            str(out),
            "--preset",
            "tiny",
            "--n-train",
            "4",
            "--n-val",
            "4",
            "--n-test",
            "4",
        ],
        check=True,
        capture_output=True,
    )
    frame = pd.read_parquet(out / "val.parquet")
    rows = [frame.iloc[i].to_dict() for i in range(len(frame))]
    return rows, load_model(tiny_models.student), load_model(tiny_models.teacher)


def test_calls_carry_the_exact_memory_ids_like_the_agent_loop(setup):
    rows, (student, tokenizer), _ = setup
    episodes = agent_calls(rows, [student], tokenizer, batch=3, **TOKENS)  # 4 rows in 2 batches
    assert [e.index for e in episodes] == [0, 1, 2, 3]
    stop = {tokenizer.eos_token_id}
    for row, episode in zip(rows, episodes):
        ctx = CallContext(tokenizer, list(row["prompt"]), MemoryPrompts())
        chunks = list(row["extra_info"]["chunks"])
        assert len(episode.calls) == len(chunks) + 1
        memory = ()
        for t, call in enumerate(episode.calls):
            want = ctx.prefix_ids + (
                ctx.memory_call(memory, chunks[t], t, len(chunks)) if t < len(chunks) else ctx.answer_call(memory)
            )
            assert call.prompt_ids == want, f"call {t}"
            assert (
                0 < len(call.response_ids) <= (TOKENS["memory_tokens"] if t < len(chunks) else TOKENS["answer_tokens"])
            )
            memory = call.response_ids[:-1] if call.response_ids[-1] in stop else call.response_ids
        assert 0.0 <= episode.f1 <= 1.0


def test_greedy_runs_repeat_and_seeded_samples_repeat(setup):
    rows, (student, tokenizer), _ = setup
    greedy = [agent_calls(rows, [student], tokenizer, **TOKENS) for _ in range(2)]
    assert greedy[0] == greedy[1]
    sampled = [agent_calls(rows, [student], tokenizer, sample=True, seed=7, **TOKENS) for _ in range(2)]
    assert sampled[0] == sampled[1] and sampled[0] != greedy[0]


def test_handoff_ends_are_each_model_alone(setup):
    rows, (student, tokenizer), (teacher, _) = setup
    f1 = handoff_f1(rows, student, teacher, tokenizer, **TOKENS)
    n = len(rows[0]["extra_info"]["chunks"]) + 1
    assert sorted(f1) == list(range(n + 1))
    alone = {
        name: sum(e.f1 for e in agent_calls(rows, [m], tokenizer, **TOKENS)) / len(rows)
        for name, m in (("student", student), ("teacher", teacher))
    }
    assert f1[0] == pytest.approx(alone["teacher"]) and f1[n] == pytest.approx(alone["student"])
    same = handoff_f1(rows, student, student, tokenizer, **TOKENS)
    assert len(set(same.values())) == 1  # the same model on both sides: the switch changes nothing


def test_heldout_reverse_kl_is_zero_against_itself_and_matches_a_direct_computation(setup):
    rows, (student, tokenizer), (teacher, _) = setup
    calls = [c for e in agent_calls(rows[:2], [student], tokenizer, sample=True, seed=3, **TOKENS) for c in e.calls]
    assert reverse_kl_on_calls(student, student, calls)[0] == pytest.approx(0.0, abs=1e-6)
    kl, by_call = reverse_kl_on_calls(student, teacher, calls, batch=3)
    total, count = 0.0, 0
    per_call: dict[int, list[float]] = {}
    with torch.no_grad():
        for c in calls:  # one call at a time, no padding
            ids = torch.tensor([c.prompt_ids + c.response_ids])
            s = torch.log_softmax(student(ids).logits[0], -1)
            t = torch.log_softmax(teacher(ids).logits[0], -1)
            lo = len(c.prompt_ids) - 1
            rng = slice(lo, lo + len(c.response_ids))
            call_kl = float((s[rng].exp() * (s[rng] - t[rng])).sum())
            total += call_kl
            count += len(c.response_ids)
            per_call.setdefault(c.call, [0.0, 0])
            per_call[c.call][0] += call_kl
            per_call[c.call][1] += len(c.response_ids)
    assert kl > 0 and kl == pytest.approx(total / count, rel=1e-4)
    assert sorted(by_call) == sorted(per_call) and len(by_call) > 1
    for call, (call_total, call_count) in per_call.items():
        assert by_call[call] == pytest.approx(call_total / call_count, rel=1e-4)


def test_kd_rows_have_the_oracle_traces_shape(setup):
    rows, (_, tokenizer), (teacher, _) = setup
    episodes = agent_calls(rows, [teacher], tokenizer, **TOKENS)
    out = sft_rows(rows, episodes)
    assert len(out) == sum(len(e.calls) for e in episodes)
    first = out[0]["messages"]
    assert first[:-2] == [dict(m) for m in rows[0]["prompt"]]
    assert [m["role"] for m in first[-2:]] == ["user", "assistant"] and out[0]["call"] == 0
    assert first[-2]["content"].startswith(MemoryPrompts().memory_header)
