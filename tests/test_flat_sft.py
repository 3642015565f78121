"""The persistent-history teacher's SFT (``experiment/flat_sft.py``) and its F1 by state (``hf_agent``, ``heldout``).

The flat rows must be what the flat teacher scores: the engine's flat pass (``streams.flat_history`` on the packed row,
separated as the trainer resolves it) over the calls the agent would have sent had it written the oracle's replies,
with the loss exactly on the action tokens; verl's SFT trainer must read them as they are. The flat-state agent's input
at call t must be that history. Tiny ChatML tokenizer and models, the ``tiny`` task preset.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch

from verl_memopd.agent.context import CallContext
from verl_memopd.bench.tiny import build_tokenizer
from verl_memopd.experiment.config import ExperimentConfig, Paths, SftConfig, full_config
from verl_memopd.experiment.flat_sft import TokenRowsDataset, build_token_rows, token_rows
from verl_memopd.fields import CALL_INDEX, POSITION_IDS, SEGMENT_IDS, TEACHER_MASK
from verl_memopd.packing import LayoutOptions, build_layout, pack_episode
from verl_memopd.records import Episode, Invocation
from verl_memopd.streams import flat_history
from verl_memopd.tasks.prompts import MemoryPrompts
from verl_memopd.trainer.rows import layout_fields
from verl_memopd.trainer.teacher import flat_separator_ids

TOKENS = {"memory_tokens": 16, "answer_tokens": 8}
NO_PADDING = {"max_length": 4096, "pad_mode": "no_padding"}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """``data/{train,val}.parquet`` (4 tiny episodes each) and the oracle's traces ``sft_data/{train,val}.parquet``."""
    from verl_memopd.experiment.sft import build_sft_data

    root = tmp_path_factory.mktemp("flat_sft")
    cmd = [sys.executable, "-m", "verl_memopd.tasks", "build", "--out", str(root / "data"), "--preset", "tiny"]
    subprocess.run(cmd + ["--n-train", "4", "--n-val", "4", "--n-test", "4"], check=True, capture_output=True)
    build_sft_data(root / "data", root / "sft_data")
    return root


def _sep(tok):
    return flat_separator_ids(None, tok, len(tok))  # what the flat arm's trainer resolves: ChatML's "\n"


def _agent_episode(row: dict, replies: list[str], tok) -> Episode:
    """The episode the agent records if the model writes ``replies``: built here with ``CallContext`` alone (memory =
    the previous reply's ids), not with ``flat_sft``'s code."""
    ctx, chunks = CallContext(tok, list(row["prompt"]), MemoryPrompts()), list(row["extra_info"]["chunks"])
    invocations, memory = [], ()
    for t, reply in enumerate(replies):
        x = ctx.memory_call(memory, chunks[t], t, len(chunks)) if t < len(chunks) else ctx.answer_call(memory)
        memory = tuple(tok.encode(reply, add_special_tokens=False))
        response = memory + (tok.eos_token_id,)
        invocations.append(Invocation(ctx.prefix_ids + x, response, (0.0,) * len(response)))
    return Episode("e", "e", ctx.prefix_ids, tuple(invocations))


def _engine_flat_stream(episode: Episode, separator) -> tuple[list[int], list[int]]:
    """The teacher engine's flat pass over the episode's packed row, as the trainer feeds it (``rows.layout_fields``,
    ``streams.flat_history``): the stream's ids, and the stream positions of the action tokens."""
    row = pack_episode(episode)
    extras = {POSITION_IDS: row.position_ids, SEGMENT_IDS: row.segment_ids, TEACHER_MASK: row.teacher_mask}
    fields = layout_fields(len(row.prompt_ids), len(row.response_ids), extras, "flat", "row")
    inputs, index = flat_history([torch.tensor(row.prompt_ids + row.response_ids)], [fields[CALL_INDEX]], separator)
    acts = [len(row.prompt_ids) + j for j, m in enumerate(row.response_mask) if m]
    return inputs["input_ids"][0].tolist(), index[acts].tolist()


