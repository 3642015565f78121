"""Threads benchmark: the recipe's fp32 step with verl's Ray workers on one torch thread, then on ``--threads``,
on the same data and seeds, in one invocation.

    python -m verl_memopd.bench threads [--model tiny|smollm2] [--steps K] [--threads N] [--out DIR]

Ray gives an actor started without ``num_cpus`` -- verl's worker groups on the CPU platform -- ``OMP_NUM_THREADS=1``
unless the variable is already set, which Ray leaves alone. This benchmark runs ``bench step``'s fp32 command
(:func:`verl_memopd.bench.step.command`) twice, with ``OMP_NUM_THREADS=1`` and ``=N`` (default: this machine's CPU
count), times the steady steps (step 1 and the audit step K never, as ``bench step``), prints the per-stage table
and ends with exactly one line::

    threads model=<name> threads=<n> one_s=<s> many_s=<s> speedup=<x> gen_speedup=<x> teacher_speedup=<x> \
        update_actor_speedup=<x> update_critic_speedup=<x> probs_diff_max_many=<v>

(one line; wrapped here). Ratios are one-thread seconds over N-thread seconds (> 1: more threads are faster);
``probs_diff_max_many`` is the N-thread run's largest ``training/rollout_probs_diff_max`` (vLLM's rollout
log-probs vs the trainer's). Different thread counts reduce in different orders, so the two runs may sample
slightly different tokens: the table's token counts say whether the work was the same.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from verl_memopd.bench.step import MODELS, StepRun, prepare, ratio, run_variant, steady_steps, table

__all__ = ["main", "summary_line"]

#: the stages with their own ratio in the last line (verl's ``timing_s/<stage>``; ``step`` is ``speedup``)
LINE_STAGES = ("gen", "teacher", "update_actor", "update_critic")


def summary_line(model: str, threads: int, runs: dict[str, StepRun]) -> str:
    """The last line from the ``one`` and ``many`` runs."""
    one, many = runs["one"], runs["many"]
    stages = " ".join(f"{s}_speedup={ratio(one.stage_s(s), many.stage_s(s)):.3f}" for s in LINE_STAGES)
    return (
        f"threads model={model} threads={threads} one_s={one.stage_s('step'):.3f} many_s={many.stage_s('step'):.3f} "
        f"speedup={ratio(one.stage_s('step'), many.stage_s('step')):.3f} {stages} "
        f"probs_diff_max_many={many.max_over_steps('training/rollout_probs_diff_max'):.4g}"
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m verl_memopd.bench threads")
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--steps", type=int, default=3, help="steps per run (>= 2; step 1 untimed)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of the second run")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_step"), help="models, data and the runs' logs")
    parser.add_argument("--timeout-s", type=float, default=7200, help="bound of each verl run")
    args = parser.parse_args(argv)
    if args.threads < 2:
        parser.error(f"--threads {args.threads}: the second run must use more than the first run's one thread")
    steady_steps(args.steps, args.steps)  # fails early on --steps < 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    paths = prepare(args.model, out)
    runs = {
        label: run_variant(args.model, "fp32", args.steps, paths, out, args.timeout_s, label=label, threads=n)
        for label, n in (("one", 1), ("many", args.threads))
    }
    print(table(runs))
    print(summary_line(args.model, args.threads, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
