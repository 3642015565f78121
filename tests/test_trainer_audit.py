"""In-training audits (verl_memopd.trainer.audit) and the reward's clipped KL penalty (trainer.reward)."""

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

from verl_memopd.attention import BACKENDS, attention_implementation, hf_name, scoped_backend
from verl_memopd.packing import pack_episode
from verl_memopd.rce import EpisodeShape, random_episodes
from verl_memopd.segments import segment_meta
from verl_memopd.tiny import student_model
from verl_memopd.trainer.audit import (
    RCE_FIELD,
    RCE_TOLERANCE_FIELD,
    RceAuditError,
    alone_calls,
    rce_check,
    rce_metrics,
    rce_spot_check,
    stock_attention,
    teacher_layout_kl,
)
from verl_memopd.trainer.calls import calls_alone
from verl_memopd.trainer.config import AuditConfig, MemopdConfigError, from_config
from verl_memopd.trainer.engine import MemopdLMEngine
from verl_memopd.trainer.rows import SEGMENT_IDS
from verl_memopd.trainer.reward import clipped_kl_penalty, penalty_metrics

VOCAB = 256
SHAPE = EpisodeShape(prefix_len=(4, 16), chunk_len=(1, 8), response_len=(1, 8))
RECIPE = Path(__file__).resolve().parents[1] / "hydra_configs" / "recipe" / "memopd.yaml"


@pytest.fixture(scope="module")
def model():
    return student_model(VOCAB, attention="torch")


def _rows(n, seed, flat=False):
    """Packed rows of ``n`` random episodes as the engine sees them: (ids, positions, segments, response_mask)
    per row. ``flat``: the persistent-history layout of the same tokens (0..L-1, one causal segment)."""
    rows = []
    for ep in random_episodes(n, VOCAB, seed, SHAPE):
        row = pack_episode(ep)
        ids = torch.tensor(row.prompt_ids + row.response_ids)
        pos, seg = torch.tensor(row.position_ids), torch.tensor(row.segment_ids)
        rows.append((ids, torch.arange(ids.numel()) if flat else pos, seg, torch.tensor(row.response_mask)))
    return rows


@torch.no_grad()
def _stream_logits(model, rows, flat=False):
    """The engine's packed forward (remove-padding stream): logits (N, V) and each row's start."""
    ids, pos, seg = (torch.cat(x) for x in list(zip(*rows))[:3])
    lengths = torch.tensor([r[0].numel() for r in rows])
    rows_of = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    meta = segment_meta(torch.zeros_like(seg) if flat else seg, rows_of, pos)
    logits = model(input_ids=ids[None], position_ids=pos[None], memopd_segments=meta, use_cache=False).logits[0]
    return logits, torch.cumsum(lengths, 0) - lengths


def _spot_check(model, rows, logits, row_start, chunk=1024):
    ids, _, seg, rmask = (list(x) for x in zip(*rows))
    return rce_spot_check(model, model, logits, row_start, ids, seg, rmask, chunk=chunk)


@pytest.mark.parametrize("seed", [0, 1])
def test_rce_spot_check_passes_on_packed_rows(model, seed):
    rows = _rows(5, seed)
    diffs, tolerances = _spot_check(model, rows, *_stream_logits(model, rows))
    assert [d.numel() for d in diffs] == [int(r[2].max()) for r in rows]  # one figure per call
    assert all(torch.all(t == 1e-4) for t in tolerances)  # fp32: TOLERANCES' absolute 1e-4
    metrics = rce_metrics(diffs)
    assert metrics["memopd/audit/rce_max_abs_diff"] < 1e-5, metrics
    verdict = rce_check(diffs, tolerances, [f"r{i}" for i in range(5)], "raise")
    assert verdict["memopd/audit/rce_failed_calls"] == 0.0 and verdict["memopd/audit/rce_pass"] == 1.0
    assert verdict["memopd/audit/rce_max_diff_over_tolerance"] == pytest.approx(metrics["memopd/audit/rce_max_abs_diff"]
                                                                             / 1e-4)
    assert model.config._attn_implementation == hf_name("torch")  # the alone pass put it back


def test_alone_calls_are_q_then_the_block_at_positions_from_zero():
    ids = torch.tensor([5, 6, 7, 10, 11, 12, 20, 21, 22, 23])
    seg = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
    rmask = torch.tensor([0, 1, 1, 0, 0, 1, 1])  # response = the blocks; actions 11, 12 | 22, 23
    calls = alone_calls([ids], [seg], [rmask])
    assert calls.input_ids.tolist() == [[5, 6, 7, 10, 11, 12, 5], [5, 6, 7, 20, 21, 22, 23]]  # right-padded
    assert calls.position_ids.tolist() == [list(range(7))] * 2
    assert calls.calls == ((0, 0), (0, 1))
    # action 11 (alone index 4) is predicted at alone position 3 of row 0 = flat 3, packed position 3
    assert calls.alone_index.tolist() == [3, 4, 7 + 4, 7 + 5]
    assert calls.packed_pos.tolist() == [3, 4, 7, 8] and calls.call.tolist() == [0, 0, 1, 1]


