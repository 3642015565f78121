"""In-training audits (verl_memopd.trainer.audit) and the reward's clipped KL penalty (trainer.reward)."""

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

from verl_memopd.attention import BACKENDS, attention_implementation, hf_name, scoped_backend
from verl_memopd.audit import CallRecord, encode_records, rce_spot_check, record_calls, records_of_episode
from verl_memopd.bench.tiny import student_model
from verl_memopd.fields import RCE_FIELD, RCE_TOLERANCE_FIELD, RECORD_FIELDS, SEGMENT_IDS
from verl_memopd.packing import pack_episode
from verl_memopd.rce import ROW_FAULTS, EpisodeShape, random_episodes, spot_check_rows
from verl_memopd.segments import segment_meta
from verl_memopd.streams import calls_alone
from verl_memopd.trainer.audit import (
    RceAuditError,
    micro_batch_records,
    rce_check,
    rce_metrics,
    record_fields,
    stock_attention,
    teacher_layout_kl,
)
from verl_memopd.trainer.config import AuditConfig, MemopdConfigError, from_config
from verl_memopd.trainer.engine import MemopdLMEngine
from verl_memopd.trainer.reward import clipped_kl_penalty, penalty_metrics

VOCAB = 256
SHAPE = EpisodeShape(prefix_len=(4, 16), chunk_len=(1, 8), response_len=(1, 8))
RECIPE = Path(__file__).resolve().parents[1] / "hydra_configs" / "recipe" / "memopd.yaml"


@pytest.fixture(scope="module")
def model():
    return student_model(VOCAB, attention="torch")


def _rows(n, seed, flat=False):
    """Packed rows of ``n`` random episodes as the engine sees them: (ids, positions, segments, response_mask,
    records) per row. ``flat``: the persistent-history layout of the same tokens (0..L-1, one causal segment)."""
    rows = []
    for ep in random_episodes(n, VOCAB, seed, SHAPE):
        row = pack_episode(ep)
        ids = torch.tensor(row.prompt_ids + row.response_ids)
        pos, seg = torch.tensor(row.position_ids), torch.tensor(row.segment_ids)
        rows.append(
            (
                ids,
                torch.arange(ids.numel()) if flat else pos,
                seg,
                torch.tensor(row.response_mask),
                records_of_episode(ep.invocations),
            )
        )
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
    ids, _, _, rmask, records = (list(x) for x in zip(*rows))
    stats, bounds, _ = rce_spot_check(model, model, logits, row_start, ids, rmask, records, chunk=chunk)
    return stats, bounds


@pytest.mark.parametrize("seed", [0, 1])
def test_rce_spot_check_passes_on_packed_rows(model, seed):
    rows = _rows(5, seed)
    stats, bounds = _spot_check(model, rows, *_stream_logits(model, rows))
    assert [d.shape for d in stats] == [(len(r[4]), 5) for r in rows]  # one line of figures per recorded call
    assert all(torch.all((t > 1e-4) & (t < 1e-4 + 2**-15 * 50)) for t in bounds)  # fp32: 1e-4 + 2^-15 max|l|
    metrics = rce_metrics(stats)
    assert metrics["memopd/audit/rce_max_abs_diff"] < 1e-5 and metrics["memopd/audit/rce_max_kl"] < 1e-6, metrics
    assert metrics["memopd/audit/rce_min_top1_agreement"] == 1.0 and "memopd/audit/rce_noise_floor" not in metrics
    verdict = rce_check(stats, bounds, [f"r{i}" for i in range(5)], "raise")
    assert verdict["memopd/audit/rce_failed_calls"] == 0.0 and verdict["memopd/audit/rce_pass"] == 1.0
    assert verdict["memopd/audit/rce_max_diff_over_tolerance"] < metrics["memopd/audit/rce_max_abs_diff"] / 1e-4
    assert model.config._attn_implementation == hf_name("torch")  # the alone pass put it back


