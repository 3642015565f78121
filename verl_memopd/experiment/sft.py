"""SFT stages: the oracle's calls as chat rows, trained with verl's own SFT trainer on the cpu platform.

Data: ``python -m verl_memopd.tasks oracle SPLIT.parquet --traces OUT.parquet`` writes one row per
agent call (``messages`` = the task's questions, the call's message, the oracle's reply), the exact
state the agent sees; verl's ``MultiTurnSFTDataset`` puts the loss on the assistant turn only.

Training: ``torchrun -m verl.trainer.sft_trainer`` (the ``cpu`` platform of the plugin supplies the
gloo process group, ``platform/patches.py``). ``trainer.resume_mode=auto``: a rerun continues from
the newest checkpoint in the run folder. The stage is done when ``DONE.json`` names the final
Hugging Face export. A finished run whose config now asks for more steps is **extended**: verl resumes
from its last checkpoint with the new ``total_training_steps``, so from there on the lr follows the
longer cosine schedule (a warm restart: not the schedule a fresh run of that length would have had);
``DONE.json`` keeps the earlier record under ``extends``.
"""

from __future__ import annotations

import csv
import hashlib
import json
import sys
from pathlib import Path

from verl_memopd.experiment.config import ExperimentConfig, Paths, SftConfig
from verl_memopd.experiment.launching import parse_steps
from verl_memopd.experiment.runner import run_logged

__all__ = [
    "build_sft_data",
    "mix_traces",
    "sft_command",
    "run_sft",
    "fp32_export",
    "hf_export",
    "start_models",
    "saved_steps",
    "sft_losses",
    "finished_sft",
    "continuable_sft",
]

#: the overrides that make verl's SFT trainer run (and run fast) on CPU
CPU_SFT_OVERRIDES = (
    "trainer.device=cpu",
    "engine.strategy=fsdp2",
    "engine.use_torch_compile=false",
    "+engine.mixed_precision.param_dtype=fp32",  # engine.dtype alone keeps bf16 params + autocast: ~15x slower
    "+model.override_config.attn_implementation=sdpa",
    "model.use_remove_padding=false",
    "model.enable_gradient_checkpointing=false",
    "data.num_workers=0",
    "data.truncation=error",
    "checkpoint.save_contents=[model,optimizer,extra,hf_model]",
    "trainer.logger=[console]",
    "trainer.resume_mode=auto",
)


def build_sft_data(data_dir: Path, out_dir: Path) -> None:
    """Oracle traces of ``data_dir/{train,val}.parquet`` -> ``out_dir/{train,val}.parquet`` (chat rows)."""
    from verl_memopd.experiment.runner import run_checked

    out_dir.mkdir(parents=True, exist_ok=True)
    for split in ("val", "train"):  # train last: its file marks the stage done
        run_checked(
            [
                sys.executable,
                "-m",
                "verl_memopd.tasks",
                "oracle",
                str(data_dir / f"{split}.parquet"),
                "--traces",
                str(out_dir / f"{split}.parquet"),
            ]
        )


def mix_traces(sources: list[Path], names: list[str], out_dir: Path) -> None:
    """Concatenate the oracle traces ``sources[i]/{train,val}.parquet`` -> ``out_dir/{train,val}.parquet``.

    Rows keep their order (verl's SFT trainer shuffles); ``episode_id`` becomes ``<names[i]>/<episode_id>`` so
    episodes of different presets stay distinct.
    """
    import pandas as pd

    out_dir.mkdir(parents=True, exist_ok=True)
    for split in ("val", "train"):  # train last: its file marks the stage done
        frames = []
        for source, name in zip(sources, names, strict=True):
            frame = pd.read_parquet(source / f"{split}.parquet")
            frames.append(frame.assign(episode_id=name + "/" + frame["episode_id"].astype(str)))
        tmp = out_dir / f".{split}.parquet.tmp"
        pd.concat(frames, ignore_index=True).to_parquet(tmp, index=False)
        tmp.rename(out_dir / f"{split}.parquet")


