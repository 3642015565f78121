"""Memory agent loop with a scripted, deterministic fake LLM server (no vLLM, no Ray).

The fake server records every request; the tests check that the agent's invocation records
reproduce exactly the ids the server received and returned, that ``q`` is shared token for
token, that budgets and truncation are honoured and recorded, and that the packed row and
its extra fields are what verl and the MemOPD trainer consume.
"""

import asyncio
import copy
import time
from dataclasses import fields

import hydra
import pytest
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, _agent_loop_registry
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.utils.tensordict_utils import list_of_dict_to_tensordict
from verl.workers.rollout.replica import TokenOutput

from verl_memopd.agent import MemoryAgentConfig
from verl_memopd.agent.context import CallContext
from verl_memopd.agent.episode import CallRequest, MemoryEpisode
from verl_memopd.fields import EPISODE, POSITION_IDS, SEGMENT_IDS, TEACHER_MASK
from verl_memopd.packing import pack_episode
from verl_memopd.records import Episode
from verl_memopd.tasks.dataset import AGENT_NAME, parse_row, to_row
from verl_memopd.tasks.generator import corpus, generate, get_preset
from verl_memopd.tasks.prompts import CALL_FIELDS, DATA_FIELDS, MemoryPrompts, format_answers

EOS = "<|im_end|>"
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    """A small byte-level BPE trained on benchmark text, ChatML template, ``<|im_end|>`` = eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_start|>", EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus(60, seed=0, presets=("tiny",))), trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token=EOS)
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    hf.chat_template = CHATML
    return hf


class FakeServer:
    """Deterministic stand-in for verl's LLM server client; ``script(t, prompt, max_tokens)`` -> ids.

    A plain class on purpose: hydra.utils.instantiate would turn a dataclass argument into a DictConfig.
    """

    def __init__(self, script, with_logprobs=True):
        self.script, self.with_logprobs, self.requests = script, with_logprobs, []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        t = len(self.requests)
        ids = list(self.script(t, list(prompt_ids), sampling_params["max_tokens"]))
        logprobs = [-0.01 * (t + 1) - 0.001 * i for i in range(len(ids))] if self.with_logprobs else None
        self.requests.append(
            {
                "request_id": request_id,
                "prompt_ids": list(prompt_ids),
                "sampling_params": dict(sampling_params),
                "token_ids": ids,
                "log_probs": logprobs,
            }
        )
        step = 3 if t < 2 else 4  # weights were updated between calls 1 and 2 (as verl's client reports it)
        return TokenOutput(
            token_ids=ids,
            log_probs=logprobs,
            stop_reason="completed",
            extra_fields={"min_global_steps": step, "max_global_steps": step},
        )


def _filler(prompt, n):
    """n prompt-dependent ordinary token ids (3.. avoids the special tokens 0, 1, 2)."""
    return [3 + (sum(prompt) * 31 + 7 * i) % 500 for i in range(n)]


def _script(tokenizer, answers):
    """call 0: 5 tokens + eos; call 1: runs into its budget; call 2: eos only; answer call: the answers."""
    eos = tokenizer.eos_token_id

    def script(t, prompt, max_tokens):
        if not tokenizer.decode(prompt).endswith("<|im_start|>assistant\n"):  # every call ends in the gen. prompt
            raise AssertionError("prompt does not end with the generation prompt")
        if t == 0:
            return _filler(prompt, 5) + [eos]
        if t == 1:
            return _filler(prompt, max_tokens)
        if t == 2:
            return [eos]
        return tokenizer.encode(format_answers(answers)) + [eos]

    return script


def _row(index=3):
    return to_row(generate(get_preset("tiny").config, 0, "val", index), "tiny", "val", index)


def _config(**agent):
    return OmegaConf.create(
        {
            "actor_rollout_ref": {"rollout": {"prompt_length": 256, "response_length": 2048, "max_model_len": None}},
            "data": {},
            "memopd": {"agent": {"memory_tokens": 12, "answer_tokens": 40, **agent}},
        }
    )


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


def _run(tokenizer, server, row, config=None, agent=AGENT_NAME, **run_kwargs):
    async def go():
        config_ = config if config is not None else _config()
        loop = hydra.utils.instantiate(  # exactly how verl's AgentLoopWorker builds an agent loop
            _agent_loop_registry[agent],
            trainer_config=DictConfigWrap(config_),
            server_manager=server,
            tokenizer=tokenizer,
            processor=None,
            dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(config_.data),
        )
        return await loop.run(
            dict(SAMPLING),
            raw_prompt=row["prompt"],
            extra_info=row["extra_info"],
            reward_model=row["reward_model"],
            data_source=row["data_source"],
            uid="u3",
            index=3,
            **run_kwargs,
        )

    return asyncio.run(go())


@pytest.fixture(scope="module")
def episode_run(tokenizer):
    row = _row()
    server = FakeServer(_script(tokenizer, [a[0] for a in row["reward_model"]["ground_truth"]]))
    output = _run(tokenizer, server, row)
    return row, server, output, Episode.from_dict(output.extra_fields[EPISODE])


QWEN_LIKE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' + (think or '') }}{% endif %}"
)
BROKEN = CHATML + "{% if not add_generation_prompt %}[END]{% endif %}"


def _context(tokenizer, template, **kwargs):
    tok = copy.copy(tokenizer)
    tok.chat_template = template
    return CallContext(tok, _row()["prompt"], MemoryPrompts(), kwargs, where="row 3 (val-3)")


def test_memory_episode_lays_out_the_calls_and_hands_each_reply_on_as_memory(tokenizer):
    """The call schedule both agents (verl's loop, the experiment's HF agent) drive: N memory calls, the answer call;
    each reply minus its stop id is what the next call reads."""
    row, eos = _row(), tokenizer.eos_token_id
    task, ctx = parse_row(row["extra_info"], row["reward_model"]), _context(tokenizer, CHATML)
    episode, n = MemoryEpisode(task, ctx, memory_tokens=12, answer_tokens=40), len(task.chunks)
    answers = tokenizer.encode(format_answers([a[0] for a in row["reward_model"]["ground_truth"]]))
    kept = ()
    for t in range(n + 1):
        assert not episode.done
        request, user = episode.next_call(), episode.message("MEMORY TEXT")
        context = ctx.memory_call(kept, task.chunks[t], t, n) if t < n else ctx.answer_call(kept)
        assert request == CallRequest(t, ctx.prefix_ids + context, 12 if t < n else 40, keeps_memory=t < n)
        assert user == (
            MemoryPrompts().memory_message("MEMORY TEXT", task.chunks[t], t, n)
            if t < n
            else MemoryPrompts().answer_message("MEMORY TEXT")
        )
        replies = {n: (answers + [eos], True), 1: ([10, 20], False)}  # call 1 runs into its budget: no stop id
        reply, stopped = replies.get(t, ([7 + t, eos], True))
        episode.receive(reply, stopped)
        kept = tuple(reply[:-1] if stopped else reply)
        assert episode.kept_ids == kept
    assert episode.done and episode.kept_ids == tuple(answers)
    assert episode.score(tokenizer.decode(answers)).f1 == 1.0
    with pytest.raises(RuntimeError, match="calls are made"):
        episode.next_call()


def test_call_context_keeps_the_templates_system_prompt_and_kwargs_in_q(tokenizer):
    ctx = _context(tokenizer, QWEN_LIKE, think="<think></think>")
    assert tokenizer.decode(ctx.prefix_ids).startswith(
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user"
    )
    x = ctx.memory_call([5, 6, 7], "Orin is located in Sarnia.", 0, 3)
    assert tokenizer.decode(x).endswith("<|im_start|>assistant\n<think></think>")
    assert tokenizer.decode(ctx.answer_call(())).count(MemoryPrompts().empty_memory) == 1


def test_call_context_refuses_a_template_that_changes_q(tokenizer):
    with pytest.raises(ValueError, match=r"row 3 \(val-3\): the chat template renders the prompt differently"):
        _context(tokenizer, BROKEN).memory_call((), "chunk", 0, 1)


def test_records_reproduce_exactly_what_the_server_received_and_returned(episode_run):
    row, server, _, episode = episode_run
    n = len(row["extra_info"]["chunks"])
    assert len(server.requests) == len(episode.invocations) == n + 1
    for inv, req in zip(episode.invocations, server.requests):
        assert list(inv.prompt_ids) == req["prompt_ids"]
        assert list(inv.response_ids) == req["token_ids"]
        assert list(inv.response_logprobs) == pytest.approx(req["log_probs"])
    assert len({r["request_id"] for r in server.requests}) == 1  # sticky session: prefix-cache reuse of q


def test_q_is_rendered_once_and_shared_token_for_token(tokenizer, episode_run):
    row, server, output, episode = episode_run
    q_text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=False)
    assert list(episode.prefix_ids) == tokenizer.encode(q_text)
    assert output.prompt_ids == list(episode.prefix_ids)
    assert all(r["prompt_ids"][: episode.prefix_len] == output.prompt_ids for r in server.requests)


def test_calls_read_memory_ids_chunk_and_instruction(tokenizer, episode_run):
    row, server, _, episode = episode_run
    prompts, chunks = MemoryPrompts(), row["extra_info"]["chunks"]
    head = tokenizer.encode(f"<|im_start|>user\n{prompts.memory_header}\n")
    for t, inv in enumerate(episode.invocations):
        ctx = list(episode.context_ids(t))
        assert ctx[: len(head)] == head
        previous = episode.invocations[t - 1].memory_ids if t else ()
        memory = list(previous) or tokenizer.encode(prompts.empty_memory)
        assert ctx[len(head) : len(head) + len(memory)] == memory  # the sampled ids themselves, not re-tokenized
        text = tokenizer.decode(ctx[len(head) + len(memory) :])
        if t < len(chunks):
            assert text.startswith(f"\n\nChunk {t + 1} of {len(chunks)}:\n{chunks[t]}\n\n{prompts.write_instruction}")
        else:
            assert text.startswith(f"\n\n{prompts.answer_instruction}")
        assert text.endswith("<|im_start|>assistant\n")


def test_budgets_stop_ids_and_truncation_are_recorded(tokenizer, episode_run):
    row, server, _, episode = episode_run
    eos, n = tokenizer.eos_token_id, len(row["extra_info"]["chunks"])
    budgets = [r["sampling_params"]["max_tokens"] for r in server.requests]
    assert budgets == [12] * n + [40]
    assert all(r["sampling_params"]["stop_token_ids"] == [eos] for r in server.requests)
    assert all(r["sampling_params"]["temperature"] == 1.0 for r in server.requests)
    first, truncated, empty, answer = episode.invocations
    assert (first.finish_reason, first.memory_span) == ("stop", (0, 5))  # memory = response minus eos
    assert (truncated.finish_reason, truncated.memory_span) == ("length", (0, 12))  # kept, marked truncated
    assert truncated.truncated and len(truncated.response_ids) == 12
    assert (empty.finish_reason, empty.memory_span, empty.memory_ids) == ("stop", (0, 0), ())
    assert (answer.finish_reason, answer.memory_span) == ("stop", None)


def test_output_is_the_packed_row_with_documented_extra_fields(episode_run):
    _, _, output, episode = episode_run
    packed = pack_episode(episode)
    assert output.response_ids == list(packed.response_ids)
    assert output.response_mask == list(packed.response_mask)
    assert output.response_logprobs == list(packed.response_logprobs)
    assert sum(output.response_mask) == sum(len(i.response_ids) for i in episode.invocations)
    assert output.extra_fields[POSITION_IDS] == list(packed.position_ids)
    assert output.extra_fields[SEGMENT_IDS] == list(packed.segment_ids)
    assert output.extra_fields[TEACHER_MASK] == list(packed.teacher_mask)
    assert output.num_turns == 2 * len(episode.invocations)
    # what verl's TransferQueue path does with it: as_dict, then one TensorDict row
    td = list_of_dict_to_tensordict([output.as_dict()])
    assert td["responses"][0].tolist() == output.response_ids
    assert td["rm_scores"][0][-1].item() == output.reward_score
    assert td["extra_fields"][0][POSITION_IDS] == list(packed.position_ids)


def test_weight_versions_become_verls_staleness_tags(episode_run):
    _, _, output, episode = episode_run
    assert (output.extra_fields["min_global_steps"], output.extra_fields["max_global_steps"]) == (3, 4)
    assert episode.extra["weight_steps"] == [[3, 3], [3, 3], [4, 4], [4, 4]]


def test_reward_scores_the_final_answer_text(tokenizer, episode_run):
    row, _, output, episode = episode_run
    assert output.reward_score == episode.reward == 1.0
    # the script's last memory call writes nothing (recall 0); call 1 of 3 runs into its budget
    assert output.extra_fields["reward_extra_info"] == {
        "f1": 1.0,
        "em": 1.0,
        "memory_recall": 0.0,
        "memory_truncated": pytest.approx(1 / 3),
    }
    wrong = _run(tokenizer, FakeServer(_script(tokenizer, ["Nowhere", row["reward_model"]["ground_truth"][1][0]])), row)
    assert wrong.reward_score == 0.5 and wrong.extra_fields["reward_extra_info"]["em"] == 0.5


def test_memory_recall_reads_the_memory_the_answer_call_sees(tokenizer):
    row = _row(index=4)
    answers = [a[0] for a in row["reward_model"]["ground_truth"]]
    assert len(set(answers)) == len(answers) == 2, answers  # row 4's two answers differ
    eos = tokenizer.eos_token_id

    def script(t, prompt, max_tokens):  # the last memory call keeps the first answer only, then answers wrongly
        if t < 2:
            return [eos]
        return tokenizer.encode(f"note: {answers[0]}." if t == 2 else format_answers(["x"] * len(answers))) + [eos]

    output = _run(tokenizer, FakeServer(script), row)
    info = output.extra_fields["reward_extra_info"]
    assert info["memory_recall"] == 0.5 and info["f1"] == 0.0
    assert info["memory_truncated"] == 0.0


def test_config_overrides_prompts_and_refuses_unknown_keys(tokenizer):
    cfg = MemoryAgentConfig.from_mapping(OmegaConf.create({"memory_tokens": 7, "prompts": {"memory_header": "Notes:"}}))
    assert cfg.memory_tokens == 7 and cfg.prompts.memory_header == "Notes:" and cfg.answer_tokens == 64
    with pytest.raises(ValueError, match=r"unknown keys \['memory_budget'\]"):
        MemoryAgentConfig.from_mapping({"memory_budget": 3})
    with pytest.raises(ValueError, match=r"prompts: unknown keys \['header'\]"):
        MemoryAgentConfig.from_mapping({"prompts": {"header": "x"}})
    with pytest.raises(ValueError, match="memory_tokens must be >= 1"):
        MemoryAgentConfig(memory_tokens=0)
    server = FakeServer(_script(tokenizer, ["a", "b"]))
    _run(tokenizer, server, _row(), _config(prompts={"memory_header": "Notes:"}))
    assert tokenizer.decode(server.requests[0]["prompt_ids"]).count("Notes:\n(empty)") == 1


@pytest.mark.parametrize("key", DATA_FIELDS)
def test_config_refuses_the_prompt_fields_that_live_in_the_data(key):
    # q (task text + questions) comes from the dataset row: a run-time value would be ignored silently
    with pytest.raises(ValueError, match=rf"memopd.agent.prompts.{key}: not a run-time option .*dataset row.*--task"):
        MemoryAgentConfig.from_mapping({"prompts": {key: "Read carefully."}})
    assert set(DATA_FIELDS) | set(CALL_FIELDS) == {f.name for f in fields(MemoryPrompts)}
    assert not set(DATA_FIELDS) & set(CALL_FIELDS)


def test_generation_config_eos_ids_are_stop_ids(tokenizer, tmp_path):
    from transformers import GenerationConfig

    GenerationConfig(eos_token_id=[tokenizer.eos_token_id, 7]).save_pretrained(tmp_path)
    config = _config()
    config.actor_rollout_ref.model = {"path": str(tmp_path)}
    server = FakeServer(lambda t, prompt, max_tokens: _filler(prompt, 3) + [7])
    episode = Episode.from_dict(_run(tokenizer, server, _row(), config).extra_fields[EPISODE])
    assert all(r["sampling_params"]["stop_token_ids"] == [tokenizer.eos_token_id, 7] for r in server.requests)
    assert all(i.finish_reason == "stop" and i.response_ids[-1] == 7 for i in episode.invocations)
    assert episode.invocations[0].memory_span == (0, 3)


def test_malformed_row_fails_naming_the_row(tokenizer):
    row = _row()
    row["extra_info"]["chunks"][1] = ""
    with pytest.raises(ValueError, match=r"row 3 \(val-3\): extra_info.chunks\[1\] is empty"):
        _run(tokenizer, FakeServer(_script(tokenizer, ["a", "b"])), row)


@pytest.mark.parametrize(
    "case,error,match",
    [
        ("no_logprobs", RuntimeError, "calculate_log_probs=True"),
        ("unknown_stop", RuntimeError, "not a stop id"),
        ("short_response_length", ValueError, "response_length >= "),
    ],
)
def test_rollout_problems_fail_loudly(tokenizer, case, error, match):
    row = _row()
    server = FakeServer(_script(tokenizer, ["a", "b"]), with_logprobs=case != "no_logprobs")
    if case == "unknown_stop":  # the model stopped early on a token the agent does not know as a stop id
        server.script = lambda t, prompt, max_tokens: _filler(prompt, 3)
    config = _config()
    if case == "short_response_length":
        config.actor_rollout_ref.rollout.response_length = 100
    with pytest.raises(error, match=match):
        _run(tokenizer, server, row, config)


class StalledServer(FakeServer):
    """Answers its first ``answered`` calls at once, later ones only after ``stall_s`` (an engine that died under
    the server; bounded, so that a loop without a timeout fails the test instead of hanging it)."""

    def __init__(self, script, answered, stall_s=30.0):
        super().__init__(script)
        self.answered, self.stall_s = answered, stall_s

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        if len(self.requests) >= self.answered:
            await asyncio.sleep(self.stall_s)
        return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)


def test_a_call_the_server_never_answers_fails_the_episode_naming_it(tokenizer):
    row = _row()
    server = StalledServer(_script(tokenizer, ["a", "b"]), answered=2)
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"row 3 \(val-3\) call 2: no reply .* memopd.agent.call_timeout_s=0.2 s"):
        _run(tokenizer, server, row, _config(call_timeout_s=0.2))
    assert len(server.requests) == 2 and time.perf_counter() - t0 < server.stall_s
    with pytest.raises(ValueError, match="call_timeout_s must be >= 0"):
        MemoryAgentConfig.from_mapping({"call_timeout_s": -1})


def test_converted_rows_make_one_memory_call_per_chunk_and_score_aliases(tokenizer):
    """Your own data (tasks convert): each chunk is one memory call's text; any alias scores F1 1."""
    row = _converted_rows(tokenizer, 1)[0]
    chunks, aliases = row["extra_info"]["chunks"], row["reward_model"]["ground_truth"][0]
    eos = tokenizer.eos_token_id

    def script(t, prompt, max_tokens):  # memory calls write 3 tokens; the answer call gives the second alias
        return _filler(prompt, 3) + [eos] if t < len(chunks) else tokenizer.encode(format_answers(aliases[-1:])) + [eos]

    server = FakeServer(script)
    output = _run(tokenizer, server, row)
    assert len(chunks) > 2 and len(server.requests) == len(chunks) + 1
    for t, chunk in enumerate(chunks):
        assert f"Chunk {t + 1} of {len(chunks)}:\n{chunk}\n\n" in tokenizer.decode(server.requests[t]["prompt_ids"])
    assert output.reward_score == 1.0 and len(aliases) == 2