def test_record_calls_rebuild_each_call_from_its_record_not_from_the_row():
    """q=[5,6,7]; call 0 = [5,6,7,10 | 11,12], call 1 = [5,6,7,20 | 21,22,23] (22 forced). The packed row's
    segment ids and positions are never read: only its tokens and verl's response mask."""
    ids = torch.tensor([5, 6, 7, 10, 11, 12, 20, 21, 22, 23])
    rmask = torch.tensor([0, 1, 1, 0, 1, 0, 1])  # response = the blocks; actions 11, 12 | 21, 23
    recs = [
        CallRecord(torch.tensor([5, 6, 7, 10, 11, 12]), torch.tensor([0, 0, 0, 0, 1, 1]).bool()),
        CallRecord(torch.tensor([5, 6, 7, 20, 21, 22, 23]), torch.tensor([0, 0, 0, 0, 1, 0, 1]).bool()),
    ]
    calls = record_calls([recs], [ids], [rmask])
    assert calls.input_ids.tolist() == [[5, 6, 7, 10, 11, 12, 5], [5, 6, 7, 20, 21, 22, 23]]  # right-padded
    assert calls.position_ids.tolist() == [list(range(7))] * 2
    assert calls.calls == ((0, 0), (0, 1)) and not calls.bad.any()
    assert calls.alone_index.tolist() == [3, 4, 7 + 3, 7 + 5]  # action 11 predicted at alone position 3, ...
    assert calls.packed_pos.tolist() == [3, 4, 6, 8] and calls.call.tolist() == [0, 0, 1, 1]
    swapped = ids.clone()
    swapped[[7, 9]] = swapped[[9, 7]]  # the row's call 1 actions in the wrong order: ids differ from the record
    bad = record_calls([recs], [swapped], [rmask])
    assert bad.bad.tolist() == [False, True] and "row 0 call 1" in bad.problems[0]
    short = record_calls([recs], [ids], [torch.tensor([0, 1, 1, 0, 1, 0, 0])])  # the row lost an action token
    assert short.bad.tolist() == [True, True]
    assert "4 recorded action tokens, the packed row has 3" in short.problems[0]


@pytest.mark.parametrize("fault", ["segment_boundary_off_by_one", "reversed_call_block"])
def test_a_self_consistent_packer_fault_fails_the_in_training_check(model, fault):
    """Rows whose ids, segments and positions agree with each other (an alone pass built from the rows would
    reproduce the fault and pass) fail, because the alone pass comes from the records."""
    episodes = random_episodes(5, VOCAB, 21, SHAPE)
    clean = spot_check_rows(model, episodes, "torch")
    faulty = spot_check_rows(model, episodes, "torch", ROW_FAULTS[fault])
    assert clean.passed and clean.calls.max_abs_diff < 1e-5
    assert not faulty.passed and faulty.calls.worst_ratio > 100, faulty


def test_bf16_in_training_check_uses_the_noise_floor_rule(model):
    """A bf16 model: the alone pass also runs upcast to fp32; clean calls sit well inside k * floor + eps,
    a softmax-scale bug on sharpened attention does not."""
    from verl_memopd.rce import SELF_TEST_QK_SCALE, sharpen_attention

    bf16 = sharpen_attention(student_model(VOCAB), SELF_TEST_QK_SCALE).to(torch.bfloat16)
    episodes = random_episodes(4, VOCAB, 22, SHAPE)
    clean = spot_check_rows(bf16, episodes, "torch")
    assert clean.passed and clean.calls.noise_floor > 0 and clean.calls.worst_ratio < 0.6, clean

    def scale_bug(q, k, v, meta, scale, dropout):
        return BACKENDS["torch"](q, k, v, meta, 1.5 * scale, dropout)

    with scoped_backend("test_bf16_scale_bug", scale_bug) as _:
        faulty = spot_check_rows(bf16, episodes, "test_bf16_scale_bug")
    assert not faulty.passed and faulty.calls.worst_ratio > 3
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())


