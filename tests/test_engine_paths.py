"""The GPU recipe's micro-batch path through our engines, on CPU: remove-padding, bf16 autocast.

The GPU recipes run the actor, critic and teacher with FSDP1, ``use_remove_padding=true`` and bf16
(autocast over the FSDP module); the CPU end-to-end runs FSDP2, padded, fp32. What of the GPU path
a CPU can run is run here, through verl's own code: ``FSDPEngine.forward_step`` of our engine
(verl's ``prepare_model_inputs`` -> our segments -> the HF model under ``torch.autocast`` with the
engine's autocast dtype -> verl's ``prepare_model_outputs``: log-probs, entropy), for a micro-batch of
packed MemOPD rows plus a verl padding row, on both of verl's micro-batch paths.

- fp32: the remove-padding stream equals the padded batch, and each call's log-probs equal the call
  run alone under stock sdpa (RCE through the engine).
- bf16 autocast on CPU: same comparisons within the bf16 RCE tolerance (``rce.TOLERANCES``; a
  log-prob differs by at most twice the largest logit difference).

The engine is built without ``__init__`` (verl's FSDP set-up needs a process group and an optimizer;
FSDP wrapping does not change a single rank's forward) and the device helpers return "cpu".
Still GPU-only (``python -m verl_memopd.bench.gpucheck``): FSDP1 itself (it needs an accelerator), the
``memopd_fa2`` / ``memopd_torch_varlen`` kernels, bf16 autocast on CUDA kernels, vLLM's CUDA rollout.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.torch_functional import entropy_from_logits
from verl.workers.engine.fsdp import transformer_impl

from verl_memopd.attention import attention_implementation
from verl_memopd.bench.tiny import student_model
from verl_memopd.fields import CALL_INDEX, FLAT_SEPARATOR, SEGMENT_IDS, SEGMENTS
from verl_memopd.packing import LayoutOptions, build_layout, pack_episode
from verl_memopd.rce import TOLERANCES, EpisodeShape, random_episodes
from verl_memopd.streams import calls_alone
from verl_memopd.trainer.engine import MemopdLMEngine

VOCAB = 256
SHAPE = EpisodeShape(prefix_len=(4, 12), chunk_len=(1, 6), response_len=(1, 6))


@pytest.fixture(scope="module")
def model():
    return student_model(VOCAB, attention="torch")


@pytest.fixture(autouse=True)
def cpu_device(monkeypatch):
    """verl's engine asks its platform for the device; this process may not have the cpu platform."""
    monkeypatch.setattr(transformer_impl, "get_device_name", lambda: "cpu")
    monkeypatch.setattr(transformer_impl, "get_device_id", lambda: "cpu")


def _engine(model, autocast_dtype: torch.dtype) -> MemopdLMEngine:
    """Our actor engine around ``model`` with the attributes verl's forward path reads (no FSDP set-up)."""
    engine = object.__new__(MemopdLMEngine)
    engine.module = model
    engine._autocast_dtype = autocast_dtype
    engine.pad_to_length = False
    engine.use_ulysses_sp = False
    engine.ulysses_sequence_parallel_size = 1
    engine.compute_entropy_from_logits = entropy_from_logits
    engine.engine_config = SimpleNamespace(
        entropy_checkpointing=False, entropy_from_logits_with_chunking=False, pad_to_length=False
    )
    return engine


def _rows(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Packed rows (ids, restored positions, segment ids) of ``n`` random episodes + one verl padding row."""
    rows = []
    for ep in random_episodes(n, VOCAB, seed, SHAPE):
        row = pack_episode(ep)
        rows.append(
            (
                torch.tensor(row.prompt_ids + row.response_ids),
                torch.tensor(row.position_ids),
                torch.tensor(row.segment_ids),
            )
        )
    pad = torch.arange(7) % VOCAB
    return rows + [(pad, torch.arange(7), torch.zeros(7, dtype=torch.long))]


def _micro_batch(rows, use_remove_padding: bool) -> TensorDict:
    jagged = lambda i: torch.nested.as_nested_tensor([r[i] for r in rows], layout=torch.jagged)  # noqa: E731
    td = TensorDict(
        {
            "input_ids": jagged(0),
            "position_ids": jagged(1),
            SEGMENT_IDS: jagged(2),
            "temperature": torch.ones(len(rows)),
        },
        batch_size=[len(rows)],
    )
    tu.assign_non_tensor(td, use_remove_padding=use_remove_padding, calculate_entropy=True)
    return td


def _forward(engine, rows, use_remove_padding: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """verl's forward_step (forward only) -> per-row log-probs and entropies, (L_b,) each."""
    with torch.no_grad():
        _, out = engine.forward_step(_micro_batch(rows, use_remove_padding), loss_function=None, forward_only=True)
    model_output = out["model_output"]
    return tuple([x.float() for x in model_output[k].unbind()] for k in ("log_probs", "entropy"))


@torch.no_grad()
def _calls_alone(model, rows, autocast_dtype):
    """Reference: every call run alone ([q ; block_t], its restored positions) under stock sdpa, with the
    same autocast -> stream log-softmax (N', V), stream token ids (N',), spans (``calls_alone``), max |logit|."""
    inputs, spans, _ = calls_alone(*(list(x) for x in zip(*rows)))
    inputs.pop(SEGMENTS)  # sdpa: every sequence its own batch row would need padding; run them one by one
    ids, pos = inputs["input_ids"][0], inputs["position_ids"][0]
    starts = torch.nonzero(pos == 0, as_tuple=True)[0].tolist() + [ids.numel()]
    with (
        attention_implementation(model, "sdpa"),
        torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype != torch.float32),
    ):
        logits = torch.cat(
            [
                model(input_ids=ids[None, a:b], position_ids=pos[None, a:b], use_cache=False).logits[0]
                for a, b in zip(starts[:-1], starts[1:])
            ]
        ).float()
    return logits.log_softmax(-1), ids, spans, logits.abs().max().item()


