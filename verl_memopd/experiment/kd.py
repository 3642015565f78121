"""The off-policy KD arm: SFT of the student on the teacher's own greedy trajectories of the same episodes.

Matched with the RL arms: the same start student, the same training episodes (the first ``steps x
episodes_per_step`` of verl's shuffled train order at the arm's ``data.seed``, reproduced with verl's
own sampler, :func:`kd_episode_indices`), the same number of optimizer steps and lr. What differs is the
data: the teacher runs the memory agent alone (greedy, ``hf_agent.agent_calls``), so the student learns
from states the *teacher* visits (off-policy), where the RL arms learn on their own rollouts. Training is
verl's SFT trainer (``experiment.sft``) on those calls as chat rows (one optimizer step = the calls of
``episodes_per_step`` episodes); its checkpoints at every ``val_every`` steps are evaluated on val with
verl's validation, the final one on test, like the RL arms.

Outputs under ``arms/kd_seed<s>/``: ``teacher_traces.parquet`` (+ ``.json``: indices, the teacher's F1 on
them), ``sft/`` (verl's run), ``val_step<N>.json``, ``test.json``, ``DONE.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from verl_memopd.experiment.config import KD_ARM, ExperimentConfig, Paths, SftConfig
from verl_memopd.experiment.evaluate import eval_model
from verl_memopd.experiment.runner import attempts

__all__ = ["kd_episode_indices", "kd_sft_config", "run_kd_arm"]


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
        save_every=a.val_every,
        warmup_steps=0,
        min_lr_ratio=1.0,
    )


def _teacher_traces(cfg: ExperimentConfig, paths: Paths, run_dir: Path, seed: int, teacher: Path) -> Path:
    """The teacher's greedy trajectories of the arm's episodes as SFT chat rows (cached)."""
    out = run_dir / "teacher_traces.parquet"
    if out.is_file():
        return out
    import pandas as pd

    from verl_memopd.experiment.hf_agent import agent_calls, load_model, sft_rows
    from verl_memopd.experiment.launch import AGENT_TOKENS

    a = cfg.arms
    indices = kd_episode_indices(cfg.n_train, seed, a.steps * a.episodes_per_step)
    frame = pd.read_parquet(paths.data / "train.parquet")
    rows = [frame.iloc[i].to_dict() for i in indices] * a.samples_per_episode
    model, tokenizer = load_model(teacher)
    started = time.monotonic()
    episodes = agent_calls(rows, [model], tokenizer, **AGENT_TOKENS)
    pd.DataFrame(sft_rows(rows, episodes)).to_parquet(out.with_suffix(".tmp.parquet"))
    out.with_suffix(".tmp.parquet").rename(out)
    f1 = sum(e.f1 for e in episodes) / len(episodes)
    (run_dir / "teacher_traces.json").write_text(
        json.dumps(
            {
                "episode_indices": indices,
                "teacher_f1": f1,
                "episodes": len(episodes),
                "wall_s": round(time.monotonic() - started, 1),
            },
            indent=1,
        )
        + "\n"
    )
    print(
        f"[experiment] kd seed {seed}: teacher trajectories of {len(episodes)} episodes, teacher F1 {f1:.4f}",
        flush=True,
    )
    return out


def run_kd_arm(cfg: ExperimentConfig, paths: Paths, seed: int, student: Path, teacher: Path) -> None:
    """Run (or resume) the KD arm at ``seed``; writes ``DONE.json`` with the final model and its test F1."""
    from verl_memopd.experiment.launching import cpu_env
    from verl_memopd.experiment.sft import hf_export, run_sft

    run_dir = paths.arm(KD_ARM, seed)
    if (run_dir / "DONE.json").is_file():
        return print(f"[experiment] arm {KD_ARM} seed {seed}: done", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    traces = _teacher_traces(cfg, paths, run_dir, seed, teacher)
    data = run_dir / "sft_data"
    data.mkdir(exist_ok=True)
    for name, source in (("train.parquet", traces), ("val.parquet", paths.sft_data / "val.parquet")):
        if not (data / name).exists():
            (data / name).symlink_to(source)
    import pandas as pd

    calls = int(pd.read_parquet(traces, columns=["call"])["call"].max()) + 1
    sft = kd_sft_config(cfg, calls)
    print(
        f"[experiment {time.strftime('%H:%M:%S')}] arm {KD_ARM} seed {seed}: verl SFT on the teacher's "
        f"trajectories, {sft.steps} steps x {sft.batch} calls, lr {sft.lr}",
        flush=True,
    )
    started = time.monotonic()
    final = run_sft(student, data, run_dir / "sft", sft, f"{KD_ARM}_seed{seed}", cpu_env(paths.root))
    wall = time.monotonic() - started
    saved = {step: hf_export(run_dir / "sft", step) for step in range(sft.save_every, sft.steps + 1, sft.save_every)}
    for step, model in saved.items():
        eval_model(
            model,
            paths.data / "val.parquet",
            run_dir / f"val_step{step}.json",
            cfg,
            paths,
            {"role": KD_ARM, "seed": seed, "step": step, "split": "val"},
        )
    if cfg.heldout:
        from verl_memopd.experiment.heldout import arm_heldout_kl

        arm_heldout_kl(cfg, paths, KD_ARM, seed, saved, teacher)
    done = {"wall_s": round(wall, 1), "final_actor": str(final), "attempts": attempts(run_dir / "sft" / "sft.log")}
    if cfg.final_evals:
        done["test_f1"] = eval_model(
            final,
            paths.data / "test.parquet",
            run_dir / "test.json",
            cfg,
            paths,
            {"role": KD_ARM, "seed": seed, "step": sft.steps, "split": "test"},
        )["f1"]
    (run_dir / "DONE.json").write_text(json.dumps(done) + "\n")
    from verl_memopd.experiment.launching import prune_checkpoints

    prune_checkpoints(run_dir / "sft" / "checkpoints", keep="huggingface")