def test_without_an_fp32_reference_the_bf16_check_falls_back_and_says_why(monkeypatch, caplog):
    """A model the reference cannot be built for (e.g. a wrapper that is not a Hugging Face model under FSDP):
    the check still runs, on the relative fallback bound (no noise floor), and the warning names the reason."""
    from contextlib import contextmanager

    from verl_memopd import audit
    from verl_memopd.fp32_reference import Fp32ReferenceError

    @contextmanager
    def no_replica(*args):
        raise Fp32ReferenceError("fp32 reference: PeftModel is not a Hugging Face model")
        yield

    monkeypatch.setattr(audit, "fp32_replica", no_replica)
    monkeypatch.setattr(audit, "_warned_fallback", False)
    bf16 = student_model(VOCAB).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="verl_memopd.audit"):
        report = spot_check_rows(bf16, random_episodes(2, VOCAB, 23, SHAPE), "torch")
    assert report.passed and report.calls.noise_floor != report.calls.noise_floor  # NaN: the fallback bound
    assert "PeftModel is not a Hugging Face model" in caplog.text and "fallback bound" in caplog.text


def test_the_fp32_reference_pass_runs_sdpa_whatever_the_stock_attention(monkeypatch):
    """On CUDA with flash-attn the stock attention is flash_attention_2, which has no fp32: the low-precision
    alone pass uses it, the fp32 reference pass sdpa (a spy stands in for the stock attention here)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from verl_memopd import audit

    seen = []

    def spy(module, query, *args, **kwargs):
        seen.append(query.dtype)
        return sdpa_attention_forward(module, query, *args, **kwargs)

    AttentionInterface.register("test_stock_spy", spy)
    monkeypatch.setattr(audit, "stock_attention", lambda device: "test_stock_spy")
    bf16 = student_model(VOCAB).to(torch.bfloat16)
    report = spot_check_rows(bf16, random_episodes(2, VOCAB, 24, SHAPE), "torch")
    assert report.passed and report.calls.noise_floor > 0  # the reference ran
    assert seen and set(seen) == {torch.bfloat16}  # ... but not through the stock (spy) attention


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
                stats, _ = _spot_check(model, rows, logits, row_start, chunk=7)
            finally:
                del head.forward
    assert packed_calls > 0 and counted["calls"] == packed_calls  # no memopd attention in the alone pass
    assert "test_spy" not in BACKENDS and stock_attention(torch.device("cpu")) == "sdpa"
    actions = sum(int(r[3].sum()) for r in rows)
    chunks = [s[0] for s in shapes if len(s) == 2]  # (chunk, H) hidden states -> (chunk, V) logits
    assert max(chunks) == 7 and sum(chunks) == actions
    assert [s[1] for s in shapes if len(s) == 3] == [1, 0]  # dtype probe (1, 1, H); the head itself: (S, 0, H)
    assert torch.cat(stats)[:, 1].max() < 1e-5


def test_rce_spot_check_catches_a_backend_fault(model, caplog):
    """A softmax-scale bug in the packed attention backend: the check names the rows and calls."""
    rows = _rows(5, 7)

    def scale_bug(q, k, v, meta, scale, dropout):
        return BACKENDS["torch"](q, k, v, meta, 1.1 * scale, dropout)

    with scoped_backend("test_scale_bug", scale_bug) as name, attention_implementation(model, name):
        stats, bounds = _spot_check(model, rows, *_stream_logits(model, rows))
    names = [f"uid{i}_0_0" for i in range(5)]
    failed = [(i, t) for i, (d, tol) in enumerate(zip(stats, bounds)) for t in range(d.shape[0]) if d[t, 0] > tol[t]]
    assert len(failed) == sum(d.shape[0] for d in stats)  # every call sees the faulty attention
    with pytest.raises(RceAuditError, match=r"row uid\d_0_0 call \d: difference \S+ > bound 1\.\d+e-04"):
        rce_check(stats, bounds, names, "raise")
    with caplog.at_level(logging.WARNING, logger="verl_memopd.trainer.audit"):
        metrics = rce_check(stats, bounds, names, "warn")
    assert metrics["memopd/audit/rce_failed_calls"] == float(len(failed)) and metrics["memopd/audit/rce_pass"] == 0.0
    assert metrics["memopd/audit/rce_max_diff_over_tolerance"] > 1
    assert "RCE check failed" in caplog.text


def test_rce_spot_check_sees_the_flat_layout_misalignment(model):
    rows = _rows(5, 2)
    stats, bounds = _spot_check(model, rows, *_stream_logits(model, _rows(5, 2, flat=True), flat=True))
    later_calls = torch.cat([d[1:, 1] for d in stats])  # call 0 sees the same tokens in both layouts
    assert later_calls.numel() > 0 and later_calls.max() > 0.05
    assert torch.cat([d[:1, 1] for d in stats]).max() < 1e-4
    assert rce_check(stats, bounds, [str(i) for i in range(5)], "warn")["memopd/audit/rce_pass"] == 0.0


@torch.no_grad()
def test_rce_spot_check_reads_verls_padded_micro_batch_in_place(model):
    """verl's padded path: logits (B, L, V), row b starting at b * L of the flattened view."""
    rows = _rows(3, 3)
    logits, _ = _stream_logits(model, rows)
    width = max(r[0].numel() for r in rows)
    padded = torch.full((len(rows), width, VOCAB), float("nan"))
    for b, chunk in enumerate(logits.split([r[0].numel() for r in rows])):
        padded[b, : chunk.shape[0]] = chunk
    stats, _ = _spot_check(model, rows, padded.flatten(0, 1), torch.arange(len(rows)) * width)
    assert torch.cat(stats)[:, 1].max() < 1e-5  # NaN padding is never read