def _converted_rows(tokenizer, n, chunk_tokens=32):
    """Rows of ``python -m verl_memopd.tasks convert`` from MemAgent-style records (fixtures/longqa.py)."""
    from fixtures.longqa import memagent_eval_records

    from verl_memopd.tasks.convert import convert_records

    result = convert_records(memagent_eval_records(n), tokenizer, chunk_tokens, "memagent")
    assert not result.refusals
    return list(result.rows)


# --- real vLLM CPU rollouts through verl's own server (slow) --------------------------------
# The rollout runs in a subprocess (this file's __main__ block): verl resolves its platform once
# per process and vLLM/Ray want a clean process, so VERL_PLATFORM=cpu is set before verl loads.
# It runs on the CPU platform (``+profile=cpu``, ``verl_memopd.experiment.launching.cpu_env``) with the tiny student.
VLLM_BUDGETS = {"memory_tokens": 24, "answer_tokens": 16}
VLLM_EPISODES = 6
VLLM_CONVERTED = 2  # episodes of converted MemAgent-style rows (tasks convert), run on the same server


def _vllm_rollout(model: str, out: str) -> None:
    """Start verl's standalone vLLM server on the tiny model; run episodes; dump records + requests."""
    import json
    import os
    import time

    import ray
    import verl
    from hydra import compose, initialize_config_dir
    from transformers import AutoTokenizer
    from verl.workers.rollout.llm_server import LLMServerManager

    overrides = [
        f"actor_rollout_ref.rollout.{k}"
        for k in (
            "max_model_len=1024",
            "max_num_seqs=8",
            "max_num_batched_tokens=1024",
            "prompt_length=256",
            "response_length=2048",
            "load_format=auto",
            "nnodes=1",
        )
    ]  # load_format: no trainer pushes weights
    with initialize_config_dir(
        config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer/config"), version_base=None
    ):
        config = compose(
            config_name="ppo_trainer",
            overrides=overrides
            + [
                "+profile=cpu",
                f"actor_rollout_ref.model.path={model}",
                *(f"+memopd.agent.{k}={v}" for k, v in VLLM_BUDGETS.items()),
            ],
        )
    env = {
        k: os.environ[k]
        for k in (
            "VERL_PLATFORM",
            "VLLM_CPU_KVCACHE_SPACE",
            "HF_HUB_OFFLINE",
            "TRANSFORMERS_OFFLINE",
            "TOKENIZERS_PARALLELISM",
        )
    }
    ray_init = {k: v for k, v in OmegaConf.to_container(config.ray_kwargs.ray_init).items() if v is not None}
    ray.init(**{**ray_init, "runtime_env": {"env_vars": env}})
    try:
        t0 = time.perf_counter()
        manager = LLMServerManager.create(config=config, worker_group=None, rollout_resource_pool=None)  # auto_await
        startup_s = time.perf_counter() - t0
        tokenizer = AutoTokenizer.from_pretrained(model)
        rows = [_row(i) for i in range(VLLM_EPISODES)]
        stop_ids = list(range(3, len(tokenizer), 4))  # many stop ids: forces early "stop" calls on a random model
        runs = {}
        for name, agent in (("warmup", {}), ("eos", {}), ("many_stops", {"stop_token_ids": stop_ids})):
            cfg = copy.deepcopy(config)
            cfg.memopd.agent = {**VLLM_BUDGETS, **agent}
            server = RecordingClient(manager.get_client())
            t0 = time.perf_counter()
            outputs = asyncio.run(_episodes(tokenizer, server, rows, cfg))
            runs[name] = {
                "seconds": time.perf_counter() - t0,
                "requests": server.requests,
                "stop_ids": stop_ids,
                "episodes": [o.extra_fields[EPISODE] for o in outputs],
            }
        converted = _converted_rows(tokenizer, VLLM_CONVERTED, chunk_tokens=48)  # your own data, same server
        server = RecordingClient(manager.get_client())
        outputs = asyncio.run(_episodes(tokenizer, server, converted, config))
        runs_converted = {
            "rows": converted,
            "requests": server.requests,
            "episodes": [o.extra_fields[EPISODE] for o in outputs],
        }
    finally:
        ray.shutdown()
    with open(out, "w") as f:
        json.dump(
            {"startup_s": startup_s, "eos_id": tokenizer.eos_token_id, "runs": runs, "converted": runs_converted}, f
        )


