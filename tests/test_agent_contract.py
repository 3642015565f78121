"""docs/agent_contract.md's minimal agent, run as verl runs an agent loop, and held to MemOPD's checks.

``NotesAgentLoop`` is not the memory agent: it reads a row's documents one call each, keeps notes of its own
making, then answers from the notes, built only from the public contract (``verl_memopd.fields``,
``verl_memopd.records``, ``verl_memopd.packing.pack_episode``) -- nothing of ``verl_memopd.agent``. A scripted
server stands in for vLLM. Its output must pass what the trainer does with a row: verl's ``AgentLoopOutput``
(and its ``as_dict``), the records' validation (``Episode.from_dict``, the vocabulary), the row being exactly
the packing of its records, the trainer's layout restore (``trainer.rows.layout_fields``) and the RCE audit's
record reading (``trainer.audit.record_fields``), and the RCE checks themselves on a tiny model: every action
token's logits in the packed row equal those of its call run alone (offline audit and the in-training check).
Breaking the contract (a call whose prompt does not start with ``q``, a missing layout key) is refused by name.
"""

from __future__ import annotations

import asyncio
from uuid import uuid4

import hydra
import pytest
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopOutput,
    DictConfigWrap,
    _agent_loop_registry,
    register,
)
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout.replica import TokenOutput

from verl_memopd.fields import CALL_INDEX, EPISODE, POSITION_IDS, RECORD_FIELDS, SEGMENT_IDS, TEACHER_MASK
from verl_memopd.packing import pack_episode
from verl_memopd.records import Episode, Invocation, RecordError


# --- the example of docs/agent_contract.md ----------------------------------------------------------------------
@register("notes_agent")
class NotesAgentLoop(AgentLoopBase):
    """One call per document (q + notes so far + the document -> new notes), then q + notes -> the answer."""

    NOTE_TOKENS, ANSWER_TOKENS = 16, 8

    async def run(self, sampling_params, **kwargs) -> AgentLoopOutput:
        tok = self.tokenizer

        def ids(text):
            return tok.encode(text, add_special_tokens=False)

        q = ids(f"Question: {kwargs['question']}\n")  # the shared prefix: the same ids in every call
        request_id, calls, notes = uuid4().hex, [], []
        for doc in [*kwargs["documents"], None]:  # None: the answer call
            if doc is None:
                context, budget = ids("Notes: ") + notes + ids("\nAnswer:"), self.ANSWER_TOKENS
            else:
                context, budget = ids("Notes: ") + notes + ids(f"\nDocument: {doc}\nNew notes:"), self.NOTE_TOKENS
            prompt = q + context  # token ids concatenated, never text re-tokenized
            out = await self.server_manager.generate(
                request_id=request_id, prompt_ids=prompt, sampling_params={**sampling_params, "max_tokens": budget}
            )
            stopped = out.token_ids[-1] == tok.eos_token_id
            calls.append(
                Invocation(
                    prompt_ids=prompt,
                    response_ids=out.token_ids,  # exactly as sampled
                    response_logprobs=out.log_probs,  # the rollout's, one per sampled token
                    finish_reason="stop" if stopped else "length",
                )
            )
            notes = list(out.token_ids[:-1] if stopped else out.token_ids)  # the next call's context
        answer = tok.decode(calls[-1].response_ids, skip_special_tokens=True)
        reward = float(kwargs["answer"] in answer)
        episode = Episode(uuid4().hex, str(kwargs.get("uid", "")), q, tuple(calls), reward=reward)
        row = pack_episode(episode)  # q once, then each call's block [x_t a_t]
        limits = self.rollout_config.prompt_length, self.rollout_config.response_length
        if len(row.prompt_ids) > limits[0] or len(row.response_ids) > limits[1]:
            raise ValueError(f"episode needs prompt/response lengths {len(row.prompt_ids)}/{len(row.response_ids)}")
        return AgentLoopOutput(
            prompt_ids=list(row.prompt_ids),
            response_ids=list(row.response_ids),
            response_mask=list(row.response_mask),
            response_logprobs=list(row.response_logprobs),
            reward_score=reward,
            num_turns=2 * len(calls),
            metrics={},
            extra_fields={
                EPISODE: episode.to_dict(),
                POSITION_IDS: list(row.position_ids),
                SEGMENT_IDS: list(row.segment_ids),
                TEACHER_MASK: list(row.teacher_mask),
            },
        )


