"""The off-policy arms' data, and the SFT arms: KD (SFT on the teacher's greedy trajectories) and continued SFT
(on the oracle's calls), each on the same episodes as the RL arms.

Matched with the RL arms: the same start student, the same training episodes (the first ``steps x
episodes_per_step`` of verl's shuffled train order at the arm's ``data.seed``, reproduced with verl's
own sampler, :func:`kd_episode_indices`), the same number of optimizer steps and lr. What differs is the
data. The teacher runs the memory agent alone on those episodes (greedy, ``hf_agent.agent_calls``; once per seed,
:func:`teacher_trajectories`), so ``kd`` learns from states the *teacher* visits (off-policy), where the RL arms
learn on their own rollouts; ``kd_soft`` (an RL arm, ``arms.py``) replays the same trajectories through the MemOPD
trainer (:func:`replay_file`, ``agent/replay.py``): the same loss as OPD, other states. ``sft`` learns the oracle's
calls of the episodes (the data the start student was SFT'd on, continued). The SFT arms train with verl's SFT
trainer (``experiment.sft``) on chat rows (one optimizer step = the calls of ``episodes_per_step`` episodes); they
checkpoint every ``save_every`` steps, the checkpoints at the ``val_every`` steps are evaluated on val with verl's
validation, the final one on test, like the RL arms.

Outputs: ``teacher_trajectories/seed<s>/`` (``sft.parquet`` chat rows, ``replay.parquet`` dataset rows for
``memopd_replay_agent``, ``trajectories.json``: indices, the teacher's F1 on them); under ``arms/<arm>_seed<s>/``:
``sft_data/``, ``sft/`` (verl's run), ``val_step<N>.json``, ``test.json``, ``DONE.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from verl_memopd.experiment.config import SFT_ARMS, ExperimentConfig, Paths, SftConfig
from verl_memopd.experiment.evaluate import eval_model
from verl_memopd.experiment.runner import attempts

__all__ = [
    "kd_episode_indices",
    "kd_sft_config",
    "teacher_trajectories",
    "replay_rows",
    "replay_file",
    "oracle_rows",
    "run_sft_arm",
]


def kd_episode_indices(n_train: int, seed: int, count: int) -> list[int]:
    """The first ``count`` train-row indices verl's RL dataloader draws at ``data.seed=seed`` (shuffle on):
    verl 0.9.1's ``create_rl_sampler`` (torchdata ``RandomSampler`` on a generator seeded with the seed)."""
    import torch
    from torchdata.stateful_dataloader.sampler import RandomSampler

    generator = torch.Generator()
    generator.manual_seed(seed)
    order = list(iter(RandomSampler(data_source=range(n_train), generator=generator)))
    return [int(i) for i in order[:count]]


def kd_sft_config(cfg: ExperimentConfig, calls_per_episode: int) -> SftConfig:
    """The RL arms' steps and lr as an SFT run: a batch = the calls of one step's episodes, constant lr."""
    a = cfg.arms
    return SftConfig(
        steps=a.steps,
        batch=a.episodes_per_step * a.samples_per_episode * calls_per_episode,
        lr=a.lr,
        save_every=a.checkpoint_every,
        warmup_steps=0,
        min_lr_ratio=1.0,
    )


def _arm_indices(cfg: ExperimentConfig, seed: int) -> list[int]:
    """The train-row indices of the arms' training episodes at ``seed``, in verl's order."""
    return kd_episode_indices(cfg.n_train, seed, cfg.arms.steps * cfg.arms.episodes_per_step)


def _arm_rows(cfg: ExperimentConfig, paths: Paths, seed: int) -> tuple[list[int], list[dict]]:
    """The arms' training episodes at ``seed``: their train-row indices in verl's order, and the rows."""
    import pandas as pd

    indices = _arm_indices(cfg, seed)
    frame = pd.read_parquet(paths.data / "train.parquet")
    return indices, [frame.iloc[i].to_dict() for i in indices]


def replay_rows(rows: list[dict], episodes: list) -> list[dict]:
    """Dataset rows that make ``memopd_replay_agent`` replay ``episodes`` (``hf_agent.AgentEpisode``, one per row):
    each row with its episode's calls (prompt and response ids) in ``extra_info[fields.REPLAY]``."""
    from verl_memopd.agent.replay import REPLAY_AGENT_NAME
    from verl_memopd.fields import REPLAY

    out = []
    for row, episode in zip(rows, episodes, strict=True):
        calls = [{"prompt_ids": list(c.prompt_ids), "response_ids": list(c.response_ids)} for c in episode.calls]
        out.append({**row, "extra_info": {**row["extra_info"], REPLAY: calls}, "agent_name": REPLAY_AGENT_NAME})
    return out


def teacher_trajectories(cfg: ExperimentConfig, paths: Paths, seed: int, teacher: Path) -> Path:
    """The teacher's greedy trajectories of the arms' episodes at ``seed`` (cached; the folder): ``sft.parquet``
    (chat rows, the KD arm's data), ``replay.parquet`` (dataset rows, kd_soft's), ``trajectories.json``."""
    out = paths.teacher_trajectories(seed)
    if (out / "trajectories.json").is_file():
        return out
    import pandas as pd

    from verl_memopd.experiment.hf_agent import agent_calls, load_model, sft_rows
    from verl_memopd.experiment.launch import AGENT_TOKENS

    indices, rows = _arm_rows(cfg, paths, seed)
    model, tokenizer = load_model(teacher)
    started = time.monotonic()
    episodes = agent_calls(rows, [model], tokenizer, **AGENT_TOKENS)
    out.mkdir(parents=True, exist_ok=True)
    # SFT sees each episode samples_per_episode times, as the RL arms sample it; a replayed row is repeated by
    # the arm's own rollout.n (the teacher's greedy trajectory is the same each time)
    repeat = cfg.arms.samples_per_episode
    pd.DataFrame(sft_rows(rows * repeat, episodes * repeat)).to_parquet(out / "sft.parquet")
    pd.DataFrame(replay_rows(rows, episodes)).to_parquet(out / "replay.parquet")
    f1 = sum(e.f1 for e in episodes) / len(episodes)
    record = {"episode_indices": indices, "teacher_f1": f1, "episodes": len(episodes)}
    (out / "trajectories.json").write_text(
        json.dumps({**record, "wall_s": round(time.monotonic() - started, 1)}, indent=1) + "\n"
    )
    print(
        f"[experiment] seed {seed}: teacher trajectories of {len(episodes)} episodes, teacher F1 {f1:.4f}", flush=True
    )
    return out


