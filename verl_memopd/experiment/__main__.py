"""CLI of the experiment.

python -m verl_memopd.experiment run [--experiment cpu_tiny|cpu_smollm2|cpu_smollm2_horizon] [--root runs/cpu_tiny]
        [--results results/cpu_tiny] [--until STAGE|--only STAGE] [--arms a,b] [--seeds 0,1] [--presets h12,h3]
    runs the stages in order up to the report, skipping finished ones (EXPERIMENT_SMOKE=1: the minutes-long
    smoke sizes); ``--until sweep`` adds the val-only sensitivity sweep after it; cpu_smollm2_horizon runs
    the per-preset stages once per horizon (h3, h6, h12; ``--presets`` picks and orders them);
    a stage runs under a lock file, so a second process started with --only waits instead of clashing
python -m verl_memopd.experiment eval --role teacher|student --step N [--split val|test]
    val F1 of one SFT checkpoint with verl's validation (also done by the eval stage)
python -m verl_memopd.experiment summary results/cpu_tiny/metrics.csv
    the final test-split table; last line:
    ``experiment model=<m> seeds=<n> steps=<s> teacher_f1=<t> start_f1=<f0> memopd_f1=<a> flat_f1=<b> ppo_f1=<c>
    kd_f1=<d> opd_f1=<e>`` (na for an arm without a test row); ``--markdown``: the arms' table in markdown instead
    (the README's "Does it learn?" table)
python -m verl_memopd.experiment summary results/cpu_smollm2_horizon/metrics.csv
    a several-preset experiment's combined file: one line per horizon, ``experiment horizon=<T> model=<m>
    seeds=<n> test_episodes=<n> teacher_f1=.. start_f1=.. memopd_f1=.. opd_f1=.. kd_soft_f1=.. kd_f1=.. sft_f1=..
    flat_f1=.. opd_minus_kd_soft=<d> opd_minus_kd_soft_ci=<lo>,<hi> memopd_minus_kd=<d> memopd_minus_kd_ci=<lo>,<hi>``
    (paired over episodes and seeds, 95% bootstrap intervals; ``horizon.py``)
python -m verl_memopd.experiment plot results/cpu_tiny/metrics.csv [--out f1.png]
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from verl_memopd.experiment.config import EXPERIMENTS, Paths, smoke_config
from verl_memopd.experiment.pipeline import EXPERIMENT_END, STAGES, run_pipeline


def _config(name: str):
    """The experiment ``name`` (EXPERIMENT_SMOKE=1: the tiny smoke run, whatever the name)."""
    return smoke_config() if os.environ.get("EXPERIMENT_SMOKE", "0") == "1" else EXPERIMENTS[name]()


def _paths(args: argparse.Namespace, name: str) -> Paths:
    return Paths(
        root=Path(args.root or f"runs/{name}").resolve(), results_root=Path(args.results or f"results/{name}").resolve()
    )


def _seeds(text: str) -> tuple[int, ...]:
    """``--seeds 0,2`` -> (0, 2)."""
    try:
        return tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds wants comma-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_memopd.experiment", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the stages (skips finished ones)")
    r.add_argument(
        "--until",
        default=EXPERIMENT_END,
        choices=STAGES,
        help=f"last stage (default {EXPERIMENT_END}; 'sweep' adds the val-only sensitivity runs)",
    )
    r.add_argument("--only", default=None, choices=STAGES, help="run just this stage (its inputs must exist)")
    r.add_argument("--arms", default=None, help="comma-separated subset of the arms (default: all of them)")
    r.add_argument(
        "--seeds",
        default=None,
        type=_seeds,
        help="comma-separated subset of the seeds (default: all of them); the report keeps the committed "
        "rows of the arms and seeds this run folder does not have",
    )
    r.add_argument(
        "--presets",
        default=None,
        help="comma-separated presets the per-preset stages run on, in this order (an experiment with "
        "several task presets, e.g. cpu_smollm2_horizon: --presets h12,h3); default all of them",
    )
    e = sub.add_parser("eval", help="F1 of one SFT checkpoint under the real agent loop")
    e.add_argument("--role", required=True, choices=("teacher", "student"))
    e.add_argument("--step", required=True, type=int)
    e.add_argument("--split", default="val", choices=("val", "test"))
    for p in (r, e):
        p.add_argument(
            "--experiment",
            default="cpu_tiny",
            choices=sorted(EXPERIMENTS),
            help="which experiment (default cpu_tiny; cpu_smollm2: the pretrained-model run)",
        )
        p.add_argument("--root", default=None, help="big outputs (default runs/<name>)")
        p.add_argument("--results", default=None, help="committed results (default results/<name>)")
    s = sub.add_parser("summary", help="final test-split table from metrics.csv")
    s.add_argument("csv")
    s.add_argument(
        "--markdown",
        action="store_true",
        help="the arms' table in markdown (test F1 per seed, val F1, held-out KL, wall) instead",
    )
    pl = sub.add_parser("plot", help="f1.png from metrics.csv")
    pl.add_argument("csv")
    pl.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    cfg = _config(getattr(args, "experiment", "cpu_tiny"))
    if args.command == "run":
        if args.arms:
            cfg = replace(cfg, arms=replace(cfg.arms, arms=tuple(args.arms.split(","))))
        if args.seeds:
            cfg = replace(cfg, arms=replace(cfg.arms, seeds=args.seeds))
        presets = tuple(args.presets.split(",")) if args.presets else None
        run_pipeline(cfg, _paths(args, cfg.name), args.until, args.only, presets)
    elif args.command == "eval":
        from verl_memopd.experiment.evaluate import eval_sft_checkpoint

        print(eval_sft_checkpoint(cfg, _paths(args, cfg.name), args.role, args.step, args.split))
    elif args.command == "summary":
        print("\n".join(_summary(Path(args.csv), args.markdown)))
    else:
        from verl_memopd.experiment.plot import plot_metrics
        from verl_memopd.experiment.report import read_metrics

        out = Path(args.out) if args.out else Path(args.csv).with_name("f1.png")
        plot_metrics(read_metrics(Path(args.csv)), out)
        print(f"plot -> {out}")
    return 0


def _summary(csv: Path, markdown: bool) -> list[str]:
    """The summary of one experiment's ``metrics.csv``; a several-preset experiment's combined file (its header starts
    with ``preset,horizon``) gives one ``experiment horizon=<T> ...`` line per horizon, from ``episodes.csv`` beside
    it."""
    from verl_memopd.experiment.report import (
        HORIZON_COLUMNS,
        markdown_lines,
        read_episodes,
        read_experiment,
        read_metrics,
        summary_lines,
    )

    model = read_experiment(csv.parent).get("base_model", "na")
    with open(csv) as f:
        header = tuple(f.readline().strip().split(","))
    if header != HORIZON_COLUMNS:
        rows = read_metrics(csv)
        return markdown_lines(rows) if markdown else summary_lines(rows, model)
    if markdown:
        raise SystemExit(f"{csv}: --markdown takes one preset's metrics.csv ({csv.parent}/<preset>/metrics.csv)")
    from verl_memopd.experiment.horizon import horizon_summary_lines

    episodes = csv.with_name("episodes.csv")
    if not episodes.is_file():
        raise SystemExit(f"{episodes}: missing; the horizon summary reads the per-episode rows beside {csv.name}")
    return horizon_summary_lines(read_episodes(episodes), model)


if __name__ == "__main__":
    raise SystemExit(main())