def _oracle_replies(task_dir: Path, split: str = "train") -> tuple[list[dict], dict[str, list[str]]]:
    frame = pd.read_parquet(task_dir / "data" / f"{split}.parquet")
    traces = pd.read_parquet(task_dir / "sft_data" / f"{split}.parquet")
    replies = {
        str(eid): [m[-1]["content"] for m in group.sort_values("call")["messages"]]
        for eid, group in traces.groupby("episode_id")
    }
    return [frame.iloc[i].to_dict() for i in range(len(frame))], replies


# --- rows ------------------------------------------------------------------------------------------
def test_a_flat_row_is_the_engine_flat_pass_token_for_token_with_the_loss_on_the_replies(task_dir, tok):
    sep = _sep(tok)
    assert sep == tuple(tok.encode("\n", add_special_tokens=False))
    rows = build_token_rows(task_dir / "data/train.parquet", task_dir / "sft_data/train.parquet", tok, sep)
    frame, replies = _oracle_replies(task_dir)
    flat = [r for r in rows if r["state"] == "flat"]
    assert len(flat) == len(frame) == 4
    for data_row, row in zip(frame, flat):
        eid = data_row["extra_info"]["episode_id"]
        assert row["episode_id"] == eid and row["call"] == -1
        ids, targets = _engine_flat_stream(_agent_episode(data_row, replies[eid], tok), sep)
        assert row["input_ids"] == ids  # token for token
        assert [j for j, m in enumerate(row["loss_mask"]) if m] == targets  # the loss exactly on the action tokens
        loss_text = tok.decode([i for i, m in zip(row["input_ids"], row["loss_mask"]) if m])
        assert loss_text == "".join(r + "<|im_end|>" for r in replies[eid])  # each reply and its stop id, nothing else


def test_per_call_rows_are_the_calls_as_the_agent_sends_them(task_dir, tok):
    rows = build_token_rows(
        task_dir / "data/train.parquet", task_dir / "sft_data/train.parquet", tok, _sep(tok), aligned_share=1.0
    )
    frame, replies = _oracle_replies(task_dir)
    data_row = frame[0]
    episode = _agent_episode(data_row, replies[data_row["extra_info"]["episode_id"]], tok)
    aligned = [r for r in rows if r["state"] == "aligned" and r["episode_id"] == data_row["extra_info"]["episode_id"]]
    assert [r["call"] for r in aligned] == list(range(len(episode.invocations)))
    for r, inv in zip(aligned, episode.invocations):
        assert r["input_ids"] == list(inv.prompt_ids + inv.response_ids)
        assert r["loss_mask"] == [0] * len(inv.prompt_ids) + [1] * len(inv.response_ids)


def test_the_aligned_share_picks_a_seeded_subset_of_each_episodes_calls(tok):
    q = (1, 2, 3)
    calls = tuple(Invocation(q + (4, 5 + t), (6, 7), (0.0, 0.0)) for t in range(8))
    episode = Episode("e", "e", q, calls)
    rows = token_rows(episode, "h12/train-3", (9,), 20, aligned_share=0.25)
    assert [r["state"] for r in rows] == ["flat", "aligned", "aligned"]  # ceil(0.25 * 8) = 2
    assert rows == token_rows(episode, "h12/train-3", (9,), 20, aligned_share=0.25)  # the same sample every time
    assert [r["call"] for r in token_rows(episode, "e", (9,), 20, 1.0)[1:]] == list(range(8))
    assert len(token_rows(episode, "e", (9,), 20, 0.0)) == 1
    with pytest.raises(ValueError, match=r"aligned_share=1.5: must lie in \[0, 1\]"):
        token_rows(episode, "e", (9,), 20, 1.5)


