"""The persistent-history teacher (the ``flat`` arm's): verl SFT on the oracle's episodes laid out as that teacher
scores them, so the control's teacher has been trained on the state it is asked to score in.

Rows (token ids, one parquet row each; ``a_t`` = call t's reply ids and its stop id, ``s`` = the turn separator)::

    flat row       q x_0 a_0 s x_1 a_1 s ... s x_N a_N    the ``flat`` layout, separated: the teacher engine's flat pass
                                                          (``packing`` / ``streams.flat_history``), state ``flat``
    per-call row   q x_t a_t                              the ``per_call`` layout: call t's own state, ``aligned``
    loss_mask      1 at every a_t token, 0 at q, x_t, s   token-aligned (verl's SFT loss shifts it onto the logits)

The ids are the agent's own: :func:`oracle_episode` drives ``agent.episode.MemoryEpisode`` with each oracle reply
encoded and closed by the end-of-turn id, as a model that sampled the reply would have sent it, the reply's ids then
being the next call's memory ids (never text re-tokenized); ``s`` is what the ``flat`` arm's trainer resolves
(``trainer.teacher.flat_separator_ids`` with its default, ``null``: the chat template's). A flat row is thus token for
token what the flat teacher scores had the student written the oracle's replies, and its loss mask is the layout's
action mask (``tests/test_flat_sft.py``). verl's ``MultiTurnSFTDataset`` renders the same conversation message by
message through the chat template, which also puts the loss on every ``s`` and on a final ``s`` the layout does not
have; so the rows are pre-tokenized and read by :class:`TokenRowsDataset` (``data.custom_cls``), which changes none.

The stage (:func:`run_teacher_flat`, ``sft_teacher_flat``): verl's SFT trainer continues from the final aligned
teacher on the mix of both row kinds (:data:`ALIGNED_SHARE`), into ``sft/teacher_flat/`` (``data/`` the rows,
``data/source.json`` what they were built from, ``checkpoints/``, ``sft.log``, ``DONE.json``); resumed and extended
like the other SFT stages (``experiment/sft.py``).
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any, Sequence

from torch.utils.data import Dataset

from verl_memopd.records import Episode, Invocation, RecordError

__all__ = [
    "ALIGNED_SHARE",
    "TRAIN_EPISODES",
    "VAL_EPISODES",
    "TOKEN_ROW_COLUMNS",
    "end_of_turn_id",
    "oracle_episode",
    "token_rows",
    "build_token_rows",
    "TokenRowsDataset",
    "teacher_flat_export",
    "run_teacher_flat",
]

#: per episode, the share of its calls that also get a per-call (aligned-state) row, rounded up, next to its flat
#: row. The aligned teacher is already competent in the aligned state (h12 val F1 0.94), so these rows rehearse it
#: rather than teach: without them, training on flat rows alone could move the teacher's aligned-state behaviour, and
#: the flat arm's teacher would then differ from the other arms' in skill as well as in the state it reads, which is
#: the one thing the control is meant to vary (the state eval reports both states' F1 for both teachers). A quarter
#: keeps ~3/4 of the reply tokens (the loss weighs every reply token alike) and ~2/3 of the tokens on the new, flat
#: state. Measured on the horizon study's oracle episodes (SmolLM2 tokenizer): an h12 episode's flat row has 13
#: replies, ~386 reply tokens in ~1.85k tokens, its 4 per-call rows ~119 in ~0.89k (h6: 189 / 55, h3: 92 / 24).
ALIGNED_SHARE = 0.25
#: train episodes per preset whose rows make the SFT's train set: more than ten times the rows a run of the horizon
#: study's size samples (40 steps x 8 rows), at a fraction of the build time of all 2048 (~0.1 s an h12 episode)
TRAIN_EPISODES = 512
#: val episodes per preset whose rows make the SFT's val set: a flat row is ~T blocks long, so the whole val split's
#: rows would cost a validation several training steps' time (verl validates at every save)
VAL_EPISODES = 4
#: the columns of a token-row parquet file: ``state`` is ``flat`` or ``aligned``, ``call`` the call index of an
#: aligned row (-1 for a flat row)
TOKEN_ROW_COLUMNS = ("episode_id", "state", "call", "input_ids", "loss_mask")


def end_of_turn_id(tokenizer: Any) -> int:
    """The id that ends an assistant turn (ChatML ``<|im_end|>``), which the agent's calls stop at: the tokenizer's
    eos, checked to be what the chat template writes right after an assistant turn's content."""
    eos = tokenizer.eos_token
    content = "\ue000memopd-reply\ue000"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "?"}, {"role": "assistant", "content": content}], tokenize=False
    )
    if tokenizer.eos_token_id is None or content + str(eos) not in text:
        raise ValueError(
            f"the chat template does not end an assistant turn with the tokenizer's eos {eos!r} "
            f"(rendered: {text!r}); the oracle's replies cannot be closed as the agent's calls are"
        )
    return int(tokenizer.eos_token_id)