def sft_command(
    model: Path, sft_data: Path, run_dir: Path, cfg: SftConfig, name: str, overrides: tuple[str, ...] = ()
) -> list[str]:
    """The torchrun command line of one SFT run (1 process on the cpu platform); ``overrides`` (Hydra) last."""
    return [
        "torchrun",
        "--standalone",
        "--nnodes=1",
        "--nproc_per_node=1",
        "-m",
        "verl.trainer.sft_trainer",
        f"model.path={model}",
        f"data.train_files={sft_data / 'train.parquet'}",
        f"data.val_files={sft_data / 'val.parquet'}",
        "data.messages_key=messages",
        f"data.train_batch_size={cfg.batch}",
        f"data.micro_batch_size_per_gpu={cfg.batch}",
        f"data.max_length={cfg.max_length}",
        f"optim.lr={cfg.lr}",
        "optim.lr_scheduler_type=cosine",
        f"optim.lr_warmup_steps={cfg.warmup_steps}",
        f"optim.min_lr_ratio={cfg.min_lr_ratio}",
        f"trainer.total_training_steps={cfg.steps}",
        "trainer.total_epochs=1000",
        f"trainer.save_freq={cfg.save_every}",
        f"trainer.test_freq={cfg.validate_every}",
        f"trainer.default_local_dir={run_dir / 'checkpoints'}",
        "trainer.project_name=memopd_experiment",
        f"trainer.experiment_name={name}",
        *CPU_SFT_OVERRIDES,
        *overrides,
    ]


def fp32_export(hf: Path) -> Path:
    """``hf`` (a Hugging Face folder verl exported from fp32 weights) with its config's dtype said as fp32.

    verl 0.9.1 writes ``"dtype": "bfloat16"`` into the exported config although the weights are fp32;
    vLLM and transformers would then load (or cast) them as bf16.
    """
    config_path = hf / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{config_path}: no Hugging Face export there (checkpoint save_contents must include hf_model)"
        )
    config = json.loads(config_path.read_text())
    if config.get("dtype") != "float32" or config.get("torch_dtype", "float32") != "float32":
        config["dtype"] = "float32"
        config.pop("torch_dtype", None)
        config_path.write_text(json.dumps(config, indent=2) + "\n")
    return hf


def hf_export(run_dir: Path, step: int) -> Path:
    """The Hugging Face folder verl's SFT trainer exported at ``step`` (fp32 config, see :func:`fp32_export`)."""
    return fp32_export(run_dir / "checkpoints" / f"global_step_{step}" / "huggingface")


def saved_steps(run_dir: Path) -> list[int]:
    """Steps with a checkpoint folder, ascending."""
    ckpt = run_dir / "checkpoints"
    return sorted(int(p.name.rsplit("_", 1)[1]) for p in ckpt.glob("global_step_*") if p.is_dir())


def sft_losses(log: str) -> dict[int, dict[str, float]]:
    """``{step: {"train/loss": x, "val/loss": y}}`` from verl's console step lines (steps without a loss left out)."""
    wanted = ("train/loss", "val/loss")
    steps = {step: {k: m[k] for k in wanted if k in m} for step, m in parse_steps(log).items()}
    return {step: losses for step, losses in steps.items() if losses}