def test_traces_that_do_not_match_the_episode_are_refused_naming_the_record(task_dir, tok, tmp_path):
    traces = pd.read_parquet(task_dir / "sft_data/train.parquet")
    bad = traces.copy()
    first = [dict(m) for m in bad.loc[1, "messages"]]  # call 1 of the first episode: another memory in its message
    first[-2]["content"] = first[-2]["content"].replace("Memory:", "Memory: tampered", 1)
    bad.at[1, "messages"] = first
    bad.to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"train.parquet row 0 \(train-0\) call 1: the traces' user message"):
        build_token_rows(task_dir / "data/train.parquet", tmp_path / "bad.parquet", tok, _sep(tok))
    traces[traces["episode_id"] != "train-2"].to_parquet(tmp_path / "missing.parquet")
    with pytest.raises(KeyError, match=r"no oracle calls of episode 'train-2'"):
        build_token_rows(task_dir / "data/train.parquet", tmp_path / "missing.parquet", tok, _sep(tok))


def test_verls_multi_turn_dataset_would_put_the_loss_on_the_separators(task_dir, tok, tmp_path):
    """Why the rows are pre-tokenized: verl's MultiTurnSFTDataset renders the same calls as one conversation with the
    right ids here, but trains on every turn's closing "\\n" (the separator the flat layout masks) and one more."""
    from omegaconf import OmegaConf
    from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset

    (flat, *_) = build_token_rows(task_dir / "data/train.parquet", task_dir / "sft_data/train.parquet", tok, _sep(tok))
    traces = pd.read_parquet(task_dir / "sft_data/train.parquet")
    calls = traces[traces["episode_id"] == flat["episode_id"]].sort_values("call")["messages"]
    messages = [dict(m) for m in calls.iloc[0][:-2]] + [dict(m) for ms in calls for m in ms[-2:]]
    pd.DataFrame({"messages": [messages]}).to_parquet(tmp_path / "conversation.parquet")
    verl = MultiTurnSFTDataset(str(tmp_path / "conversation.parquet"), tok, OmegaConf.create(NO_PADDING))[0]
    n = len(flat["input_ids"])
    assert verl["input_ids"][:n].tolist() == flat["input_ids"] and verl["input_ids"][n:].tolist() == list(_sep(tok))
    extra = [j for j in range(n) if verl["loss_mask"][j] and not flat["loss_mask"][j]]
    assert [tok.decode([flat["input_ids"][j]]) for j in extra] == ["\n"] * (len(calls) - 1)


# --- the dataset verl's SFT trainer reads ----------------------------------------------------------
def _write(rows, path):
    pd.DataFrame(rows).to_parquet(path)
    return path