def oracle_episode(row: dict, calls: Sequence[tuple[str, str]], tokenizer: Any, stop_id: int, where: str) -> Episode:
    """The ``Episode`` record of the agent writing the oracle's replies on one dataset row.

    Args:
        row: the dataset row (``prompt``, ``extra_info``, ``reward_model``).
        calls: the oracle's calls of the row, in order: ``(user message, reply)`` text (its SFT traces).
        stop_id: closes every reply (:func:`end_of_turn_id`).
        where: names the episode in errors.

    Each call's ``prompt_ids`` are ``MemoryEpisode.next_call``'s, its ``response_ids`` the reply encoded plus
    ``stop_id`` (zero log-probs); the user message the traces give must be the one the agent sends."""
    from verl_memopd.agent.context import CallContext
    from verl_memopd.agent.episode import MemoryEpisode
    from verl_memopd.tasks.dataset import parse_row
    from verl_memopd.tasks.prompts import MemoryPrompts

    task = parse_row(row["extra_info"], row["reward_model"], where=where)
    context = CallContext(tokenizer, list(row["prompt"]), MemoryPrompts(), where=where)
    episode = MemoryEpisode(task, context, memory_tokens=0, answer_tokens=0)  # budgets: not generated here
    if len(calls) != episode.num_calls:
        raise RecordError(f"{where}: {len(calls)} oracle calls, the row's episode has {episode.num_calls}")
    invocations, memory = [], ""
    for t, (user, reply) in enumerate(calls):
        if episode.message(memory) != user:
            raise RecordError(f"{where} call {t}: the traces' user message is not the one the agent sends")
        response = tuple(tokenizer.encode(reply, add_special_tokens=False)) + (stop_id,)
        invocations.append(Invocation(episode.next_call().prompt_ids, response, (0.0,) * len(response)))
        episode.receive(response, stopped=True)
        memory = reply
    return Episode(where, where, context.prefix_ids, tuple(invocations))


def _layout_rows(name: str, episode: Episode, separator: tuple[int, ...], vocab_size: int) -> list[tuple[list, list]]:
    """``(input_ids, loss_mask)`` of each row of layout ``name`` over one episode: the real tokens, and 1 at token
    ``j`` where the layout's action mask is set at the predicting position ``j - 1``."""
    from verl_memopd.packing import LayoutOptions, build_layout

    layout = build_layout(name, [episode], vocab_size, LayoutOptions(flat_separator_ids=separator))
    rows = []
    for ids, valid, act in zip(layout.input_ids, layout.valid_mask, layout.action_mask):
        n = int(valid.sum())
        rows.append((ids[:n].tolist(), [0] + act[: n - 1].int().tolist()))
    return rows


def token_rows(
    episode: Episode, episode_id: str, separator: tuple[int, ...], vocab_size: int, aligned_share: float
) -> list[dict]:
    """An episode's flat row, then the per-call rows of ``ceil(aligned_share * calls)`` of its calls (a sample seeded
    by ``episode_id``, in call order); rows of :data:`TOKEN_ROW_COLUMNS`."""
    if not 0.0 <= aligned_share <= 1.0:
        raise ValueError(f"aligned_share={aligned_share}: must lie in [0, 1]")
    ((flat_ids, flat_mask),) = _layout_rows("flat", episode, separator, vocab_size)
    rows = [{"episode_id": episode_id, "state": "flat", "call": -1, "input_ids": flat_ids, "loss_mask": flat_mask}]
    per_call = _layout_rows("per_call", episode, separator, vocab_size)
    chosen = sorted(random.Random(episode_id).sample(range(len(per_call)), math.ceil(aligned_share * len(per_call))))
    for t in chosen:
        ids, mask = per_call[t]
        rows.append({"episode_id": episode_id, "state": "aligned", "call": t, "input_ids": ids, "loss_mask": mask})
    return rows