def replay_file(cfg: ExperimentConfig, paths: Paths, seed: int, teacher: Path) -> Path:
    """kd_soft's train file at ``seed``: the teacher's trajectories as replay rows, in verl's order of the episodes
    (the arm runs with ``data.shuffle=false``, so step k replays the episodes the RL arms sample at step k)."""
    return teacher_trajectories(cfg, paths, seed, teacher) / "replay.parquet"


def oracle_rows(cfg: ExperimentConfig, paths: Paths, seed: int) -> list[dict]:
    """The oracle's calls of the arms' episodes at ``seed`` as chat rows (``paths.sft_data``'s train traces), in the
    episodes' order, each episode ``samples_per_episode`` times."""
    import pandas as pd

    indices = _arm_indices(cfg, seed)
    traces = pd.read_parquet(paths.sft_data / "train.parquet")
    by_episode = {eid: group.sort_values("call") for eid, group in traces.groupby("episode_id")}
    rows = []
    for i in indices:
        episode = by_episode.get(f"train-{i}")
        if episode is None:
            raise KeyError(f"{paths.sft_data / 'train.parquet'}: no oracle calls of episode train-{i}")
        for _ in range(cfg.arms.samples_per_episode):
            rows += [{"messages": list(r["messages"]), "call": int(r["call"])} for _, r in episode.iterrows()]
    return rows


def _sft_arm_data(cfg: ExperimentConfig, paths: Paths, arm: str, seed: int, teacher: Path) -> Path:
    """The SFT arm's train rows (cached in ``<run>/sft_data/train.parquet``); val is the oracle's val traces."""
    import pandas as pd

    data = paths.arm(arm, seed) / "sft_data"
    train = data / "train.parquet"
    if not train.exists():
        data.mkdir(parents=True, exist_ok=True)
        if arm == "kd":
            train.symlink_to(teacher_trajectories(cfg, paths, seed, teacher) / "sft.parquet")
        else:
            pd.DataFrame(oracle_rows(cfg, paths, seed)).to_parquet(train)
    if not (data / "val.parquet").exists():
        (data / "val.parquet").symlink_to(paths.sft_data / "val.parquet")
    return data


def run_sft_arm(cfg: ExperimentConfig, paths: Paths, arm: str, seed: int, student: Path, teacher: Path) -> None:
    """Run (or resume) the SFT arm ``arm`` (:data:`config.SFT_ARMS`) at ``seed``; writes ``DONE.json`` with the final
    model and its test F1."""
    from verl_memopd.experiment.launching import cpu_env
    from verl_memopd.experiment.sft import hf_export, run_sft

    if arm not in SFT_ARMS:
        raise ValueError(f"run_sft_arm: {arm!r} is not an SFT arm ({sorted(SFT_ARMS)})")
    run_dir = paths.arm(arm, seed)
    if (run_dir / "DONE.json").is_file():
        return print(f"[experiment] arm {arm} seed {seed}: done", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    data = _sft_arm_data(cfg, paths, arm, seed, teacher)
    import pandas as pd

    calls = int(pd.read_parquet(data / "train.parquet", columns=["call"])["call"].max()) + 1
    sft = kd_sft_config(cfg, calls)
    print(
        f"[experiment {time.strftime('%H:%M:%S')}] arm {arm} seed {seed}: verl SFT on {SFT_ARMS[arm]}, "
        f"{sft.steps} steps x {sft.batch} calls, lr {sft.lr}",
        flush=True,
    )
    started = time.monotonic()
    final = run_sft(
        student, data, run_dir / "sft", sft, f"{arm}_seed{seed}", cpu_env(paths.root, threads=cfg.worker_threads)
    )
    wall = time.monotonic() - started
    saved = {step: hf_export(run_dir / "sft", step) for step in range(sft.save_every, sft.steps + 1, sft.save_every)}
    for step in cfg.arms.val_steps():
        eval_model(
            saved[step],
            paths.data / "val.parquet",
            run_dir / f"val_step{step}.json",
            cfg,
            paths,
            {"role": arm, "seed": seed, "step": step, "split": "val"},
        )
    if cfg.heldout:
        from verl_memopd.experiment.heldout import arm_heldout_kl

        arm_heldout_kl(cfg, paths, arm, seed, {s: saved[s] for s in cfg.arms.val_steps()}, teacher)
    done = {"wall_s": round(wall, 1), "final_actor": str(final), "attempts": attempts(run_dir / "sft" / "sft.log")}
    if cfg.final_evals:
        done["test_f1"] = eval_model(
            final,
            paths.data / "test.parquet",
            run_dir / "test.json",
            cfg,
            paths,
            {"role": arm, "seed": seed, "step": sft.steps, "split": "test"},
        )["f1"]
    (run_dir / "DONE.json").write_text(json.dumps(done) + "\n")
    from verl_memopd.experiment.launching import prune_checkpoints

    prune_checkpoints(run_dir / "sft" / "checkpoints", keep="huggingface")