def _micro_batch(rows):
    nested = lambda i: torch.nested.as_nested_tensor([r[i] for r in rows], layout=torch.jagged)  # noqa: E731
    fields = {"input_ids": nested(0), "position_ids": nested(1), SEGMENT_IDS: nested(2), "response_mask": nested(3)}
    enc = [encode_records(r[4]) for r in rows]
    for k, name in RECORD_FIELDS.items():
        fields[name] = torch.nested.as_nested_tensor([e[k] for e in enc], layout=torch.jagged)
    return TensorDict(fields, batch_size=[len(rows)])


@pytest.mark.parametrize("use_rmpad", [True, False])
@torch.no_grad()
def test_engine_spot_check_catches_a_backend_fault_on_both_verl_paths(model, use_rmpad):
    """``MemopdLMEngine._rce_spot_check`` on a verl micro-batch (jagged rows with their record fields + a verl
    padding row without calls), packed logits from the remove-padding stream (1, N, V) or the padded batch
    (B, L, V): clean passes, a scale bug fails."""
    rows = _rows(3, 11) + [
        (torch.arange(7), torch.arange(7), torch.zeros(7, dtype=torch.long), torch.ones(3, dtype=torch.long), [])
    ]
    micro_batch = _micro_batch(rows)
    engine = SimpleNamespace(module=model)  # the method reads only self.module (FSDP2: the HF model itself)

    def scale_bug(q, k, v, meta, scale, dropout):
        return BACKENDS["torch"](q, k, v, meta, 1.1 * scale, dropout)

    failed = {}
    for case, fn in (("clean", BACKENDS["torch"]), ("fault", scale_bug)):
        with scoped_backend("test_engine_" + case, fn) as name, attention_implementation(model, name):
            logits, _ = _stream_logits(model, rows[:3])
            logits = torch.cat([logits, torch.zeros(7, VOCAB)])  # the padding row's (unused) logits
        if use_rmpad:
            logits = logits[None]
        else:  # verl's padded micro-batch: (B, L, V), right-padded
            width = max(r[0].numel() for r in rows)
            padded = torch.full((len(rows), width, VOCAB), float("nan"))
            for b, part in enumerate(logits.split([r[0].numel() for r in rows])):
                padded[b, : part.shape[0]] = part
            logits = padded
        out = MemopdLMEngine._rce_spot_check(engine, logits, micro_batch, use_rmpad)
        stats, bounds = out[RCE_FIELD].unbind(), out[RCE_TOLERANCE_FIELD].unbind()
        assert [d.shape[0] for d in stats] == [len(r[4]) for r in rows]  # the padding row: no calls
        failed[case] = rce_check(stats, bounds, [str(b) for b in range(len(rows))], "warn")
    assert failed["clean"]["memopd/audit/rce_pass"] == 1.0
    assert failed["fault"]["memopd/audit/rce_failed_calls"] == sum(len(r[4]) for r in rows)


