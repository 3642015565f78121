"""Group-shared prefix (verl_memopd.streams.share_prefix): q computed once per prompt group, outputs and
gradients equal to every row computing its own q -- at unit level and through the memopd engines'
own input/output code on both of verl's micro-batch paths."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import verl.utils.torch_functional as verl_F
from tensordict import TensorDict
from transformers import Qwen2ForCausalLM, Qwen2ForTokenClassification
from verl.utils import tensordict_utils as tu

from verl_memopd.attention import hf_name
from verl_memopd.bench.packing import grouped_episodes
from verl_memopd.bench.tiny import student_config
from verl_memopd.fields import PROMPT_GROUP, SEGMENT_IDS, TEACHER_HIDDEN, TEACHER_MASK, TEACHER_OUTPUT_KEY
from verl_memopd.packing import pack_episode
from verl_memopd.rce import EpisodeShape, random_episodes
from verl_memopd.segments import segment_meta
from verl_memopd.streams import share_prefix
from verl_memopd.trainer.engine import MemopdLMEngine, MemopdTeacherEngine, MemopdValueEngine, final_norm
from verl_memopd.trainer.rows import prompt_groups

VOCAB = 256
SHAPE = EpisodeShape(prefix_len=(6, 16), calls=(1, 4), chunk_len=(1, 8), response_len=(1, 8))


def _model(cls=Qwen2ForCausalLM, **config):
    torch.manual_seed(0)
    c = student_config(vocab_size=VOCAB)
    for k, v in config.items():
        setattr(c, k, v)
    m = cls(c).eval()  # no dropout (the token-classification head has one)
    m.set_attn_implementation(hf_name("torch"))
    return m


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal to fp32 noise: summing q's gradient once per group instead of once per row reorders fp32 sums
    (Qwen2's RMSNorm computes in fp32 whatever the model's dtype), relative to the tensor's scale."""
    torch.testing.assert_close(a, b, atol=2e-5 * float(b.abs().max().clamp(min=1e-3)), rtol=1e-4)


@pytest.fixture(scope="module")
def model():
    return _model()


def _rows():
    """Packed rows (ids, positions, segments) and prompt groups: a group of 3 episodes of one q, an
    episode alone, a row of group 0 whose q has the same length but other ids (the group id alone must
    not be trusted), and a verl padding row (no call blocks)."""
    eps = grouped_episodes(random_episodes(4, VOCAB, 3, SHAPE), 3, 12, 0, VOCAB)
    odd = grouped_episodes(random_episodes(1, VOCAB, 9, SHAPE), 1, 12, 1, VOCAB)[0]
    rows = []
    for ep in [eps[0], eps[1], odd, eps[3], eps[2]]:
        r = pack_episode(ep)
        rows.append(
            (torch.tensor(r.prompt_ids + r.response_ids), torch.tensor(r.position_ids), torch.tensor(r.segment_ids))
        )
    rows.append((torch.arange(5), torch.arange(5), torch.zeros(5, dtype=torch.long)))
    return rows, [0, 0, 0, 1, 0, -1]


def _packed_logits(model, rows):
    """Every row computing its own q: the engines' packed stream."""
    ids, pos, seg = (torch.cat(x) for x in zip(*rows))
    row_ids = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([r[0].numel() for r in rows]))
    return model(
        input_ids=ids[None], position_ids=pos[None], memopd_segments=segment_meta(seg, row_ids, pos), use_cache=False
    ).logits[0]


def test_q_is_stored_once_per_group_and_every_output_read_back(model):
    rows, groups = _rows()
    inputs, index = share_prefix(*(list(x) for x in zip(*rows)), groups)
    n, p = sum(r[0].numel() for r in rows), 12
    assert inputs["input_ids"].shape[1] == n - 2 * p  # rows 1 and 4 use row 0's q; the odd row keeps its own
    torch.testing.assert_close(inputs["input_ids"][0, index], torch.cat([r[0] for r in rows]))
    with torch.no_grad():
        shared = model(**inputs, use_cache=False).logits[0, index]
        _close(shared, _packed_logits(model, rows))


def test_nothing_shared_without_a_verified_common_prompt():
    rows, _ = _rows()
    cols = [list(x) for x in zip(*rows)]
    assert share_prefix(*cols, [0, -1, 0, 1, -1, -1]) is None  # row 0 and row 2: one group, different q ids
    assert share_prefix(*cols, [-1] * 6) is None  # sharing off
    assert prompt_groups(["u1_0_0", "u2_0_0", "u1_1_0"], True) == [0, 1, 0]
    assert prompt_groups(["u1_0_0", "u1_1_0"], False) == [-1, -1]


def test_gradients_are_those_of_every_row_computing_its_own_q(model):
    rows, groups = _rows()
    inputs, index = share_prefix(*(list(x) for x in zip(*rows)), groups)
    weights = torch.randn(index.numel(), VOCAB, generator=torch.Generator().manual_seed(0))
    grads = []
    for logits in (lambda: model(**inputs, use_cache=False).logits[0, index], lambda: _packed_logits(model, rows)):
        model.zero_grad()
        (torch.log_softmax(logits(), -1) * weights).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for shared, own in zip(*grads):
        _close(shared, own)