def test_verls_sft_trainer_loads_the_rows_unchanged_and_its_loss_mask_is_the_action_mask(task_dir, tok, tmp_path):
    """The stage's own command (``sft_command`` + the stage overrides) composed by Hydra into verl's SFT config; verl's
    ``create_sft_dataset`` loads the class by the command's ``data.custom_cls``; verl's collator and the roll its
    ``sft_loss`` applies put the loss on the flat layout's action positions."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from verl.trainer.sft_trainer import create_sft_dataset
    from verl.utils.dataset.dataset_utils import SFTTensorCollator

    from verl_memopd.experiment.flat_sft import _stage_overrides
    from verl_memopd.experiment.sft import sft_command

    rows = build_token_rows(task_dir / "data/train.parquet", task_dir / "sft_data/train.parquet", tok, _sep(tok))
    data = tmp_path / "data"
    data.mkdir()
    _write(rows, data / "train.parquet")
    _write(rows[:2], data / "val.parquet")
    sft = SftConfig(steps=2, batch=4, lr=1e-5, save_every=2, max_length=1024)
    cmd = sft_command(tmp_path / "m", data, tmp_path / "run", sft, "t", _stage_overrides(sft.max_length))
    overrides = cmd[cmd.index("verl.trainer.sft_trainer") + 1 :]
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        config = compose("sft_trainer_engine", overrides=overrides)
    GlobalHydra.instance().clear()
    assert (config.data.max_length, config.data.max_token_len_per_gpu, config.data.pad_mode) == (
        1024,
        1024,
        "no_padding",
    )
    dataset = create_sft_dataset(config.data.train_files, config.data, tok, None)
    assert isinstance(dataset, TokenRowsDataset) and len(dataset) == len(rows)
    batch = SFTTensorCollator(config.data.pad_mode)([dataset[i] for i in range(len(rows))])
    assert batch["input_ids"].values().tolist() == [i for r in rows for i in r["input_ids"]]
    assert batch["position_ids"].values().tolist() == [j for r in rows for j in range(len(r["input_ids"]))]
    rolled = torch.roll(batch["loss_mask"].values(), shifts=-1, dims=0)  # verl's sft_loss: mask j -> logits j - 1
    flat = [r for r in rows if r["state"] == "flat"]
    layout = build_layout("flat", [_agent_episode(*x, tok) for x in _episodes(task_dir, flat)], len(tok), _opts(tok))
    want = [layout.action_mask[b, : len(r["input_ids"])].int().tolist() for b, r in enumerate(flat)]
    starts = torch.tensor([0] + [len(r["input_ids"]) for r in rows]).cumsum(0).tolist()
    got = [rolled[starts[i] : starts[i + 1]].tolist() for i, r in enumerate(rows) if r["state"] == "flat"]
    assert got == want


def _opts(tok):
    return LayoutOptions(flat_separator_ids=_sep(tok))


def _episodes(task_dir, flat_rows):
    frame, replies = _oracle_replies(task_dir)
    by_id = {r["extra_info"]["episode_id"]: r for r in frame}
    return [(by_id[r["episode_id"]], replies[r["episode_id"]]) for r in flat_rows]


@pytest.mark.parametrize(
    "ids, mask, config, match",
    [
        ([5, 6, 7], [0, 1, 1], {"max_length": 2}, r"x.parquet row 0 \(e\): 3 tokens > data.max_length=2"),
        ([5, 6, 7], [0, 1], {}, "loss_mask has 2 entries for 3 input_ids"),
        ([5, 6, 7], [1, 1, 1], {}, "not token 0"),
        ([5, 6, 7], [0, 2, 1], {}, "must be 0/1"),
        ([5, 6, 7], [0, 0, 0], {}, "at least one token"),
        ([5, 6, 99999], [0, 1, 1], {}, r"input_ids outside the vocabulary \[0, 1374\)"),
        ([5, 6, 7], [0, 1, 1], {"truncation": "left"}, "data.truncation='left', must be 'error'"),
        ([5, 6, 7], [0, 1, 1], {"pad_mode": "left_right"}, "data.pad_mode='left_right'"),
    ],
)
def test_the_dataset_refuses_bad_rows_naming_the_record(tok, tmp_path, ids, mask, config, match):
    path = _write(
        [{"episode_id": "e", "state": "flat", "call": -1, "input_ids": ids, "loss_mask": mask}], tmp_path / "x.parquet"
    )
    with pytest.raises(ValueError, match=match):
        TokenRowsDataset(str(path), tok, config)


def test_right_padding_pads_every_field_to_max_length(tok, tmp_path):
    path = _write(
        [{"episode_id": "e", "state": "flat", "call": -1, "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}],
        tmp_path / "x.parquet",
    )
    item = TokenRowsDataset(str(path), tok, {"pad_mode": "right", "max_length": 5})[0]
    assert item["input_ids"].tolist() == [5, 6, 7, tok.pad_token_id, tok.pad_token_id]
    assert item["loss_mask"].tolist() == [0, 1, 1, 0, 0] and item["attention_mask"].tolist() == [1, 1, 1, 0, 0]
    assert item["position_ids"].tolist() == [0, 1, 2, 0, 0]


# --- the stage, the arms, the report, the config ---------------------------------------------------
def _flat_cfg(steps: int = 2) -> ExperimentConfig:
    return replace(
        full_config(),
        teacher_flat_sft=SftConfig(steps=steps, batch=4, lr=1e-5, save_every=2, warmup_steps=0, max_length=1024),
    )


@pytest.fixture
def stage_paths(task_dir, tiny_models, tmp_path):
    """A one-preset run folder: the tiny episodes and traces, and the final teacher's export (the tiny teacher)."""
    paths = Paths(tmp_path / "runs", tmp_path / "results")
    shutil.copytree(task_dir / "data", paths.data)
    shutil.copytree(task_dir / "sft_data", paths.sft_data)
    export = paths.sft("teacher") / "checkpoints" / f"global_step_{full_config().teacher_sft.steps}" / "huggingface"
    shutil.copytree(tiny_models.teacher, export)
    return paths, export