# --- a scripted rollout server and verl's way of building an agent loop --------------------------------------------
class ScriptedServer:
    """verl's server client stand-in: ``n`` prompt-dependent ids (+ eos on even calls), log-probs < 0."""

    def __init__(self, vocab: int, eos: int):
        self.vocab, self.eos, self.prompts = vocab, eos, []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        t, n = len(self.prompts), sampling_params["max_tokens"]
        self.prompts.append(list(prompt_ids))
        ids = [3 + (sum(prompt_ids) * 31 + 7 * i) % (self.vocab - 3) for i in range(n)]
        if t % 2 == 0:
            ids = ids[: n // 2] + [self.eos]
        return TokenOutput(
            token_ids=ids, log_probs=[-0.05 - 0.01 * i for i in range(len(ids))], stop_reason="completed"
        )


ROW = {"question": "Which town has a lighthouse?", "documents": ["Velora is a harbour town.", "It has a lighthouse."]}


@pytest.fixture(scope="module")
def tokenizer():
    from verl_memopd.bench.tiny import build_tokenizer

    return build_tokenizer(0)


def run_agent(tokenizer, name="notes_agent", answer="Velora"):
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"prompt_length": 64, "response_length": 512}}})
    server = ScriptedServer(len(tokenizer), tokenizer.eos_token_id)

    async def go():
        loop = hydra.utils.instantiate(  # what verl's AgentLoopWorker does with the registry entry
            _agent_loop_registry[name],
            trainer_config=DictConfigWrap(config),
            server_manager=server,
            tokenizer=tokenizer,
            processor=None,
            dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(OmegaConf.create({})),
        )
        return await loop.run({"temperature": 1.0, "logprobs": True}, uid="u0", answer=answer, **ROW)

    return asyncio.run(go()), server


@pytest.fixture(scope="module")
def agent_run(tokenizer):
    return run_agent(tokenizer)


def test_the_example_registers_and_returns_a_row_verl_accepts(agent_run):
    assert _agent_loop_registry["notes_agent"] == {"_target_": f"{__name__}.NotesAgentLoop"}
    out, server = agent_run
    assert isinstance(out, AgentLoopOutput) and len(server.prompts) == 3  # 2 documents + the answer
    row = out.as_dict()  # what verl's agent-loop worker turns the output into
    p, r = len(out.prompt_ids), len(out.response_ids)
    assert row["prompts"].shape == (p,) and row["responses"].shape == row["response_mask"].shape == (r,)
    assert row["rollout_log_probs"].shape == (r,) and row["rm_scores"].shape == (r,)
    assert set(row["extra_fields"]) >= {EPISODE, POSITION_IDS, SEGMENT_IDS, TEACHER_MASK}


def test_its_records_pass_validation_and_are_exactly_what_the_server_saw(agent_run, tokenizer):
    out, server = agent_run
    episode = Episode.from_dict(out.extra_fields[EPISODE])  # the records' validation (RecordError otherwise)
    episode.validate_vocab(len(tokenizer))
    assert [list(c.prompt_ids) for c in episode.invocations] == server.prompts
    assert all(c.prompt_ids[: episode.prefix_len] == episode.prefix_ids for c in episode.invocations)
    assert [c.finish_reason for c in episode.invocations] == ["stop", "length", "stop"]
    row = pack_episode(episode)  # the row is the packing of its records, field by field
    assert (list(row.prompt_ids), list(row.response_ids), list(row.response_mask)) == (
        out.prompt_ids,
        out.response_ids,
        out.response_mask,
    )
    assert list(row.response_logprobs) == pytest.approx(out.response_logprobs)
    assert list(row.position_ids) == out.extra_fields[POSITION_IDS]
    assert list(row.segment_ids) == out.extra_fields[SEGMENT_IDS]
    # q once: positions restart after q in every call block
    p = len(out.prompt_ids)
    for t, call in enumerate(episode.invocations):
        block = [i for i, s in enumerate(out.extra_fields[SEGMENT_IDS]) if s == t + 1]
        assert [out.extra_fields[POSITION_IDS][i] for i in block] == list(
            range(p, len(call.prompt_ids) + len(call.response_ids))
        )


