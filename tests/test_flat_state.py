"""The memory agent acting in the flat state (``hf_agent.agent_calls(state="flat")``) and the F1 by state
(``heldout.state_f1``): at call t the model reads the persistent history of its calls 0..t-1, separated as the flat
arm's trainer separates it, then call t's context; its input is the ``flat`` layout's row of the same calls up to
``a_t``, which the persistent-history teacher scores. Tiny models, the ``tiny`` task preset.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from verl_memopd.agent.context import CallContext
from verl_memopd.experiment.config import Paths
from verl_memopd.experiment.launch import AGENT_TOKENS
from verl_memopd.packing import LayoutOptions, build_layout
from verl_memopd.records import Episode, Invocation
from verl_memopd.tasks.prompts import MemoryPrompts
from verl_memopd.trainer.teacher import flat_separator_ids

TOKENS = {"memory_tokens": 16, "answer_tokens": 8}


@pytest.fixture(scope="module")
def val_file(tmp_path_factory):
    """4 val episodes of the ``tiny`` preset."""
    out = tmp_path_factory.mktemp("flat_state")
    cmd = [sys.executable, "-m", "verl_memopd.tasks", "build", "--out", str(out), "--preset", "tiny"]
    subprocess.run(cmd + ["--n-train", "4", "--n-val", "4", "--n-test", "4"], check=True, capture_output=True)
    return out / "val.parquet"


def _sep(tok):
    return flat_separator_ids(None, tok, len(tok))  # what the flat arm's trainer resolves: ChatML's "\n"


# --- the flat-state agent ----------------------------------------------------------------------------
class _Recording:
    """A model that records the unpadded inputs ``generate`` is given, and generates with the wrapped model."""

    def __init__(self, model):
        self.model, self.generation_config, self.inputs = model, model.generation_config, []

    def generate(self, ids, attention_mask, **kwargs):
        self.inputs += [row[mask.bool()].tolist() for row, mask in zip(ids, attention_mask)]
        return self.model.generate(ids, attention_mask=attention_mask, **kwargs)


@pytest.fixture(scope="module")
def val_rows(val_file):
    frame = pd.read_parquet(val_file)
    return [frame.iloc[i].to_dict() for i in range(len(frame))]


def test_the_flat_state_agent_reads_the_flat_history_of_its_earlier_calls(val_rows, tiny_models):
    from verl_memopd.experiment.hf_agent import agent_calls, load_model

    model, tokenizer = load_model(tiny_models.teacher)
    recording, sep = _Recording(model), _sep(tokenizer)
    episodes = agent_calls(val_rows, [recording], tokenizer, batch=3, state="flat", separator=sep, **TOKENS)
    stop = {tokenizer.eos_token_id}
    sent = iter(recording.inputs)  # batch by batch, call by call, episode by episode
    order = [(b, t, i) for b in range(0, 4, 3) for t in range(len(episodes[0].calls)) for i in range(b, min(b + 3, 4))]
    inputs = {(i, t): next(sent) for _, t, i in order}
    for i, (row, episode) in enumerate(zip(val_rows, episodes)):
        ctx, chunks = CallContext(tokenizer, list(row["prompt"]), MemoryPrompts()), list(row["extra_info"]["chunks"])
        invocations, memory = [], ()
        for t, call in enumerate(episode.calls):  # the aligned-state record of the same calls: q + x_t, a_t
            x = ctx.memory_call(memory, chunks[t], t, len(chunks)) if t < len(chunks) else ctx.answer_call(memory)
            invocations.append(Invocation(ctx.prefix_ids + x, call.response_ids, (0.0,) * len(call.response_ids)))
            memory = call.response_ids[:-1] if call.response_ids[-1] in stop else call.response_ids
        record = Episode("e", "e", ctx.prefix_ids, tuple(invocations))
        layout = build_layout("flat", [record], len(tokenizer), LayoutOptions(flat_separator_ids=sep))
        flat_row = layout.input_ids[0, : int(layout.valid_mask[0].sum())].tolist()
        firsts = [
            j + 1 for j in range(len(flat_row) - 1) if layout.action_mask[0, j] and not layout.action_mask[0, j - 1]
        ]
        for t, call in enumerate(episode.calls):
            start = firsts[t]  # where a_t begins in the flat row: the input before it is the history, then x_t
            assert inputs[(i, t)] == flat_row[:start] == list(call.prompt_ids), f"episode {i} call {t}"
            assert flat_row[start : start + len(call.response_ids)] == list(call.response_ids)
        assert 0.0 <= episode.f1 <= 1.0


def test_the_aligned_state_is_the_default_and_an_unknown_state_is_refused(val_rows, tiny_models):
    from verl_memopd.experiment.hf_agent import agent_calls, load_model

    model, tokenizer = load_model(tiny_models.student)
    rows = val_rows[:2]
    assert agent_calls(rows, [model], tokenizer, state="aligned", **TOKENS) == agent_calls(
        rows, [model], tokenizer, **TOKENS
    )
    first_calls = [
        e.calls[0] for e in agent_calls(rows, [model], tokenizer, state="flat", separator=_sep(tokenizer), **TOKENS)
    ]
    assert first_calls == [
        e.calls[0] for e in agent_calls(rows, [model], tokenizer, **TOKENS)
    ]  # call 0: q + x_0 in both
    with pytest.raises(ValueError, match=r"state='persistent', expected one of \('aligned', 'flat'\)"):
        agent_calls(rows, [model], tokenizer, state="persistent", **TOKENS)


def test_state_f1_reports_each_state_saves_each_and_resumes(val_file, tiny_models, tmp_path, monkeypatch):
    from verl_memopd.experiment import heldout, hf_agent

    paths = Paths(tmp_path / "runs", tmp_path / "results")
    paths.data.mkdir(parents=True)
    paths.evals().mkdir(parents=True)
    shutil.copy(val_file, paths.data / "val.parquet")
    real, ran = hf_agent.agent_calls, []

    class Stopped(Exception):
        pass

    def counted(*args, **kwargs):
        ran.append(kwargs["state"])
        if kwargs["state"] == "flat" and ran.count("flat") == 1:
            raise Stopped  # the first run is stopped during its flat pass
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_agent, "agent_calls", counted)
    with pytest.raises(Stopped):
        heldout.state_f1(paths, "teacher_flat", tiny_models.teacher, 40, "val")
    assert list(json.loads((paths.evals() / "state_teacher_flat_val.partial.json").read_text())) == ["aligned"]
    result = heldout.state_f1(paths, "teacher_flat", tiny_models.teacher, 40, "val")
    assert ran == ["aligned", "flat", "flat"]  # resumed at the flat state
    model, tokenizer = hf_agent.load_model(tiny_models.teacher)
    rows = heldout._split_rows(paths, "val")
    for state, batch in heldout.STATE_BATCH.items():
        direct = real(rows, [model], tokenizer, batch=batch, state=state, separator=_sep(tokenizer), **AGENT_TOKENS)
        assert result["episodes"][state] == [e.f1 for e in direct]
        assert result["f1"][state] == pytest.approx(sum(e.f1 for e in direct) / len(direct))
    assert (result["model"], result["step"], result["split"], result["separator"]) == (
        "teacher_flat",
        40,
        "val",
        list(_sep(tokenizer)),
    )
    assert not (paths.evals() / "state_teacher_flat_val.partial.json").exists()
    assert heldout.state_f1(paths, "teacher_flat", Path("not-loaded"), 40, "val") == result  # cached