def _block_logprob_diff(got: list[torch.Tensor], logp: torch.Tensor, ids: torch.Tensor, spans) -> float:
    """max |engine log-prob - alone log-prob| where a call-block token predicts the next token of its block
    (verl's label at packed position i is token i+1 of the stream)."""
    worst = 0.0
    for row_lp, row_spans in zip(got, spans):
        for block, start, end in row_spans:
            n = block.numel() - 1
            if n <= 0:
                continue
            ref = logp[start : start + n].gather(-1, ids[start + 1 : start + 1 + n, None])[:, 0]
            worst = max(worst, (row_lp[block[:n]] - ref).abs().max().item())
    return worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_remove_padding_path_through_the_engine_equals_padded_and_calls_alone(model, dtype):
    rows = _rows(4, seed=3)
    engine = _engine(model, dtype)
    stream_lp, stream_ent = _forward(engine, rows, use_remove_padding=True)
    padded_lp, padded_ent = _forward(engine, rows, use_remove_padding=False)
    assert [x.numel() for x in stream_lp] == [r[0].numel() for r in rows]
    logp, ids, spans, max_logit = _calls_alone(model, rows, dtype)
    assert sum(len(s) for s in spans) >= 8  # every episode has several calls
    # fp32: summation order only; bf16: the RCE tolerance on logits, twice for a log-softmax
    budget = 1e-4 if dtype == torch.float32 else 2 * TOLERANCES[torch.bfloat16].bound(max_logit)
    paths = max((s - p).abs().max().item() for s, p in zip(stream_lp + stream_ent, padded_lp + padded_ent))
    alone = _block_logprob_diff(stream_lp, logp, ids, spans)
    print(
        f"engine forward_step, {str(dtype)[6:]} autocast: max |stream - padded| = {paths:.3g}, "
        f"max |log p stream - log p call alone| = {alone:.3g} (budget {budget:.3g})"
    )
    assert paths <= budget and alone <= budget


@pytest.mark.parametrize("use_remove_padding", [True, False])
def test_the_flat_pass_with_a_separator_runs_the_separated_flat_layout(model, use_remove_padding):
    """Flat rows (positions 0..L-1, one segment, ``memopd_call_index``) with ``memopd_flat_separator`` set:
    the engine's action-token log-probs equal the separated ``flat`` layout run under stock sdpa."""
    separator = (VOCAB - 2, VOCAB - 1)
    episodes = random_episodes(4, VOCAB - 2, seed=5, shape=SHAPE)
    rows, calls, predicting = [], [], []
    for ep in episodes:
        row = pack_episode(ep)
        n, p = len(row.segment_ids), len(row.prompt_ids)
        rows.append(
            (torch.tensor(row.prompt_ids + row.response_ids), torch.arange(n), torch.zeros(n, dtype=torch.long))
        )
        calls.append(torch.tensor(row.segment_ids[p:]) - 1)
        predicting.append(torch.tensor([p + k - 1 for k, m in enumerate(row.response_mask) if m]))
    td = _micro_batch(rows, use_remove_padding)
    td[CALL_INDEX] = torch.nested.as_nested_tensor(calls, layout=torch.jagged)
    tu.assign_non_tensor(td, **{FLAT_SEPARATOR: separator})
    with torch.no_grad():
        _, out = _engine(model, torch.float32).forward_step(td, loss_function=None, forward_only=True)
    got = torch.cat([lp[j] for lp, j in zip(out["model_output"]["log_probs"].unbind(), predicting)])
    layout = build_layout("flat", episodes, VOCAB, LayoutOptions(flat_separator_ids=separator))
    with torch.no_grad(), attention_implementation(model, "sdpa"):
        logits = model(input_ids=layout.input_ids, position_ids=layout.position_ids, use_cache=False).logits
    ref = logits.reshape(-1, logits.shape[-1])[layout.action_index].log_softmax(-1)
    ref = ref.gather(-1, layout.action_ids[:, None])[:, 0]
    assert got.numel() == layout.action_ids.numel() and (got - ref).abs().max().item() <= 1e-4


def test_saved_actor_config_names_stock_attention(tmp_path, monkeypatch):
    """The actor trains with the packed ``memopd_torch`` attention (verl's override_config puts it on the model
    config); what ``save_checkpoint`` writes must load and run in plain transformers, and the model keeps
    training packed afterwards."""
    import json

    from transformers import AutoModelForCausalLM

    model = student_model(VOCAB, attention="torch")
    model.config.attn_implementation = "memopd_torch"  # what verl's override_config leaves on the config
    saved = []

    def verl_save(self, local_path, *args, **kwargs):  # the part of verl's FSDP save that writes the HF folder
        self.module.config.save_pretrained(f"{local_path}/huggingface")
        self.module.save_pretrained(f"{local_path}/huggingface")
        saved.append(self.module.config._attn_implementation)

    monkeypatch.setattr(transformer_impl.FSDPEngineWithLMHead, "save_checkpoint", verl_save)
    engine = _engine(model, torch.float32)
    engine.save_checkpoint(str(tmp_path), None, 1, None)
    config = json.loads((tmp_path / "huggingface" / "config.json").read_text())
    assert saved == ["sdpa"] and config.get("attn_implementation", "sdpa") == "sdpa", config.get("attn_implementation")
    assert model.config._attn_implementation == model.config.attn_implementation == "memopd_torch"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "huggingface")  # no plugin attention needed
    assert loaded.config._attn_implementation == "sdpa"
    loaded(input_ids=torch.arange(5)[None])