def build_token_rows(
    data_file: Path,
    traces_file: Path,
    tokenizer: Any,
    separator: tuple[int, ...],
    aligned_share: float = ALIGNED_SHARE,
    max_episodes: int | None = None,
    scope: str | None = None,
) -> list[dict]:
    """Token rows (:func:`token_rows`) of the first ``max_episodes`` (None: all) episodes of a split's dataset rows
    (``data_file``) and their oracle traces (``traces_file``: ``episode_id``, ``call``, ``messages`` = prompt, user,
    reply). ``scope`` prefixes the episode ids (``<scope>/<id>``, as ``sft.mix_traces`` does)."""
    import pandas as pd

    frame = pd.read_parquet(data_file)
    traces = pd.read_parquet(traces_file, columns=["episode_id", "call", "messages"])
    by_episode = {str(eid): group.sort_values("call") for eid, group in traces.groupby("episode_id")}
    stop_id, rows = end_of_turn_id(tokenizer), []
    for i in range(len(frame) if max_episodes is None else min(max_episodes, len(frame))):
        row = frame.iloc[i].to_dict()
        eid = str(row["extra_info"].get("episode_id", i))
        where = f"{data_file} row {i} ({eid})"
        if eid not in by_episode:
            raise KeyError(f"{traces_file}: no oracle calls of episode {eid!r} ({where})")
        calls = [(m[-2]["content"], m[-1]["content"]) for m in by_episode[eid]["messages"]]
        episode = oracle_episode(row, calls, tokenizer, stop_id, where)
        scoped_id = eid if scope is None else f"{scope}/{eid}"
        rows += token_rows(episode, scoped_id, separator, len(tokenizer), aligned_share)
    return rows


class TokenRowsDataset(Dataset):
    """verl's SFT dataset interface (``data.custom_cls``; the constructor ``create_sft_dataset`` calls) over token
    rows (:data:`TOKEN_ROW_COLUMNS`), each returned as stored.

    An item (L = the row's length): ``input_ids`` (L,) int64, ``position_ids`` (L,) = 0..L-1, ``loss_mask`` (L,)
    int64, 1 where token ``j`` is a target; ``data.pad_mode=right`` pads all three to ``data.max_length`` and adds
    ``attention_mask``. Rows are checked when loaded: a row longer than ``data.max_length`` is refused
    (``data.truncation`` must be ``error``: a cut history is another state), as is a mask that is not 0/1, is
    empty, marks token 0 (no logits predict it) or differs in length from the ids, or an id outside the vocabulary.
    """

    def __init__(self, parquet_files, tokenizer, config, processor=None, max_samples: int = -1):
        import pandas as pd

        self.pad_mode = config.get("pad_mode", "no_padding")
        self.max_length = int(config.get("max_length", 1024))
        if config.get("truncation", "error") != "error":
            raise ValueError(f"TokenRowsDataset: data.truncation={config.get('truncation')!r}, must be 'error'")
        if self.pad_mode not in ("no_padding", "right"):
            raise ValueError(f"TokenRowsDataset: data.pad_mode={self.pad_mode!r}, expected no_padding or right")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        files = [parquet_files] if isinstance(parquet_files, (str, Path)) else list(parquet_files)
        self.rows = []
        for path in files:
            frame = pd.read_parquet(path, columns=list(TOKEN_ROW_COLUMNS))
            for i in range(len(frame)):
                ids, mask = [int(x) for x in frame["input_ids"].iloc[i]], [int(x) for x in frame["loss_mask"].iloc[i]]
                self._check(ids, mask, len(tokenizer), f"{path} row {i} ({frame['episode_id'].iloc[i]})")
                self.rows.append((ids, mask))
        if max_samples > 0:
            self.rows = self.rows[:max_samples]

    def _check(self, ids: list[int], mask: list[int], vocab_size: int, where: str) -> None:
        problem = None
        if len(ids) > self.max_length:
            problem = f"{len(ids)} tokens > data.max_length={self.max_length}"
        elif len(mask) != len(ids) or not ids:
            problem = f"loss_mask has {len(mask)} entries for {len(ids)} input_ids"
        elif set(mask) - {0, 1} or not any(mask) or mask[0]:
            problem = "loss_mask must be 0/1, mark at least one token and not token 0"
        elif min(ids) < 0 or max(ids) >= vocab_size:
            problem = f"input_ids outside the vocabulary [0, {vocab_size})"
        if problem:
            raise ValueError(f"TokenRowsDataset: {where}: {problem}")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, item: int) -> dict:
        import torch

        ids, mask = self.rows[item]
        out = {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "position_ids": torch.arange(len(ids), dtype=torch.long),
            "loss_mask": torch.tensor(mask, dtype=torch.long),
        }
        if self.pad_mode == "right":
            pad = self.max_length - len(ids)
            fill = {"input_ids": self.pad_id, "position_ids": 0, "loss_mask": 0}
            out = {k: torch.cat([v, torch.full((pad,), fill[k], dtype=torch.long)]) for k, v in out.items()}
            out["attention_mask"] = (torch.arange(self.max_length) < len(ids)).long()
        return out