def test_the_stage_builds_the_rows_once_and_trains_from_the_final_teacher(stage_paths, monkeypatch):
    from verl_memopd.experiment import flat_sft, sft

    paths, teacher = stage_paths
    cfg, runs = _flat_cfg(), []

    def fake_run_sft(model, data, run_dir, config, name, env, overrides=()):
        runs.append((model, data, run_dir, config, name, overrides))
        (run_dir / "DONE.json").write_text(
            json.dumps({"steps": config.steps, "hf": "H", "wall_s": 1.0, "weights_sha256": "0" * 64})
        )
        return Path("H")

    monkeypatch.setattr(sft, "run_sft", fake_run_sft)
    assert flat_sft.run_teacher_flat(cfg, paths) == Path("H")
    assert f"teacher_flat,{cfg.teacher_flat_sft.steps},{'0' * 64}," in (paths.results / "sft_models.csv").read_text()
    ((model, data, run_dir, config, name, overrides),) = runs
    assert (model, data, run_dir, config, name) == (
        teacher,
        paths.sft("teacher_flat") / "data",
        paths.sft("teacher_flat"),
        cfg.teacher_flat_sft,
        "sft_teacher_flat",
    )
    assert "data.custom_cls.name=TokenRowsDataset" in overrides and "data.max_token_len_per_gpu=1024" in overrides
    source = json.loads((data / "source.json").read_text())
    assert source["teacher"] == str(teacher) and source["separator"] == list(_sep(build_tokenizer()))
    assert source["train"]["flat"]["rows"] == 4 and source["val"]["flat"]["rows"] == flat_sft.VAL_EPISODES
    train = pd.read_parquet(data / "train.parquet")
    assert sorted(set(train["state"])) == ["aligned", "flat"] and list(train.columns) == list(
        flat_sft.TOKEN_ROW_COLUMNS
    )
    assert flat_sft.run_teacher_flat(cfg, paths) == Path("H") and len(runs) == 1  # done: skipped
    longer = _flat_cfg(steps=4)
    assert flat_sft.run_teacher_flat(longer, paths) == Path("H") and runs[-1][3].steps == 4  # extended, same rows
    with pytest.raises(ValueError, match="sft_teacher_flat: .* finished 4 steps, more than the 2 asked for"):
        flat_sft.run_teacher_flat(cfg, paths)


def test_the_stage_refuses_rows_of_another_teacher_and_rows_longer_than_max_length(stage_paths, monkeypatch):
    from verl_memopd.experiment import flat_sft, sft

    paths, _ = stage_paths
    monkeypatch.setattr(sft, "run_sft", lambda *a, **k: pytest.fail("must not train"))
    short = replace(_flat_cfg(), teacher_flat_sft=replace(_flat_cfg().teacher_flat_sft, max_length=64))
    with pytest.raises(
        ValueError, match=r"sft_teacher_flat: the longest row has \d+ tokens > teacher_flat_sft.max_length=64"
    ):
        flat_sft.run_teacher_flat(short, paths)
    other = replace(
        full_config(),
        teacher_sft=replace(full_config().teacher_sft, steps=2000),
        teacher_flat_sft=short.teacher_flat_sft,
    )
    shutil.copytree(
        paths.sft("teacher") / "checkpoints/global_step_4000", paths.sft("teacher") / "checkpoints/global_step_2000"
    )
    with pytest.raises(
        ValueError, match="rows built from .*global_step_4000.*, the final teacher is now .*global_step_2000"
    ):
        flat_sft.run_teacher_flat(other, paths)