def test_record_fields_come_from_the_agents_episode_and_padding_rows_get_none():
    episodes = random_episodes(2, VOCAB, 30, SHAPE)
    extra = [{"memopd_episode": ep.to_dict()} for ep in episodes]
    rows = record_fields(extra + [extra[0]], [{}, {}, {"is_padding": True}], ["a", "b", "pad"])
    td = TensorDict(
        {k: torch.nested.as_nested_tensor([r[k] for r in rows], layout=torch.jagged) for k in RECORD_FIELDS.values()},
        batch_size=[3],
    )
    decoded = micro_batch_records(td)
    assert [len(d) for d in decoded] == [len(episodes[0].invocations), len(episodes[1].invocations), 0]
    inv = episodes[1].invocations[-1]
    assert decoded[1][-1].ids.tolist() == list(inv.prompt_ids + inv.response_ids)
    assert decoded[1][-1].action.tolist() == [False] * len(inv.prompt_ids) + list(inv.action_mask)
    with pytest.raises(RceAuditError, match=r"row b: no 'memopd_episode' in extra_fields"):
        record_fields([extra[0], {}], [{}, {}], ["a", "b"])
    with pytest.raises(RceAuditError, match=r"micro-batch has no \['memopd_rce_record_ids'"):
        micro_batch_records(TensorDict({}, batch_size=[0]))


def test_a_micro_batch_without_calls_still_makes_one_forward(model):
    """Data-parallel ranks stay in step: a micro-batch of verl padding rows runs one (tiny) alone forward."""
    ids = torch.arange(6)
    forwards = []
    handle = model.register_forward_pre_hook(lambda m, a, k: forwards.append(1), with_kwargs=True)
    try:
        stats, bounds, _ = rce_spot_check(
            model, model, torch.zeros(6, VOCAB), torch.tensor([0]), [ids], [torch.ones(3, dtype=torch.long)], [[]]
        )
    finally:
        handle.remove()
    assert len(forwards) == 1 and stats[0].shape == (0, 5) and bounds[0].numel() == 0
    assert rce_metrics(stats) == {}


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


def test_put_rce_records_writes_each_rows_records_into_transfer_queue(monkeypatch):
    """The trainer's side of the wiring (``put_rce_records``, called on audit steps before the old-log-prob
    forward): the rows' extra_fields are read from TransferQueue, their record fields written back, padding
    rows without calls; what the engine then reads back (``micro_batch_records``) is each episode's calls."""
    import sys

    from verl_memopd.trainer.audit import put_rce_records

    episodes = random_episodes(2, VOCAB, 31, SHAPE)
    store = {"extra_fields": [{"memopd_episode": ep.to_dict()} for ep in episodes] + [{"memopd_episode": {}}]}
    written = {}

    def kv_batch_get(keys, partition_id, select_fields):
        assert select_fields == ["extra_fields"] and partition_id == "train_0"
        return {"extra_fields": store["extra_fields"]}

    def kv_batch_put(keys, partition_id, fields):
        written.update(keys=keys, fields=fields)

    monkeypatch.setitem(
        sys.modules, "transfer_queue", SimpleNamespace(kv_batch_get=kv_batch_get, kv_batch_put=kv_batch_put)
    )
    batch = SimpleNamespace(
        keys=["u0_0_0", "u1_0_0", "pad"], partition_id="train_0", tags=[{}, {}, {"is_padding": True}]
    )
    put_rce_records(batch)
    assert written["keys"] == batch.keys
    decoded = micro_batch_records(written["fields"])
    assert [len(d) for d in decoded] == [len(episodes[0].invocations), len(episodes[1].invocations), 0]
    first = episodes[0].invocations[0]
    assert decoded[0][0].ids.tolist() == list(first.prompt_ids + first.response_ids)