# --- the stage ---------------------------------------------------------------------------------------
#: ``sft_command`` overrides of the stage: the token rows' dataset, and micro-batches of at most one longest row's
#: tokens (verl's dynamic batch size packs rows up to ``data.max_token_len_per_gpu``; its 8192 default would hold
#: several flat rows, ~2 MB of fp32 activations a token for SmolLM2-135M)
def _stage_overrides(max_length: int) -> tuple[str, ...]:
    return (
        "data.custom_cls.path=pkg://verl_memopd.experiment.flat_sft",
        "data.custom_cls.name=TokenRowsDataset",
        f"data.max_token_len_per_gpu={max_length}",
    )


def teacher_flat_export(cfg, paths) -> Path:
    """The persistent-history teacher's final Hugging Face export (``sft/teacher_flat``); refused before the stage has
    finished the configured steps."""
    from verl_memopd.experiment.sft import finished_sft, hf_export

    if cfg.teacher_flat_sft is None:
        raise ValueError(f"{cfg.name}: ExperimentConfig.teacher_flat_sft is None, there is no flat teacher")
    done = finished_sft(paths.sft("teacher_flat"))
    if done is None or done["steps"] != cfg.teacher_flat_sft.steps:
        raise RuntimeError(
            f"{paths.sft('teacher_flat')}: the flat arm's teacher has not finished its {cfg.teacher_flat_sft.steps} "
            "steps; run the sft_teacher_flat stage first (--only sft_teacher_flat)"
        )
    return hf_export(paths.sft("teacher_flat"), cfg.teacher_flat_sft.steps)


def _separator(cfg, tokenizer) -> tuple[int, ...]:
    """The separator the ``flat`` arm's trainer uses: ``memopd.teacher.flat_separator_ids`` left at its default
    (refused if the experiment's overrides set it: the rows would have to follow)."""
    from verl_memopd.experiment.config import ARMS
    from verl_memopd.trainer.teacher import flat_separator_ids

    key = "memopd.teacher.flat_separator_ids"
    if any(o.lstrip("+~").startswith(key) for o in (*cfg.arm_overrides, *ARMS["flat"])):
        raise ValueError(f"{cfg.name}: an arm override sets {key}; the flat teacher's rows use its default (null)")
    return flat_separator_ids(None, tokenizer, len(tokenizer))


def _write_rows(rows: list[dict], path: Path) -> None:
    import pandas as pd

    tmp = path.with_name(f".{path.name}.tmp")
    pd.DataFrame(rows, columns=list(TOKEN_ROW_COLUMNS)).to_parquet(tmp, index=False)
    tmp.rename(path)


