"""KL benchmark: chunked vs naive full-vocabulary reverse KL, forward + backward, on CPU.

Setup (seeded): N supervised positions; student hidden (N, H) and head (V, H) with gradients;
teacher hidden (N, H) and head (V, H) frozen (the ``hidden`` transport); per-token weights 1/N;
temperature 1. One step = the weighted divergence and its backward into both student tensors::

    naive    z = hidden @ head.T for all N at once -> log_softmax -> KL -> backward    (several (N, V) fp32)
    chunked  verl_memopd.losses.divergence_loss, default Chunking                   (no (N, V) buffer)

Each variant runs one step in its own subprocess (``--worker``), so that one variant's memory
cannot hide in the other's high-water mark:

    peak memory = ru_maxrss after the step - VmRSS just before it (inputs already built)

i.e. the step's own resident high-water: temporaries plus the gradients (the same for both).
RSS sees torch's CPU allocations (tracemalloc does not); inputs are made in place, so nothing
before the step exceeds the baseline.

    time = CPU time of the step (user + system, all threads: ``time.process_time``)

The build machines' cores are shared with other jobs, which makes wall time swing by several x
from run to run while CPU time stays within a few percent; wall time is printed as well. Workers
save per-token values and gradients; ``max_abs_err`` is the largest absolute difference between
the two variants over all of them. ``--vocab-chunk C`` adds a third, informative variant that
also chunks the vocabulary (C columns). Ends with::

    kl vocab=<V> tokens=<N> peak_mem_ratio=<naive/chunked> time_ratio=<chunked/naive> max_abs_err=<e>
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

import torch

from verl_memopd.losses import Chunking, StudentLogits, divergence_loss, get_divergence, naive_divergence
from verl_memopd.supervision import HiddenTarget

__all__ = ["main"]


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _inputs(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(args.seed)
    n, h, v = args.tokens, args.hidden, args.vocab
    scale = h ** -0.5
    return {
        "hs": torch.randn(n, h, generator=g).requires_grad_(),
        "ws": torch.randn(v, h, generator=g).mul_(scale).requires_grad_(),
        "ht": torch.randn(n, h, generator=g),
        "wt": torch.randn(v, h, generator=g).mul_(scale),
    }


def _step(variant: str, x: dict[str, torch.Tensor], args: argparse.Namespace) -> torch.Tensor:
    """Forward + backward; returns the (N,) per-token divergences."""
    div, n = get_divergence("reverse_kl"), args.tokens
    weights, temp = torch.full((n,), 1.0 / n), torch.ones(n)
    if variant == "naive":
        per_token = naive_divergence(div, x["hs"] @ x["ws"].T, x["ht"] @ x["wt"].T, args.vocab, temp)
        (weights * per_token).sum().backward()
        return per_token.detach()
    chunking = Chunking(args.token_chunk, args.vocab_chunk if variant == "vocab_chunked" else None)
    res = divergence_loss(div, StudentLogits(args.vocab, hidden=x["hs"], head_weight=x["ws"]),
                          HiddenTarget(x["ht"], x["wt"], args.vocab), weights, temp, chunking)
    res.loss.backward()
    return res.per_token


def _worker(args: argparse.Namespace) -> int:
    x = _inputs(args)
    base = _rss_bytes()
    cpu, wall = time.process_time(), time.perf_counter()
    per_token = _step(args.worker, x, args)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    torch.save({"per_token": per_token, "grad_h": x["hs"].grad, "grad_w": x["ws"].grad}, args.out)
    print(json.dumps({"cpu_seconds": cpu, "wall_seconds": wall, "peak_bytes": peak}))
    return 0


def _run_variant(variant: str, args: argparse.Namespace, out: str) -> dict:
    cmd = [sys.executable, "-m", "verl_memopd.bench.kl", "--worker", variant, "--out", out,
           *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("worker", "out") and v is not None)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"kl benchmark worker {variant!r} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _max_abs_err(path_a: str, path_b: str) -> float:
    a, b = torch.load(path_a), torch.load(path_b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m verl_memopd.bench kl", description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=151936, help="V (default: Qwen2.5's 151,936)")
    p.add_argument("--hidden", type=int, default=512, help="H (default 512)")
    p.add_argument("--tokens", type=int, default=2048, help="N supervised positions (default 2048)")
    p.add_argument("--token-chunk", type=int, default=Chunking().token_chunk_size, help="positions per chunk")
    p.add_argument("--vocab-chunk", type=int, default=None, help="also run a vocabulary-chunked variant (columns)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", choices=["naive", "chunked", "vocab_chunked"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(list(argv))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return _worker(args)
    variants = ["naive", "chunked"] + (["vocab_chunked"] if args.vocab_chunk else [])
    with tempfile.TemporaryDirectory() as tmp:
        paths = {v: os.path.join(tmp, f"{v}.pt") for v in variants}
        stats = {v: _run_variant(v, args, path) for v, path in paths.items()}
        errs = {v: _max_abs_err(paths["naive"], paths[v]) for v in variants[1:]}
    naive = stats["naive"]
    for v, s in stats.items():
        ratios = "" if v == "naive" else (
            f" peak_mem_ratio={naive['peak_bytes'] / s['peak_bytes']:.2f} time_ratio={s['cpu_seconds'] / naive['cpu_seconds']:.2f}"
            f" max_abs_err={errs[v]:.2e}")
        print(f"{v:13s} cpu={s['cpu_seconds']:.2f}s wall={s['wall_seconds']:.2f}s peak_mem={s['peak_bytes'] / 2**30:.3f}GiB{ratios}")
    chunked = stats["chunked"]
    print(f"kl vocab={args.vocab} tokens={args.tokens} peak_mem_ratio={naive['peak_bytes'] / chunked['peak_bytes']:.2f} "
          f"time_ratio={chunked['cpu_seconds'] / naive['cpu_seconds']:.2f} max_abs_err={errs['chunked']:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
