"""The RCE audit in bf16 *in training*: a fault injected into the packed attention of a bf16 model fails the check
the actor engine runs (``MemopdLMEngine._rce_spot_check``), and, in a real verl run under ``+profile=cpu_bf16``
(FSDP2 mixed precision: fp32 shards, bf16 compute; the reference built from the fp32 shards), the run's own audit
step reports the failure while the same run without the fault passes.

The tiny student has near-uniform attention at its default init, where bf16 rounding hides a softmax-scale bug
(tests/test_rce.py); like the offline self-test, the student's q/k projections are scaled
(``rce.SELF_TEST_QK_SCALE``) so that attention is sharp enough for the fault to move the logits."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from verl_memopd.attention import BACKENDS, attention_implementation, scoped_backend
from verl_memopd.audit import encode_records, records_of_episode
from verl_memopd.bench.tiny import student_model
from verl_memopd.fields import RCE_FIELD, RCE_TOLERANCE_FIELD, RECORD_FIELDS, SEGMENT_IDS
from verl_memopd.packing import pack_episode
from verl_memopd.rce import SELF_TEST_QK_SCALE, EpisodeShape, random_episodes, sharpen_attention
from verl_memopd.segments import segment_meta
from verl_memopd.trainer.audit import rce_check, rce_metrics
from verl_memopd.trainer.engine import MemopdLMEngine

VOCAB = 256
SHAPE = EpisodeShape(prefix_len=(4, 16), chunk_len=(1, 8), response_len=(1, 8))
#: the injected fault: the packed attention's softmax scale x 1.5 (the self-test's backend fault)
FAULT_SCALE = 1.5


def _scale_bug(q, k, v, meta, scale, dropout):
    return BACKENDS["torch"](q, k, v, meta, FAULT_SCALE * scale, dropout)


def _micro_batch(episodes):
    """A verl micro-batch as the actor engine receives it: jagged rows + the invocation-record fields."""
    rows = []
    for ep in episodes:
        row = pack_episode(ep)
        rows.append(
            (
                torch.tensor(row.prompt_ids + row.response_ids),
                torch.tensor(row.position_ids),
                torch.tensor(row.segment_ids),
                torch.tensor(row.response_mask),
                records_of_episode(ep.invocations),
            )
        )
    nested = lambda i: torch.nested.as_nested_tensor([r[i] for r in rows], layout=torch.jagged)  # noqa: E731
    fields = {"input_ids": nested(0), "position_ids": nested(1), SEGMENT_IDS: nested(2), "response_mask": nested(3)}
    enc = [encode_records(r[4]) for r in rows]
    for k, name in RECORD_FIELDS.items():
        fields[name] = torch.nested.as_nested_tensor([e[k] for e in enc], layout=torch.jagged)
    return rows, TensorDict(fields, batch_size=[len(rows)])


@torch.no_grad()
def _packed_logits(model, rows):
    ids, pos, seg = (torch.cat(x) for x in list(zip(*rows))[:3])
    lengths = torch.tensor([r[0].numel() for r in rows])
    meta = segment_meta(seg, torch.repeat_interleave(torch.arange(len(rows)), lengths), pos)
    return model(input_ids=ids[None], position_ids=pos[None], memopd_segments=meta, use_cache=False).logits


@torch.no_grad()
def test_the_actor_engines_bf16_check_fails_on_an_attention_fault():
    model = sharpen_attention(student_model(VOCAB), SELF_TEST_QK_SCALE).to(torch.bfloat16)
    rows, micro_batch = _micro_batch(random_episodes(4, VOCAB, 40, SHAPE))
    engine = SimpleNamespace(module=model)  # the method reads only self.module (FSDP2: the HF model itself)
    verdicts = {}
    for case, fn in (("clean", BACKENDS["torch"]), ("fault", _scale_bug)):
        with scoped_backend("test_bf16_engine_" + case, fn) as name, attention_implementation(model, name):
            logits = _packed_logits(model, rows)  # (1, N, V) bf16: the remove-padding stream
        assert logits.dtype == torch.bfloat16
        out = MemopdLMEngine._rce_spot_check(engine, logits, micro_batch, True)
        stats, bounds = out[RCE_FIELD].unbind(), out[RCE_TOLERANCE_FIELD].unbind()
        verdicts[case] = {
            **rce_metrics(stats),
            **rce_check(stats, bounds, [f"row{b}" for b in range(len(rows))], "warn"),
        }
    calls = sum(len(r[4]) for r in rows)
    assert verdicts["clean"]["memopd/audit/rce_pass"] == 1.0, verdicts["clean"]
    assert verdicts["clean"]["memopd/audit/rce_noise_floor"] > 0  # the bf16 rule ran (an fp32 reference)
    assert verdicts["fault"]["memopd/audit/rce_pass"] == 0.0, verdicts["fault"]
    assert verdicts["fault"]["memopd/audit/rce_failed_calls"] >= calls // 2
    assert verdicts["fault"]["memopd/audit/rce_max_diff_over_tolerance"] > 3


#: put on PYTHONPATH of a verl run: every process that imports verl_memopd.attention (the actor, reference, critic
#: and teacher workers) gets the packed ``torch`` backend with the softmax scale x FAULT_SCALE. The audit's alone
#: pass runs the stock attention (sdpa), so only the packed side is faulty.
SITECUSTOMIZE = textwrap.dedent(
    f"""
    import importlib.abc, importlib.util, sys

    class _InjectFault(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "verl_memopd.attention":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                clean = module.BACKENDS["torch"]
                module.BACKENDS["torch"] = lambda q, k, v, meta, scale, dropout: clean(
                    q, k, v, meta, {FAULT_SCALE} * scale, dropout
                )
                print("[test fault] packed torch attention: softmax scale x {FAULT_SCALE}", file=sys.stderr)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _InjectFault())
    """
)


def _sharp_tiny(root: Path) -> SimpleNamespace:
    from transformers import AutoModelForCausalLM

    from verl_memopd.bench.tiny import build

    models = build(root / "models", seed=0)
    student = AutoModelForCausalLM.from_pretrained(models.student, dtype=torch.float32)
    sharpen_attention(student, SELF_TEST_QK_SCALE).save_pretrained(models.student)
    data = root / "data"
    subprocess.run(
        [sys.executable, "-m", "verl_memopd.tasks", "build", "--out", str(data), "--seed", "0", "--preset", "tiny"],
        check=True,
        capture_output=True,
    )
    return SimpleNamespace(student=Path(models.student), teacher=Path(models.teacher), data=data)


@pytest.mark.slow
def test_a_bf16_verl_run_fails_its_audit_on_a_fault_injected_in_training(tmp_path):
    """Two 1-step runs of the recipe under ``+profile=cpu_bf16`` (the bench step's tiny command, audit on step 1,
    ``on_failure=warn`` so the faulty run still prints its metrics): clean passes with a positive bf16 noise floor,
    the injected fault fails calls by a clear margin."""
    from verl_runs.launcher import run_command

    from verl_memopd.bench.step import command
    from verl_memopd.experiment.launching import cpu_env

    tiny = _sharp_tiny(tmp_path)
    (tmp_path / "fault").mkdir()
    (tmp_path / "fault" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    steps = {}
    for case in ("clean", "fault"):
        workdir = tmp_path / case
        cmd = command("tiny", "bf16", 1, tiny.student, tiny.teacher, tiny.data, workdir)
        env = cpu_env(workdir)
        if case == "fault":
            env["PYTHONPATH"] = str(tmp_path / "fault")
        run = run_command([*cmd, "memopd.audit.on_failure=warn"], workdir, 900, env)
        assert run.returncode == 0 and 1 in run.steps, run.tail()
        assert ("[test fault]" in run.log) == (case == "fault"), run.tail()
        steps[case] = run.steps[1]
    clean, fault = steps["clean"], steps["fault"]
    assert clean["memopd/audit/rce_pass"] == 1.0 and clean["memopd/audit/rce_noise_floor"] > 0, clean
    assert clean["memopd/audit/rce_max_diff_over_tolerance"] < 1
    assert fault["memopd/audit/rce_pass"] == 0.0 and fault["memopd/audit/rce_failed_calls"] > 0, fault
    assert fault["memopd/audit/rce_max_diff_over_tolerance"] > 3