def build_teacher_flat_data(cfg, paths, teacher: Path) -> dict:
    """``sft/teacher_flat/data/{train,val}.parquet`` (the first :data:`TRAIN_EPISODES` / :data:`VAL_EPISODES`
    episodes of every preset, mixed) and ``source.json`` (the teacher, the separator, row counts and lengths); cached,
    and refused when the cached rows were built from another teacher."""
    from transformers import AutoTokenizer

    data = paths.sft("teacher_flat") / "data"
    source = data / "source.json"
    if source.is_file():
        built = json.loads(source.read_text())
        if built["teacher"] != str(teacher):
            raise ValueError(
                f"{data}: rows built from {built['teacher']}, the final teacher is now {teacher}; "
                "a new teacher is a new run folder (move sft/teacher_flat away)"
            )
        return built
    data.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    separator = _separator(cfg, tokenizer)
    several = len(cfg.presets) > 1
    record: dict = {"teacher": str(teacher), "separator": list(separator), "aligned_share": ALIGNED_SHARE}
    for split in ("val", "train"):  # train last: source.json marks the data done
        rows = []
        for preset in cfg.presets:
            scoped = paths.at(preset) if several else paths
            rows += build_token_rows(
                scoped.data / f"{split}.parquet",
                scoped.sft_data / f"{split}.parquet",
                tokenizer,
                separator,
                max_episodes=VAL_EPISODES if split == "val" else TRAIN_EPISODES,
                scope=preset if several else None,
            )
        _write_rows(rows, data / f"{split}.parquet")
        record[split] = {
            state: {
                "rows": sum(r["state"] == state for r in rows),
                "max_tokens": max((len(r["input_ids"]) for r in rows if r["state"] == state), default=0),
                "tokens": sum(len(r["input_ids"]) for r in rows if r["state"] == state),
            }
            for state in ("flat", "aligned")
        }
    source.write_text(json.dumps(record, indent=1) + "\n")
    return record


def run_teacher_flat(cfg, paths) -> Path | None:
    """The ``sft_teacher_flat`` stage: None when the experiment has none (``teacher_flat_sft`` None), else the final
    export, after building the rows and running (resuming, extending) verl's SFT from the final aligned teacher."""
    from verl_memopd.experiment.launching import cpu_env
    from verl_memopd.experiment.sft import continuable_sft, finished_sft, hf_export, record_sft_model, run_sft

    sft = cfg.teacher_flat_sft
    if sft is None:
        print("[experiment] sft_teacher_flat: none (the flat arm scores with the aligned teacher)", flush=True)
        return None
    run_dir, name = paths.sft("teacher_flat"), "sft_teacher_flat"
    done = continuable_sft(run_dir, sft, name)
    if done is not None and done["steps"] == sft.steps:
        record_sft_model(paths.results, "teacher_flat", done)
        print(f"[experiment] {name}: done ({done['hf']})", flush=True)
        return Path(done["hf"])
    teacher = hf_export(paths.sft("teacher"), cfg.teacher_sft.steps)
    record = build_teacher_flat_data(cfg, paths, teacher)
    longest = max(record["train"][s]["max_tokens"] for s in ("flat", "aligned"))
    if longest > sft.max_length:
        raise ValueError(f"{name}: the longest row has {longest} tokens > teacher_flat_sft.max_length={sft.max_length}")
    start = 0 if done is None else done["steps"]
    print(
        f"[experiment {time.strftime('%H:%M:%S')}] {name}: from {teacher}, {sft.steps - start} steps x {sft.batch} "
        f"rows (flat and aligned mixed), lr {sft.lr} (ETA ~{(sft.steps - start) * sft.step_s / 60:.0f} min alone; "
        f"progress: tail -f {run_dir / 'sft.log'})",
        flush=True,
    )
    env = cpu_env(paths.root, threads=cfg.worker_threads)
    hf = run_sft(teacher, run_dir / "data", run_dir, sft, name, env, overrides=_stage_overrides(sft.max_length))
    record_sft_model(paths.results, "teacher_flat", finished_sft(run_dir))
    print(f"[experiment] {name}: done -> {hf}", flush=True)
    return hf