def test_the_trainer_restores_its_layout_and_reads_its_records(agent_run):
    from verl_memopd.trainer.audit import record_fields
    from verl_memopd.trainer.rows import layout_fields

    out, _ = agent_run
    p, r = len(out.prompt_ids), len(out.response_ids)
    packed = layout_fields(p, r, out.extra_fields, "packed", "row 0")
    assert packed["position_ids"].tolist() == out.extra_fields[POSITION_IDS]
    assert packed[TEACHER_MASK].tolist() == out.extra_fields[TEACHER_MASK] == out.response_mask  # m_T = m_act
    assert sorted(set(packed[CALL_INDEX].tolist())) == [0, 1, 2]
    flat = layout_fields(p, r, out.extra_fields, "flat", "row 0")  # memopd.teacher.state=flat's layout
    assert flat["position_ids"].tolist() == list(range(p + r))
    answer_only = layout_fields(p, r, out.extra_fields, "packed", "row 0", teacher_mask_policy="answer")
    last = packed[CALL_INDEX] == 2
    assert answer_only[TEACHER_MASK][~last].sum() == 0 and answer_only[TEACHER_MASK][last].sum() > 0
    (records,) = record_fields([out.extra_fields], [{}], ["row 0"])
    assert records[RECORD_FIELDS["lengths"]].tolist() == [
        len(c["prompt_ids"]) + len(c["response_ids"]) for c in out.extra_fields[EPISODE]["invocations"]
    ]


def test_its_packed_row_reproduces_every_call_run_alone(agent_run, tokenizer):
    """The RCE audit, offline and as the actor runs it in training, on a tiny model: the agent's packed row
    gives each action token the logits its call gives alone."""
    from verl_memopd.bench.tiny import student_model
    from verl_memopd.rce import rce_audit, spot_check_rows

    out, _ = agent_run
    episode = Episode.from_dict(out.extra_fields[EPISODE])
    model = student_model(len(tokenizer))
    offline = rce_audit(model, [episode])
    assert offline.passed and offline.max_abs_diff <= 1e-4 and offline.action_tokens == sum(out.response_mask)
    in_training = spot_check_rows(model, [episode])
    assert in_training.passed and not in_training.problems


def test_breaking_the_contract_is_refused_by_name(agent_run):
    from verl_memopd.trainer.rows import MemopdRowError, layout_fields

    out, _ = agent_run
    raw = out.extra_fields[EPISODE]
    bad = {**raw, "invocations": [dict(c) for c in raw["invocations"]]}
    bad["invocations"][1]["prompt_ids"] = [bad["prefix_ids"][0] + 1, *bad["invocations"][1]["prompt_ids"][1:]]
    with pytest.raises(RecordError, match=r"call 1: prompt_ids does not start with the shared prefix q"):
        Episode.from_dict(bad)
    bad = {**raw, "invocations": [dict(c) for c in raw["invocations"]]}
    bad["invocations"][0]["response_logprobs"] = bad["invocations"][0]["response_logprobs"][:-1]
    with pytest.raises(RecordError, match=r"call 0: response_logprobs has \d+ entries, response_ids has \d+"):
        Episode.from_dict(bad)
    missing = {k: v for k, v in out.extra_fields.items() if k != POSITION_IDS}
    with pytest.raises(MemopdRowError, match=rf"no \['{POSITION_IDS}'\] in extra_fields"):
        layout_fields(len(out.prompt_ids), len(out.response_ids), missing, "packed", "row 0")
    short = {**out.extra_fields, TEACHER_MASK: out.extra_fields[TEACHER_MASK][:-1]}
    with pytest.raises(MemopdRowError, match="do not match prompt"):
        layout_fields(len(out.prompt_ids), len(out.response_ids), short, "packed", "row 0")


def test_the_page_shows_this_example_verbatim_and_names_the_contract_keys():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "agent_contract.md").read_text()
    source = Path(__file__).read_text()
    example = source[source.index('@register("notes_agent")') : source.index("# --- a scripted rollout server")]
    (block,) = [b for b in page.split("```python\n")[1:] if "class NotesAgentLoop" in b]
    assert example.rstrip() in block, "docs/agent_contract.md's example differs from the tested one"
    assert "verl_memopd.agent" not in block  # the public contract only, no loop internals
    for key in (EPISODE, POSITION_IDS, SEGMENT_IDS, TEACHER_MASK):
        assert f'"{key}"' in page, f"the page does not name {key}"