class RecordingClient:
    """Wraps verl's LLMServerClient and records what was sent to and returned by the server."""

    def __init__(self, client):
        self.client, self.requests = client, []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        out = await self.client.generate(
            request_id, prompt_ids=list(prompt_ids), sampling_params=dict(sampling_params), **kwargs
        )
        self.requests.append(
            {
                "request_id": request_id,
                "prompt_ids": list(prompt_ids),
                "sampling_params": dict(sampling_params),
                "token_ids": list(out.token_ids),
                "log_probs": list(out.log_probs),
            }
        )
        return out


async def _episodes(tokenizer, server, rows, config):
    async def one(row):
        loop = hydra.utils.instantiate(
            _agent_loop_registry[AGENT_NAME],
            trainer_config=DictConfigWrap(config),
            server_manager=server,
            tokenizer=tokenizer,
            processor=None,
            dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(config.data),
        )
        return await loop.run(
            dict(SAMPLING),
            raw_prompt=row["prompt"],
            extra_info=row["extra_info"],
            reward_model=row["reward_model"],
            data_source=row["data_source"],
            uid=row["data_source"],
        )

    return await asyncio.gather(*[one(row) for row in rows])


@pytest.fixture(scope="module")
def vllm_runs(tiny_models, tmp_path_factory):
    import json
    import subprocess
    import sys

    from verl_memopd.experiment.launching import cpu_env

    tmp = tmp_path_factory.mktemp("vllm")
    out = tmp / "runs.json"
    proc = subprocess.run(
        [sys.executable, __file__, str(tiny_models.student), str(out)],
        env=cpu_env(tmp),
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(tiny_models.student), json.loads(out.read_text())


def _by_request(run):
    grouped = {}
    for r in run["requests"]:
        grouped.setdefault(r["request_id"], []).append(r)
    return list(grouped.values())


@pytest.mark.slow
def test_vllm_records_match_the_server_and_budgets_hold(vllm_runs):
    _, data = vllm_runs
    for name, run in data["runs"].items():
        episodes = [Episode.from_dict(e) for e in run["episodes"]]
        requests = _by_request(run)
        assert len(episodes) == len(requests) == VLLM_EPISODES
        stop = set(run["stop_ids"]) if name == "many_stops" else set()
        for episode in episodes:  # match each episode to its session by the first prompt
            session = next(s for s in requests if s[0]["prompt_ids"] == list(episode.invocations[0].prompt_ids))
            assert len(session) == len(episode.invocations)
            for t, (inv, req) in enumerate(zip(episode.invocations, session)):
                assert list(inv.prompt_ids) == req["prompt_ids"] and list(inv.response_ids) == req["token_ids"]
                assert list(inv.response_logprobs) == pytest.approx(req["log_probs"], abs=1e-6)
                budget = VLLM_BUDGETS["answer_tokens" if t == len(session) - 1 else "memory_tokens"]
                assert req["sampling_params"]["max_tokens"] == budget and len(inv.response_ids) <= budget
                if inv.finish_reason == "length":
                    assert len(inv.response_ids) == budget
                else:  # vLLM returns the stop token itself; memory excludes it
                    assert inv.response_ids[-1] in stop | {data["eos_id"]}
                    assert inv.memory_span in (None, (0, len(inv.response_ids) - 1))
            pack_episode(episode)
        if name == "many_stops":
            assert sum(i.finish_reason == "stop" for e in episodes for i in e.invocations) > 0


@pytest.mark.slow
def test_vllm_rollout_logprobs_are_the_models_logprobs_of_the_recorded_state(vllm_runs):
    """Scoring each recorded call alone with Hugging Face reproduces vLLM's rollout log-probs (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model_path, data = vllm_runs
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    episode = Episode.from_dict(data["runs"]["many_stops"]["episodes"][0])
    for inv in episode.invocations:
        ids = torch.tensor([inv.prompt_ids + inv.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(inv.prompt_ids) - 1 : -1]
        hf = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(inv.response_ids)[:, None])[:, 0]
        assert torch.allclose(hf, torch.tensor(inv.response_logprobs), atol=1e-3), (
            (hf - torch.tensor(inv.response_logprobs)).abs().max()
        )


@pytest.mark.slow
def test_vllm_runs_converted_rows_one_memory_call_per_chunk(vllm_runs):
    """Converted MemAgent-style rows through vLLM-CPU: every chunk read in its own call, recorded exactly."""
    from transformers import AutoTokenizer

    model_path, data = vllm_runs
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    run = data["converted"]
    sessions = _by_request(run)
    assert len(run["episodes"]) == len(sessions) == VLLM_CONVERTED
    for row, raw in zip(run["rows"], run["episodes"]):  # asyncio.gather keeps the rows' order
        episode, chunks = Episode.from_dict(raw), row["extra_info"]["chunks"]
        session = next(s for s in sessions if s[0]["prompt_ids"] == list(episode.invocations[0].prompt_ids))
        assert len(episode.invocations) == len(session) == len(chunks) + 1 and len(chunks) > 2
        for inv, req in zip(episode.invocations, session):
            assert list(inv.prompt_ids) == req["prompt_ids"] and list(inv.response_ids) == req["token_ids"]
        for t, chunk in enumerate(chunks):
            text = tokenizer.decode(episode.invocations[t].prompt_ids)
            assert f"Chunk {t + 1} of {len(chunks)}:\n{chunk}\n\n" in text
        assert 0.0 <= episode.reward <= 1.0 and episode.extra["answer"] is not None
        pack_episode(episode)


@pytest.mark.slow
def test_vllm_rollout_throughput(vllm_runs, capsys):
    _, data = vllm_runs
    run = data["runs"]["eos"]  # the second pass over the same rows (the first one warms the server up)
    episodes = [Episode.from_dict(e) for e in run["episodes"]]
    sampled = sum(len(i.response_ids) for e in episodes for i in e.invocations)
    prompt = sum(len(i.prompt_ids) for e in episodes for i in e.invocations)
    with capsys.disabled():
        print(
            f"\nvLLM CPU rollout (tiny preset, {len(episodes)} episodes, {len(episodes[0].invocations)} calls each): "
            f"server start {data['startup_s']:.0f}s; {len(episodes) / run['seconds']:.2f} episodes/s, "
            f"{sampled / run['seconds']:.0f} sampled tok/s, {prompt / run['seconds']:.0f} prompt tok/s"
        )
    assert sampled > 0 and all(0.0 <= e.reward <= 1.0 for e in episodes)


if __name__ == "__main__":
    import sys

    _vllm_rollout(*sys.argv[1:3])


def _seeds(tokenizer, config=None, **run_kwargs):
    row = _row()
    server = FakeServer(_script(tokenizer, [a[0] for a in row["reward_model"]["ground_truth"]]))
    _run(tokenizer, server, row, config, **run_kwargs)
    return [r["sampling_params"].get("seed") for r in server.requests]


def test_calls_get_reproducible_seeds_per_step_sample_and_call(tokenizer):
    first = _seeds(tokenizer, global_steps=3, session_id=0)
    assert len(set(first)) == len(first) and all(isinstance(s, int) and 0 <= s < 2**63 for s in first)
    assert _seeds(tokenizer, global_steps=3, session_id=0) == first  # a resumed run samples the same
    assert set(_seeds(tokenizer, global_steps=3, session_id=1)).isdisjoint(first)  # the n samples differ
    assert set(_seeds(tokenizer, global_steps=4, session_id=0)).isdisjoint(first)  # so do steps
    assert _seeds(tokenizer, global_steps=3) == [None] * len(first)  # no sample index: not seeded
    assert _seeds(tokenizer, _config(seed_requests=False), global_steps=3, session_id=0) == [None] * len(first)