def test_rce_spot_check_runs_its_alone_pass_under_stock_attention_only(model):
    """The alone pass must not go through the memopd backend it audits (a spy backend counts its calls),
    and forms logits only at action tokens, ``chunk`` rows at a time (no (N, V) buffer)."""
    rows = _rows(4, 6)
    counted = {"calls": 0}

    def spy(q, k, v, meta, scale, dropout):
        counted["calls"] += 1
        return BACKENDS["torch"](q, k, v, meta, scale, dropout)

    with scoped_backend("test_spy", spy) as name:
        with attention_implementation(model, name):
            logits, row_start = _stream_logits(model, rows)
            packed_calls = counted["calls"]
            head = model.get_output_embeddings()
            shapes = []
            head.forward = lambda h, f=head.forward: shapes.append(tuple(h.shape)) or f(h)
            try:
                diffs, _ = _spot_check(model, rows, logits, row_start, chunk=7)
            finally:
                del head.forward
    assert packed_calls > 0 and counted["calls"] == packed_calls  # no memopd attention in the alone pass
    assert "test_spy" not in BACKENDS and stock_attention(torch.device("cpu")) == "sdpa"
    actions = sum(int(r[3].sum()) for r in rows)
    chunks = [s[0] for s in shapes if len(s) == 2]  # (chunk, H) hidden states -> (chunk, V) logits
    assert max(chunks) == 7 and sum(chunks) == actions
    assert [s[1] for s in shapes if len(s) == 3] == [1, 0]  # dtype probe (1, 1, H); the head itself: (S, 0, H)
    assert torch.cat(diffs).max() < 1e-5


def test_rce_spot_check_catches_a_backend_fault(model, caplog):
    """A softmax-scale bug in the packed attention backend: the spot-check names the rows and calls."""
    rows = _rows(5, 7)

    def scale_bug(q, k, v, meta, scale, dropout):
        return BACKENDS["torch"](q, k, v, meta, 1.1 * scale, dropout)

    with scoped_backend("test_scale_bug", scale_bug) as name, attention_implementation(model, name):
        diffs, tolerances = _spot_check(model, rows, *_stream_logits(model, rows))
    names = [f"uid{i}_0_0" for i in range(5)]
    failed = [(i, t) for i, (d, tol) in enumerate(zip(diffs, tolerances)) for t in range(d.numel()) if d[t] > tol[t]]
    assert len(failed) == sum(d.numel() for d in diffs)  # every call sees the faulty attention
    with pytest.raises(RceAuditError, match=r"row uid\d_0_0 call \d: max \|logit_packed - logit_alone\| = \S+ > "
                                            r"tolerance 1\.000e-04"):
        rce_check(diffs, tolerances, names, "raise")
    with caplog.at_level(logging.WARNING, logger="verl_memopd.trainer.audit"):
        metrics = rce_check(diffs, tolerances, names, "warn")
    assert metrics["memopd/audit/rce_failed_calls"] == float(len(failed)) and metrics["memopd/audit/rce_pass"] == 0.0
    assert metrics["memopd/audit/rce_max_diff_over_tolerance"] > 1
    assert "RCE spot-check failed" in caplog.text


def test_rce_spot_check_sees_the_flat_layout_misalignment(model):
    rows = _rows(5, 2)
    diffs, tolerances = _spot_check(model, rows, *_stream_logits(model, _rows(5, 2, flat=True), flat=True))
    later_calls = torch.cat([d[1:] for d in diffs])  # call 0 sees the same tokens in both layouts
    assert later_calls.numel() > 0 and later_calls.max() > 0.05
    assert torch.cat([d[:1] for d in diffs]).max() < 1e-4
    assert rce_check(diffs, tolerances, [str(i) for i in range(5)], "warn")["memopd/audit/rce_pass"] == 0.0


@torch.no_grad()
def test_rce_spot_check_reads_verls_padded_micro_batch_in_place(model):
    """verl's padded path: logits (B, L, V), row b starting at b * L of the flattened view."""
    rows = _rows(3, 3)
    logits, _ = _stream_logits(model, rows)
    width = max(r[0].numel() for r in rows)
    padded = torch.full((len(rows), width, VOCAB), float("nan"))
    for b, chunk in enumerate(logits.split([r[0].numel() for r in rows])):
        padded[b, : chunk.shape[0]] = chunk
    diffs, _ = _spot_check(model, rows, padded.flatten(0, 1), torch.arange(len(rows)) * width)
    assert torch.cat(diffs).max() < 1e-5  # NaN padding is never read


