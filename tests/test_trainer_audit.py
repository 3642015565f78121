"""In-training audits (verl_memopd.trainer.audit) and the reward's clipped KL penalty (trainer.reward)."""

import pytest
import torch
from transformers import Qwen2ForCausalLM

from verl_memopd.attention import attention_implementation, hf_name
from verl_memopd.packing import pack_episode
from verl_memopd.rce import EpisodeShape, random_episodes
from verl_memopd.segments import segment_meta
from verl_memopd.tiny import student_config
from verl_memopd.trainer.audit import rce_diffs, rce_metrics, teacher_layout_kl
from verl_memopd.trainer.calls import calls_alone
from verl_memopd.trainer.reward import clipped_kl_penalty, penalty_metrics

VOCAB = 256
SHAPE = EpisodeShape(prefix_len=(4, 16), chunk_len=(1, 8), response_len=(1, 8))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = Qwen2ForCausalLM(student_config(vocab_size=VOCAB)).eval()
    m.set_attn_implementation(hf_name("torch"))
    return m


def _rows(n, seed, flat=False):
    """Packed rows of ``n`` random episodes as the engine sees them: (ids, positions, segments) per row.
    ``flat``: the persistent-history layout of the same tokens (0..L-1, one causal segment)."""
    rows = []
    for ep in random_episodes(n, VOCAB, seed, SHAPE):
        row = pack_episode(ep)
        ids = torch.tensor(row.prompt_ids + row.response_ids)
        pos, seg = torch.tensor(row.position_ids), torch.tensor(row.segment_ids)
        rows.append((ids, torch.arange(ids.numel()) if flat else pos, seg))
    return rows


@torch.no_grad()
def _stream_logits(model, rows, flat=False):
    """The engine's packed forward (remove-padding stream) -> per-row logits (L_b, V)."""
    ids, pos, seg = (torch.cat(x) for x in zip(*rows))
    row_ids = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([r[0].numel() for r in rows]))
    meta = segment_meta(torch.zeros_like(seg) if flat else seg, row_ids, pos)
    logits = model(input_ids=ids[None], position_ids=pos[None], memopd_segments=meta, use_cache=False).logits[0]
    return list(logits.split([r[0].numel() for r in rows]))


@torch.no_grad()
def _audit(model, rows, packed_logits):
    inputs, spans, _ = calls_alone(*(list(x) for x in zip(*rows)))
    alone = model(**inputs, attention_mask=None, use_cache=False).logits[0]
    return rce_diffs(packed_logits, alone, spans), spans


@pytest.mark.parametrize("seed", [0, 1])
def test_rce_spot_check_passes_on_packed_rows(model, seed):
    rows = _rows(5, seed)
    diffs, spans = _audit(model, rows, _stream_logits(model, rows))
    assert [d.numel() for d in diffs] == [int(r[2].max()) for r in rows]  # one figure per call
    metrics = rce_metrics(diffs)
    assert metrics["memopd/audit/rce_max_abs_diff"] < 1e-4, metrics
    assert metrics["memopd/audit/rce_calls_checked"] == sum(d.numel() for d in diffs)
    # each span is call t's block alone: q then the block, block at the end
    ids, _, seg = rows[0]
    block, start, end = spans[0][-1]
    assert end - start == block.numel() and block.max() == ids.numel() - 1


def test_rce_spot_check_sees_the_flat_layout_misalignment(model):
    rows = _rows(5, 2)
    flat_rows = _rows(5, 2, flat=True)
    diffs, _ = _audit(model, rows, _stream_logits(model, flat_rows, flat=True))
    later_calls = torch.cat([d[1:] for d in diffs])  # call 0 sees the same tokens in both layouts
    assert later_calls.numel() > 0 and later_calls.max() > 0.05
    assert torch.cat([d[:1] for d in diffs]).max() < 1e-4


def test_rce_spot_check_agrees_with_the_sdpa_reference(model):
    rows = _rows(3, 3)
    inputs, spans, _ = calls_alone(*(list(x) for x in zip(*rows)))
    packed = _stream_logits(model, rows)
    with torch.no_grad(), attention_implementation(model, "sdpa"):
        for (ids, pos, seg), row_spans, logits in zip(rows, spans, packed):
            for t, (block, _, _) in enumerate(row_spans):
                keep = (seg == 0) | (seg == t + 1)
                ref = model(input_ids=ids[keep][None], position_ids=pos[keep][None], use_cache=False).logits[0]
                torch.testing.assert_close(logits[block], ref[-block.numel():], atol=1e-4, rtol=1e-4)


def test_teacher_layout_kl_is_exact_and_zero_on_equal_states():
    torch.manual_seed(0)
    head, a, f = torch.randn(50, 8), torch.randn(7, 8), torch.randn(7, 8)
    assert torch.allclose(teacher_layout_kl(head, a, a), torch.zeros(7), atol=1e-6)
    la, lf = torch.log_softmax(a @ head.T, -1), torch.log_softmax(f @ head.T, -1)
    expected = (la.exp() * (la - lf)).sum(-1)
    torch.testing.assert_close(teacher_layout_kl(head, a, f, chunk=3), expected)
    with pytest.raises(ValueError, match="aligned .* and flat"):
        teacher_layout_kl(head, a, f[:5])


def test_clipped_kl_penalty_only_charges_drift_above_the_reference():
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    penalty = clipped_kl_penalty(old, ref, mask, coef=0.1)
    torch.testing.assert_close(penalty, torch.tensor([[0.05, 0.0, 0.0, 0.0]]))
    metrics = penalty_metrics(old, ref, mask, penalty)
    assert metrics["memopd/reward_kl/clipped_fraction"] == pytest.approx(2 / 3)
    assert metrics["memopd/reward_kl/clipped_kl_mean"] == pytest.approx(0.5 / 3)
    assert metrics["memopd/reward_kl/penalty_per_episode"] == pytest.approx(0.05)
    with pytest.raises(ValueError, match="ref_log_prob"):
        clipped_kl_penalty(old, ref[:, :3], mask, 0.1)


def test_rows_without_call_blocks_run_as_themselves():
    ids = torch.arange(6)
    inputs, spans, index = calls_alone([ids], [ids], [torch.zeros(6, dtype=torch.long)])  # a verl padding row
    assert spans == [[]] and inputs["input_ids"].tolist() == [ids.tolist()] and index.tolist() == list(range(6))
    assert rce_metrics([torch.zeros(0)]) == {}


@torch.no_grad()
def test_per_call_execution_reads_back_the_packed_order(model):
    """memopd.layout=per_call: every call run alone, outputs gathered back to the packed stream, equal
    to the packed forward (RCE) -- the same numbers at the cost of repeating q per call."""
    rows = _rows(4, 5) + [(torch.arange(7), torch.arange(7), torch.zeros(7, dtype=torch.long))]  # + a padding row
    inputs, _, index = calls_alone(*(list(x) for x in zip(*rows)))
    n = sum(r[0].numel() for r in rows)
    assert index.shape == (n,) and inputs["input_ids"].shape[1] > n  # q is repeated per call
    torch.testing.assert_close(inputs["input_ids"][0, index], torch.cat([r[0] for r in rows]))
    alone = model(**inputs, use_cache=False).logits[:, index][0]
    torch.testing.assert_close(alone, torch.cat(_stream_logits(model, rows)), atol=1e-4, rtol=1e-4)