def test_an_experiment_without_a_flat_teacher_skips_the_stage_and_keeps_the_aligned_teacher(tmp_path, capsys):
    from verl_memopd.experiment import pipeline
    from verl_memopd.experiment.arms import arm_command, scoring_teacher
    from verl_memopd.experiment.flat_sft import run_teacher_flat, teacher_flat_export

    cfg, paths = full_config(), Paths(tmp_path / "runs", tmp_path / "results")
    assert cfg.teacher_flat_sft is None and run_teacher_flat(cfg, paths) is None
    assert "sft_teacher_flat: none" in capsys.readouterr().out and not paths.root.exists()
    assert scoring_teacher(cfg, paths, "flat", "T") == Path("T")
    with pytest.raises(ValueError, match="teacher_flat_sft is None"):
        teacher_flat_export(cfg, paths)
    stages = pipeline.STAGES
    assert stages.index("sft_teacher") + 1 == stages.index("sft_teacher_flat") < stages.index("eval")
    assert "sft_teacher_flat" in pipeline.SHARED_STAGES
    assert "memopd.teacher.path=T" in arm_command(cfg, paths, "flat", 0, "S", "T")


def test_the_flat_arm_scores_with_the_flat_teacher_and_every_other_arm_with_the_aligned_one(tmp_path):
    from verl_memopd.experiment.arms import arm_command

    cfg, paths = _flat_cfg(), Paths(tmp_path / "runs", tmp_path / "results")
    with pytest.raises(RuntimeError, match="has not finished its 2 steps; run the sft_teacher_flat stage first"):
        arm_command(cfg, paths, "flat", 0, "S", "T")
    export = paths.sft("teacher_flat") / "checkpoints" / "global_step_2" / "huggingface"
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    (paths.sft("teacher_flat") / "DONE.json").write_text(json.dumps({"steps": 2, "hf": str(export)}))
    assert f"memopd.teacher.path={export}" in arm_command(cfg, paths, "flat", 0, "S", "T")
    for arm in ("memopd", "ppo", "opd"):
        assert "memopd.teacher.path=T" in arm_command(cfg, paths, arm, 0, "S", "T")


def test_the_report_has_a_row_per_teacher_and_state(tmp_path):
    from verl_memopd.experiment.report import collect_rows, state_lines

    cfg, paths = _flat_cfg(), Paths(tmp_path / "runs", tmp_path / "results")
    paths.evals().mkdir(parents=True)
    for name, step, f1 in (
        ("teacher_flat", 2, {"aligned": 0.9, "flat": 0.8}),
        ("teacher", 4000, {"aligned": 0.95, "flat": 0.1}),
    ):
        record = {"model": name, "step": step, "split": "val", "f1": f1, "wall_s": 3.0}
        (paths.evals() / f"state_{name}_val.json").write_text(json.dumps(record))
    (paths.evals() / "state_teacher_test.partial.json").write_text(json.dumps({"aligned": [1.0]}))
    rows = {(r["arm"], r["step"], r["split"]): r["f1"] for r in collect_rows(cfg, paths)}
    assert rows == {
        ("teacher@aligned_state", 4000, "val"): 0.95,
        ("teacher@flat_state", 4000, "val"): 0.1,
        ("teacher_flat@aligned_state", 2, "val"): 0.9,
        ("teacher_flat@flat_state", 2, "val"): 0.8,
    }
    assert state_lines(collect_rows(cfg, paths)) == [
        "teacher (val) F1 acting in the aligned state 0.9500, flat state 0.1000",
        "teacher_flat (val) F1 acting in the aligned state 0.9000, flat state 0.8000",
    ]