def weights_sha256(hf: Path) -> str:
    """sha256 over the bytes of the ``*.safetensors`` files of the Hugging Face folder ``hf``, in name order: the
    fingerprint that tells whether a rebuilt model (a fresh machine reruns the SFTs) is the one measured before."""
    files = sorted(hf.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{hf}: no *.safetensors weights to fingerprint")
    digest = hashlib.sha256()
    for path in files:
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def run_sft(
    model: Path,
    sft_data: Path,
    run_dir: Path,
    cfg: SftConfig,
    name: str,
    env: dict[str, str],
    overrides: tuple[str, ...] = (),
) -> Path:
    """Run (or resume) one SFT; write ``run_dir/DONE.json`` and return the final HF export. ``overrides``: Hydra
    overrides after the command's own (:func:`sft_command`).

    Not time-bounded: one torchrun process without Ray, whose step time depends on the machine's load
    (0.8-30 s/step measured here); it checkpoints every ``save_every`` steps, so stopping it loses little.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    earlier = continuable_sft(run_dir, cfg, name)
    wall = run_logged(sft_command(model, sft_data, run_dir, cfg, name, overrides), run_dir / "sft.log", env, None)
    if cfg.steps not in saved_steps(run_dir):
        raise RuntimeError(
            f"{name}: verl's SFT trainer ended without a checkpoint at step {cfg.steps}; see {run_dir / 'sft.log'}"
        )
    hf = hf_export(run_dir, cfg.steps)
    losses = sft_losses((run_dir / "sft.log").read_text(errors="replace"))
    done = {
        "steps": cfg.steps,
        "hf": str(hf),
        "wall_s": wall + (earlier or {}).get("wall_s", 0.0),
        "weights_sha256": weights_sha256(hf),
        "losses": losses,
    }
    if earlier is not None:
        done["extends"] = {k: v for k, v in earlier.items() if k != "losses"}
    (run_dir / "DONE.json").write_text(json.dumps(done, indent=1) + "\n")
    return hf


#: ``sft_models.csv`` in the experiment's results folder: one row per distinct model an SFT stage built
SFT_MODEL_COLUMNS = ("role", "steps", "weights_sha256", "final_train_loss", "wall_s")


def record_sft_model(results: Path, role: str, done: dict) -> bool:
    """Add the finished SFT ``done`` (its ``DONE.json``) to ``results/sft_models.csv`` unless the same model is
    there. Returns False (and says so) when the file already names another model for the same role and steps: the
    results measured before came from that one, so they are not this model's until measured again."""
    path = results / "sft_models.csv"
    rows = list(csv.DictReader(path.open())) if path.is_file() else []
    sha = done.get("weights_sha256") or weights_sha256(Path(done["hf"]))
    same = [r for r in rows if r["role"] == role and int(r["steps"]) == done["steps"]]
    if any(r["weights_sha256"] == sha for r in same):
        return True
    loss = done.get("losses", {}).get(str(done["steps"]), {}).get("train/loss")
    rows.append(
        {
            "role": role,
            "steps": done["steps"],
            "weights_sha256": sha,
            "final_train_loss": loss,
            "wall_s": round(done["wall_s"], 1),
        }
    )
    results.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, SFT_MODEL_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    if same:
        print(
            f"[experiment] sft_{role}: this build (sha256 {sha[:12]}) is NOT the model of {path} "
            f"({', '.join(r['weights_sha256'][:12] for r in same)}): results measured before are that model's",
            flush=True,
        )
    return not same


def finished_sft(run_dir: Path) -> dict | None:
    """The ``DONE.json`` record of a finished SFT run (steps, hf, wall_s, weights_sha256, losses[, extends]), or
    None."""
    done = run_dir / "DONE.json"
    return json.loads(done.read_text()) if done.is_file() else None


def continuable_sft(run_dir: Path, cfg: SftConfig, name: str) -> dict | None:
    """:func:`finished_sft` of ``run_dir`` (None: not finished), checked against ``cfg``: the same steps is
    done, fewer is extended; more raises, since its checkpoint at ``cfg.steps`` is the middle of a longer
    schedule, not the run ``cfg`` describes."""
    earlier = finished_sft(run_dir)
    if earlier is not None and earlier["steps"] > cfg.steps:
        raise ValueError(
            f"{name}: {run_dir} finished {earlier['steps']} steps, more than the {cfg.steps} asked "
            "for; a shorter run is a new run folder"
        )
    return earlier


def start_models(cfg: ExperimentConfig, paths: Paths) -> tuple[Path, Path]:
    """(student, teacher) HF folders the arms start from: the chosen student checkpoint, the final teacher."""
    step = json.loads((paths.evals() / "student_choice.json").read_text())["step"]
    return hf_export(paths.sft("student"), step), hf_export(paths.sft("teacher"), cfg.teacher_sft.steps)