@pytest.mark.parametrize("use_rmpad", [True, False])
@torch.no_grad()
def test_engine_spot_check_catches_a_backend_fault_on_both_verl_paths(model, use_rmpad):
    """``MemopdLMEngine._rce_spot_check`` on a verl micro-batch (jagged rows + a verl padding row), packed logits
    from the remove-padding stream (1, N, V) or the padded batch (B, L, V): clean passes, a scale bug fails."""
    rows = _rows(3, 11) + [(torch.arange(7), torch.arange(7), torch.zeros(7, dtype=torch.long),
                            torch.ones(3, dtype=torch.long))]
    nested = lambda i: torch.nested.as_nested_tensor([r[i] for r in rows], layout=torch.jagged)  # noqa: E731
    micro_batch = TensorDict({"input_ids": nested(0), "position_ids": nested(1), SEGMENT_IDS: nested(2),
                              "response_mask": nested(3)}, batch_size=[len(rows)])
    engine = SimpleNamespace(module=model)  # the method reads only self.module (FSDP2: the HF model itself)

    def scale_bug(q, k, v, meta, scale, dropout):
        return BACKENDS["torch"](q, k, v, meta, 1.1 * scale, dropout)

    failed = {}
    for case, fn in (("clean", BACKENDS["torch"]), ("fault", scale_bug)):
        with scoped_backend("test_engine_" + case, fn) as name, attention_implementation(model, name):
            logits, _ = _stream_logits(model, rows)
        if use_rmpad:
            logits = logits[None]
        else:  # verl's padded micro-batch: (B, L, V), right-padded
            width = max(r[0].numel() for r in rows)
            padded = torch.full((len(rows), width, VOCAB), float("nan"))
            for b, part in enumerate(logits.split([r[0].numel() for r in rows])):
                padded[b, : part.shape[0]] = part
            logits = padded
        out = MemopdLMEngine._rce_spot_check(engine, logits, micro_batch, use_rmpad)
        diffs, tolerances = out[RCE_FIELD].unbind(), out[RCE_TOLERANCE_FIELD].unbind()
        assert [d.numel() for d in diffs] == [int(r[2].max()) for r in rows]  # the padding row: no calls
        failed[case] = rce_check(diffs, tolerances, [str(b) for b in range(len(rows))], "warn")
    assert failed["clean"]["memopd/audit/rce_pass"] == 1.0
    assert failed["fault"]["memopd/audit/rce_failed_calls"] == sum(int(r[2].max()) for r in rows)


def test_a_micro_batch_without_calls_still_makes_one_forward(model):
    """Data-parallel ranks stay in step: a micro-batch of verl padding rows runs one (tiny) alone forward."""
    ids = torch.arange(6)
    forwards = []
    handle = model.register_forward_pre_hook(lambda m, a, k: forwards.append(1), with_kwargs=True)
    try:
        diffs, tolerances = rce_spot_check(model, model, torch.zeros(6, VOCAB), torch.tensor([0]), [ids],
                                           [torch.zeros(6, dtype=torch.long)], [torch.ones(3, dtype=torch.long)])
    finally:
        handle.remove()
    assert len(forwards) == 1 and diffs[0].numel() == 0 and tolerances[0].numel() == 0
    assert rce_metrics(diffs) == {}


def test_on_failure_is_validated_and_defaults_to_raise():
    assert AuditConfig().on_failure == "raise"
    assert OmegaConf.load(RECIPE).memopd.audit.on_failure == "raise"
    cfg = OmegaConf.create({"memopd": {"distill": {"coef": 0}, "audit": {"on_failure": "ignore"}}})
    with pytest.raises(MemopdConfigError, match="memopd.audit.on_failure='ignore': expected one of"):
        from_config(cfg)
    cfg.memopd.audit.on_failure = "warn"
    assert from_config(cfg).audit.on_failure == "warn"


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


@torch.no_grad()
def test_per_call_execution_reads_back_the_packed_order(model):
    """memopd.layout=per_call: every call run alone, outputs gathered back to the packed stream, equal
    to the packed forward (RCE) -- the same numbers at the cost of repeating q per call."""
    padding = (torch.arange(7), torch.arange(7), torch.zeros(7, dtype=torch.long), torch.ones(3))  # a verl padding row
    rows = _rows(4, 5) + [padding]
    inputs, _, index = calls_alone(*(list(x) for x in list(zip(*rows))[:3]))
    n = sum(r[0].numel() for r in rows)
    assert index.shape == (n,) and inputs["input_ids"].shape[1] > n  # q is repeated per call
    torch.testing.assert_close(inputs["input_ids"][0, index], torch.cat([r[0] for r in rows]))
    alone = model(**inputs, use_cache=False).logits[:, index][0]
    torch.testing.assert_close(alone, _stream_logits(model, rows)[0], atol=1e-4, rtol=1e-4)