def test_config_refusals_name_the_field():
    from verl_memopd.experiment.config import smollm2_horizon_config

    horizon = smollm2_horizon_config().teacher_flat_sft
    assert horizon is not None and horizon.max_length == 3072 and horizon.steps * horizon.step_s < 3600
    with pytest.raises(ValueError, match="ExperimentConfig.teacher_flat_sft must be an SftConfig or None"):
        replace(full_config(), teacher_flat_sft={"steps": 40})
    with pytest.raises(ValueError, match=r"ExperimentConfig.state_eval_splits=\('val', 'train'\)"):
        replace(full_config(), state_eval_splits=("val", "train"))
    with pytest.raises(ValueError, match=r"ExperimentConfig.state_eval_splits=\('val', 'val'\)"):
        replace(full_config(), state_eval_splits=("val", "val"))
    with pytest.raises(ValueError, match="SftConfig: steps, batch, save_every and max_length must be >= 1"):
        SftConfig(steps=2, batch=2, lr=1e-5, save_every=2, max_length=0)


def test_the_rows_follow_the_arms_separator_or_refuse(tok):
    from verl_memopd.experiment.flat_sft import _separator

    assert _separator(full_config(), tok) == _sep(tok)
    cfg = replace(full_config(), arm_overrides=("memopd.teacher.flat_separator_ids=[5]",))
    with pytest.raises(ValueError, match="an arm override sets memopd.teacher.flat_separator_ids"):
        _separator(cfg, tok)


@pytest.mark.slow
def test_verls_sft_trainer_trains_the_flat_teacher_on_the_rows(stage_paths):
    """The stage end to end (torchrun + verl's SFT trainer on the cpu platform, tiny teacher, 2 steps): it trains on
    the token rows through ``data.custom_cls``, validates, exports, and the export is another model."""
    from transformers import AutoModelForCausalLM

    from verl_memopd.experiment.flat_sft import run_teacher_flat
    from verl_memopd.experiment.sft import finished_sft

    paths, teacher = stage_paths
    cfg = _flat_cfg()
    hf = run_teacher_flat(cfg, paths)
    done = finished_sft(paths.sft("teacher_flat"))
    assert done["steps"] == 2 and Path(done["hf"]) == hf and "val/loss" in done["losses"]["2"]
    assert all(0.0 < done["losses"][s]["train/loss"] < 50.0 for s in ("1", "2"))
    before, after = (AutoModelForCausalLM.from_pretrained(p).state_dict() for p in (teacher, hf))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert run_teacher_flat(cfg, paths) == hf  # done: not run again


@pytest.mark.slow
def test_how_often_verls_sft_trainer_validates_does_not_change_the_model(task_dir, tiny_models, tmp_path):
    """What lets the horizon study validate its SFTs less often than it checkpoints (``SftConfig.val_every``): the
    same SFT (tiny student, 4 steps, verl's SFT trainer through torchrun) with a val loss every step and only at the
    end exports the same weights, byte for byte; a different lr, as a control, does not."""
    from verl_memopd.experiment.launching import cpu_env
    from verl_memopd.experiment.sft import run_sft, weights_sha256

    def sha(name: str, **changes) -> str:
        cfg = replace(SftConfig(steps=4, batch=4, lr=1e-4, save_every=4, warmup_steps=0), **changes)
        hf = run_sft(tiny_models.student, task_dir / "sft_data", tmp_path / name, cfg, name, cpu_env(tmp_path))
        return weights_sha256(hf)

    every_step = sha("val_every_step", val_every=1)
    assert sha("val_at_the_end") == every_step  # val_every None: at the 4-step checkpoint only
    assert sha("other_lr", lr=2e-4) != every_step
