"""CLI of the memory benchmark.

python -m verl_memopd.tasks build --out DIR --seed 0 [--preset tiny] [--n-train N ...]
    writes DIR/{train,val,test}.parquet (verl RL format, see dataset.py) and prints sizes;
    last line: ``built preset=<p> seed=<s> train=<n> val=<n> test=<n> out=<DIR>``
python -m verl_memopd.tasks oracle DIR/val.parquet [--traces OUT.parquet]
    runs the scripted oracle on every row; --traces writes its calls as chat messages
    (columns episode_id, call, messages) for teacher SFT;
    last line: ``oracle F1=<x> EM=<y> episodes=<n>``
python -m verl_memopd.tasks convert IN [IN ...] --out DIR --tokenizer MODEL_DIR --chunk-tokens N
        [--format auto|...] [--answer-mode auto|any|all] [--keep-instructions] [--corpus FILE]
        [--split NAME] [--max-chunks M] [--strict] [--overwrite] [--task TEXT]
        [--memory-tokens T --answer-tokens A]
    your own long-context QA (JSON lines, JSON or parquet, gzip or not; source formats in tasks/formats.py)
    -> DIR/<split>.parquet, the rows the agent loop reads; prints every refused record with its place
    (FILE line L | FILE [i] | FILE row i) and why, then statistics and the rollout lengths the rows
    need (for the memory/answer budgets given); last line:
    ``converted rows=<n> refused=<r> chunks_mean=<c> chunk_tokens_max=<t>``.
    An existing DIR/<split>.parquet is refused unless --overwrite; the file is written to a temporary
    file and renamed when complete. Exit 1 when no row converted, or with --strict when any row was
    refused: nothing is written then (with --overwrite an old DIR/<split>.parquet is removed, so no
    stale file looks current). Exit 2 for a file that cannot be read (one line naming it).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from verl_memopd.tasks.convert import FORMAT_NAMES, Options, convert_records, write_rows_atomic
from verl_memopd.tasks.dataset import parse_row, read_rows, to_row, write_rows
from verl_memopd.tasks.generator import PRESETS, generate, get_preset
from verl_memopd.tasks.oracle import run_oracle
from verl_memopd.tasks.prompts import MemoryPrompts
from verl_memopd.tasks.readers import InputError, read_corpus, read_located

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
        print(
            f"{split}: {n} episodes -> {out / f'{split}.parquet'} ({size_mb:.1f} MiB, {time.perf_counter() - t0:.1f}s)"
        )
    print(
        f"built preset={preset.name} seed={args.seed} " + " ".join(f"{s}={n}" for s, n in sizes.items()) + f" out={out}"
    )


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
            traces += [
                {"episode_id": row["extra_info"].get("episode_id", str(i)), "call": t, "messages": m}
                for t, m in enumerate(episode.messages(row["prompt"]))
            ]
    if args.traces:
        write_rows(traces, args.traces)
        print(f"traces: {len(traces)} calls -> {args.traces}")
    print(f"oracle F1={f1 / len(rows):.4f} EM={em / len(rows):.4f} episodes={len(rows)}")


def convert(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from verl_memopd.tasks.needs import METADATA_KEY

    path = Path(args.out) / f"{args.split}.parquet"
    if path.exists() and not args.overwrite:
        print(
            f"{path} already exists ({_row_count(path)} rows): nothing converted; pass --overwrite to replace it, "
            "or choose another --out / --split"
        )
        return 1
    try:
        records = [r for name in args.input for r in read_located(name)]
        corpus = read_corpus(args.corpus) if args.corpus else None
    except InputError as e:
        print(f"error: {e}")
        return 2
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    options = Options(args.answer_mode, args.keep_instructions, corpus)
    print(
        f"convert {' '.join(args.input)}: {len(records)} records, --format {args.format}, --answer-mode "
        f"{args.answer_mode}, chunks of <= {args.chunk_tokens} tokens ({args.tokenizer})"
        + (f", corpus {args.corpus} ({len(corpus)} documents)" if corpus else "")
    )
    prompts = MemoryPrompts(task=args.task) if args.task is not None else MemoryPrompts()
    result = convert_records(
        records,
        tokenizer,
        args.chunk_tokens,
        args.format,
        args.split,
        Path(args.input[0]).stem,
        args.max_chunks,
        prompts,
        options,
        on_warning=print,
    )
    print(
        "\n".join(
            line
            for line in result.summary(args.chunk_tokens, args.memory_tokens, args.answer_tokens)
            if not line.startswith("warning: ") or line not in result.warnings
        )
    )
    failed = not result.rows or (args.strict and result.refusals)
    if failed:
        print("nothing written: " + ("no row converted" if not result.rows else "--strict and rows were refused"))
        if path.exists():  # only reached with --overwrite
            path.unlink()
            print(f"removed the old {path} (--overwrite): it no longer matches the input")
    else:
        needs = result.data_needs(args.tokenizer)
        write_rows_atomic(result.rows, path, {METADATA_KEY: needs.to_json().encode()} if needs else None)
        print(f"wrote {path}")
    print(result.last_line())
    return 1 if failed else 0


def _row_count(path: Path) -> str:
    try:
        import pyarrow.parquet as pq

        return str(pq.read_metadata(path).num_rows)
    except Exception:  # noqa: BLE001 -- only for the message
        return "?"


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
    c = sub.add_parser("convert", help="your own long-context QA -> agent rows (see verl_memopd/tasks/convert.py)")
    c.add_argument("input", nargs="+", help="JSON lines, JSON or parquet files (gzip or not), read in order")
    c.add_argument("--out", required=True, help="output folder; writes <out>/<split>.parquet")
    c.add_argument("--tokenizer", required=True, help="the student model's folder (its tokenizer cuts the chunks)")
    c.add_argument("--chunk-tokens", type=int, required=True, help="at most this many tokens per chunk")
    c.add_argument(
        "--format",
        default="auto",
        choices=FORMAT_NAMES,
        help="the records' format (default: auto, recognised per record; see tasks/formats.py)",
    )
    c.add_argument(
        "--answer-mode",
        default="auto",
        choices=("auto", "any", "all"),
        help="any: a question's answers are aliases; all: values that must all be given; "
        "auto (default): the source format's (RULER niah/vt/cwe/fwe: all) or the record's answer_mode",
    )
    c.add_argument(
        "--keep-instructions",
        action="store_true",
        help="keep RULER's instruction text in the question (default: stripped, the question kept)",
    )
    c.add_argument(
        "--corpus",
        default=None,
        help="documents that index contexts point into (MemAgent's squad.json / "
        "hotpotqa_dev.json, or a JSON array of strings)",
    )
    c.add_argument("--overwrite", action="store_true", help="replace an existing <out>/<split>.parquet")
    c.add_argument(
        "--memory-tokens",
        type=int,
        default=256,
        help="memopd.agent.memory_tokens, for the printed response length the rows need (default 256)",
    )
    c.add_argument("--answer-tokens", type=int, default=64, help="memopd.agent.answer_tokens, likewise (default 64)")
    c.add_argument("--split", default="train", help="output file name and extra_info.split (default: train)")
    c.add_argument(
        "--max-chunks",
        type=int,
        default=None,
        help="refuse rows with more chunks, and stop cutting them there (default: no limit)",
    )
    c.add_argument("--strict", action="store_true", help="exit 1 and write nothing if any row is refused")
    c.add_argument("--task", default=None, help="task text at the top of q (default: MemoryPrompts.task)")
    args = parser.parse_args(argv)
    if args.command == "convert":
        return convert(args)
    {"build": build, "oracle": oracle}[args.command](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
