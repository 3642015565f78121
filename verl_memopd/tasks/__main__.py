"""CLI of the memory benchmark.

    python -m verl_memopd.tasks build --out DIR --seed 0 [--preset tiny] [--n-train N ...]
        writes DIR/{train,val,test}.parquet (verl RL format, see dataset.py) and prints sizes;
        last line: ``built preset=<p> seed=<s> train=<n> val=<n> test=<n> out=<DIR>``
    python -m verl_memopd.tasks oracle DIR/val.parquet [--traces OUT.parquet]
        runs the scripted oracle on every row; --traces writes its calls as chat messages
        (columns episode_id, call, messages) for teacher SFT;
        last line: ``oracle F1=<x> EM=<y> episodes=<n>``
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from verl_memopd.tasks.dataset import parse_row, read_rows, to_row, write_rows
from verl_memopd.tasks.generator import PRESETS, generate, get_preset
from verl_memopd.tasks.oracle import run_oracle

SPLITS = ("train", "val", "test")


def build(args: argparse.Namespace) -> None:
    preset = get_preset(args.preset)
    out = Path(args.out)
    sizes = {s: getattr(args, f"n_{s}") if getattr(args, f"n_{s}") is not None else preset.sizes[s] for s in SPLITS}
    for split, n in sizes.items():
        t0 = time.perf_counter()
        rows = (to_row(generate(preset.config, args.seed, split, i), preset.name, split, i) for i in range(n))
        write_rows(rows, out / f"{split}.parquet")
        size_mb = (out / f"{split}.parquet").stat().st_size / 2**20
        print(f"{split}: {n} episodes -> {out / f'{split}.parquet'} ({size_mb:.1f} MiB, {time.perf_counter() - t0:.1f}s)")
    print(f"built preset={preset.name} seed={args.seed} " + " ".join(f"{s}={n}" for s, n in sizes.items()) + f" out={out}")


def oracle(args: argparse.Namespace) -> None:
    rows = read_rows(args.path)
    if not rows:
        raise SystemExit(f"{args.path}: no rows")
    f1 = em = 0.0
    traces = []
    for i, row in enumerate(rows):
        task = parse_row(row.get("extra_info"), row.get("reward_model"), where=f"{args.path} row {i}")
        episode = run_oracle(task)
        f1, em = f1 + episode.score.f1, em + episode.score.em
        if args.traces:
            traces += [{"episode_id": row["extra_info"].get("episode_id", str(i)), "call": t, "messages": m}
                       for t, m in enumerate(episode.messages(row["prompt"]))]
    if args.traces:
        write_rows(traces, args.traces)
        print(f"traces: {len(traces)} calls -> {args.traces}")
    print(f"oracle F1={f1 / len(rows):.4f} EM={em / len(rows):.4f} episodes={len(rows)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_memopd.tasks", description="memory benchmark")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write train/val/test parquet files")
    b.add_argument("--out", required=True)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    for split in SPLITS:
        b.add_argument(f"--n-{split}", type=int, default=None, help=f"episodes in {split} (default: the preset's)")
    o = sub.add_parser("oracle", help="score the scripted oracle on a parquet split")
    o.add_argument("path")
    o.add_argument("--traces", default=None, help="write the oracle's calls as chat messages to this parquet file")
    args = parser.parse_args(argv)
    {"build": build, "oracle": oracle}[args.command](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