# --- through the engines' own prepare_model_inputs / prepare_model_outputs ----------------------------------
def _engine(cls, module):
    """A memopd engine around ``module`` without FSDP: the attributes verl's input/output code reads."""
    engine = object.__new__(cls)
    engine.module, engine.use_ulysses_sp, engine.pad_to_length = module, False, False
    engine.engine_config = SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False)
    engine.compute_entropy_from_logits = verl_F.entropy_from_logits
    return engine


def _micro_batch(rows, groups, use_rmpad: bool, share: bool) -> TensorDict:
    jagged = lambda ts: torch.nested.as_nested_tensor(list(ts), layout=torch.jagged)  # noqa: E731
    ids, pos, seg = zip(*rows)
    resp = [int((s > 0).sum()) or 1 for s in seg]
    td = TensorDict(
        {
            "input_ids": jagged(ids),
            "position_ids": jagged(pos),
            SEGMENT_IDS: jagged(seg),
            TEACHER_MASK: jagged([torch.ones(r, dtype=torch.long) for r in resp]),
            PROMPT_GROUP: torch.tensor(groups if share else [-1] * len(groups)),
            "temperature": torch.ones(len(rows)),
        },
        batch_size=[len(rows)],
    )
    tu.assign_non_tensor(td, use_remove_padding=use_rmpad, calculate_entropy=True)
    return td


def _run(engine, micro_batch, key):
    model_inputs, output_args = engine.prepare_model_inputs(micro_batch)
    output = engine.module(**model_inputs, use_cache=False)
    out = engine.prepare_model_outputs(output, output_args, micro_batch, None)
    return [out[k] for k in key], model_inputs["input_ids"].numel()


@pytest.mark.parametrize("use_rmpad", [True, False])
@pytest.mark.parametrize("role", ["actor", "critic", "teacher"])
def test_engines_give_the_same_outputs_and_gradients_with_sharing_on_and_off(role, use_rmpad):
    rows, groups = _rows()
    if role == "actor":
        engine, keys = _engine(MemopdLMEngine, _model()), ["log_probs", "entropy"]
    elif role == "critic":
        engine, keys = _engine(MemopdValueEngine, _model(Qwen2ForTokenClassification, num_labels=1)), ["values"]
    else:
        engine, keys = _engine(MemopdTeacherEngine, _model()), [TEACHER_HIDDEN]
        engine._final_norm_output = []
        final_norm(engine.module).register_forward_hook(lambda _m, _i, out: engine._final_norm_output.append(out))
    results = []
    for share in (True, False):
        engine.module.zero_grad()
        micro_batch = _micro_batch(rows, groups, use_rmpad, share)
        if role == "teacher":  # the states as gathered (the hidden transport detaches them: a frozen teacher)
            tu.assign_non_tensor(micro_batch, **{TEACHER_OUTPUT_KEY: TEACHER_HIDDEN})
        outs, n_tokens = _run(engine, micro_batch, keys)
        sum(o.values().pow(2).sum() for o in outs).backward()
        results.append(
            (
                [o.values().detach() for o in outs],
                n_tokens,
                [p.grad.clone() for p in engine.module.parameters() if p.grad is not None],
            )
        )
    (shared, n_shared, g_shared), (own, n_own, g_own) = results
    assert n_shared < n_own if use_rmpad else n_shared < sum(r[0].numel() for r in rows)
    for a, b in zip(shared + g_shared, own + g_own):
        _close(a, b)
    assert len(g_shared) == len(g_own) > 0


def test_teacher_hook_catches_the_final_post_norm_hidden_states(model):
    """The teacher reads the final norm's output through a hook instead of output_hidden_states=True
    (which keeps every layer's hidden states); both are the same tensor."""
    caught = []
    handle = final_norm(model).register_forward_hook(lambda _m, _i, out: caught.append(out))
    ids = torch.arange(9)[None]
    with torch.no_grad():
        out = model(
            input_ids=ids,
            position_ids=ids,
            memopd_segments=segment_meta(torch.zeros(9), torch.zeros(9)),
            output_hidden_states=True,
            use_cache=False,
        )
    handle.remove()
    assert len(caught) == 1 and torch.equal(caught[0], out.hidden_states[-1])


def test_critic_value_head_is_drawn_from_the_engine_seed(monkeypatch):
    """The critic's new value head comes from ``critic.fsdp.seed``: two engines with the same seed (the
    experiment's matched arms) start from the same head, another seed from another one."""
    from types import SimpleNamespace

    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead

    monkeypatch.setattr(FSDPEngineWithValueHead, "initialize", lambda self: setattr(self, "head", torch.randn(4)))
    monkeypatch.setattr("verl_memopd.trainer.engine.require_packed_attention", lambda module: None)

    def head(seed: int) -> torch.Tensor:
        torch.randn(3)  # whatever the process drew before must not matter
        engine = object.__new__(MemopdValueEngine)
        engine.engine_config, engine.use_ulysses_sp, engine.module = SimpleNamespace(seed=seed), False, None
        engine.initialize()
        return engine.head

    assert torch.equal(head(42), head(42)) and not torch.equal(head(42), head(7))
