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

On CUDA (``--device cuda``; defaults: the issue's shapes, N = 4096 positions, student H = 2048 =
Qwen2.5-3B, teacher H = 3584 = Qwen2.5-7B) everything runs in this process: peak memory =
``torch.cuda.max_memory_allocated`` during a step minus the allocation before it (the inputs, cast to
the variant's dtype, already allocated; the gradients count), time = the median
wall time of ``--repeats`` steps after ``--warmup`` (synchronised). The inputs are drawn once in fp32
and rounded to bf16; the fp32 variants get those bf16 values upcast, so every variant sees the same
numbers and ``naive/float32`` is the exact reference. Variants, each a line::

    naive/float32, naive/bfloat16        one (N, V) piece (bf16: plain PyTorch, bf16 matmuls)
    chunked/<dtype>/<n>                  ours, n positions per token chunk (--token-chunks)
    chunked_no_top/bfloat16/<n>          ours without the top-mass diagnostics (``top_tokens=0``: no top-k
                                         pass; the recipe's ``memopd.distill.top_mass_tokens=0``), --token-chunk
    liger/bfloat16                       liger_kernel.chunked_loss.LigerFusedLinearJSDLoss (beta = 1:
                                         reverse KL; soft loss only; not compiled), when installed

``loss_err`` / ``grad_err`` are against ``naive/float32`` (gradient errors relative to the largest
reference gradient); ``naive/bfloat16``'s are the bf16 tolerance. Ends with::

    kl device=cuda vocab=<V> tokens=<N> chunk=<n> peak_mem_ratio=<naive fp32 / ours bf16> time_vs_liger=<x> ...
      ... time_vs_liger_no_top_mass=<x>
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional, Sequence

import torch

from verl_memopd.losses import Chunking, StudentLogits, divergence_loss, get_divergence, naive_divergence
from verl_memopd.losses.chunked import CUDA_TOKEN_CHUNK
from verl_memopd.supervision import HiddenTarget

__all__ = ["cuda_main", "main"]


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _inputs(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(args.seed)
    n, h, v = args.tokens, args.hidden, args.vocab
    ht = args.teacher_hidden or h
    return {
        "hs": torch.randn(n, h, generator=g).requires_grad_(),
        "ws": torch.randn(v, h, generator=g).mul_(h**-0.5).requires_grad_(),
        "ht": torch.randn(n, ht, generator=g),
        "wt": torch.randn(v, ht, generator=g).mul_(ht**-0.5),
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
    res = divergence_loss(
        div,
        StudentLogits(args.vocab, hidden=x["hs"], head_weight=x["ws"]),
        HiddenTarget(x["ht"], x["wt"], args.vocab),
        weights,
        temp,
        chunking,
    )
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


#: what a CPU worker needs from the parent's arguments
WORKER_ARGS = ("vocab", "hidden", "teacher_hidden", "tokens", "token_chunk", "vocab_chunk", "seed")


def _run_variant(variant: str, args: argparse.Namespace, out: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "verl_memopd.bench.kl",
        "--worker",
        variant,
        "--out",
        out,
        *(f"--{k.replace('_', '-')}={getattr(args, k)}" for k in WORKER_ARGS if getattr(args, k) is not None),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"kl benchmark worker {variant!r} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _max_abs_err(path_a: str, path_b: str) -> float:
    a, b = torch.load(path_a), torch.load(path_b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m verl_memopd.bench kl", description=__doc__.split("\n")[0])
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cpu (default; subprocess per variant) or cuda (in process, see the module docstring)",
    )
    p.add_argument("--vocab", type=int, default=151936, help="V (default: Qwen2.5's 151,936)")
    p.add_argument("--hidden", type=int, default=None, help="student H (default 512 on cpu, 2048 on cuda)")
    p.add_argument(
        "--teacher-hidden", type=int, default=None, help="teacher H (default: --hidden on cpu, 3584 on cuda)"
    )
    p.add_argument(
        "--tokens", type=int, default=None, help="N supervised positions (default 2048 on cpu, 4096 on cuda)"
    )
    p.add_argument(
        "--token-chunk",
        type=int,
        default=None,
        help=f"positions per chunk (default {Chunking().token_chunk_size} on cpu, {CUDA_TOKEN_CHUNK} on cuda)",
    )
    p.add_argument(
        "--token-chunks", default=None, help="cuda: comma-separated chunk sizes to compare (default: --token-chunk)"
    )
    p.add_argument("--dtypes", default="float32,bfloat16", help="cuda: input dtypes of our kernel (default both)")
    p.add_argument("--warmup", type=int, default=2, help="cuda: untimed steps per variant (default 2)")
    p.add_argument("--repeats", type=int, default=5, help="cuda: timed steps per variant, median (default 5)")
    p.add_argument("--no-liger", action="store_true", help="cuda: leave out Liger-Kernel even when installed")
    p.add_argument(
        "--profile",
        action="store_true",
        help="cuda: print a torch.profiler table (top ops by device time) of one step of ours, bf16",
    )
    p.add_argument("--vocab-chunk", type=int, default=None, help="also run a vocabulary-chunked variant (columns)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", choices=["naive", "chunked", "vocab_chunked"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(list(argv))
    cuda = args.device == "cuda"
    args.hidden = args.hidden or (2048 if cuda else 512)
    args.tokens = args.tokens or (4096 if cuda else 2048)
    args.token_chunk = args.token_chunk or (CUDA_TOKEN_CHUNK if cuda else Chunking().token_chunk_size)
    if cuda:
        args.teacher_hidden = args.teacher_hidden or 3584
    if min(args.hidden, args.tokens, args.token_chunk, args.vocab) < 1:
        p.error("--vocab, --hidden, --tokens and --token-chunk must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.device == "cuda":
        return cuda_main(args)
    if args.worker:
        return _worker(args)
    variants = ["naive", "chunked"] + (["vocab_chunked"] if args.vocab_chunk else [])
    with tempfile.TemporaryDirectory() as tmp:
        paths = {v: os.path.join(tmp, f"{v}.pt") for v in variants}
        stats = {v: _run_variant(v, args, path) for v, path in paths.items()}
        errs = {v: _max_abs_err(paths["naive"], paths[v]) for v in variants[1:]}
    naive = stats["naive"]
    for v, s in stats.items():
        ratios = (
            ""
            if v == "naive"
            else (
                f" peak_mem_ratio={naive['peak_bytes'] / s['peak_bytes']:.2f}"
                f" time_ratio={s['cpu_seconds'] / naive['cpu_seconds']:.2f}"
                f" max_abs_err={errs[v]:.2e}"
            )
        )
        print(
            f"{v:13s} cpu={s['cpu_seconds']:.2f}s wall={s['wall_seconds']:.2f}s "
            f"peak_mem={s['peak_bytes'] / 2**30:.3f}GiB{ratios}"
        )
    chunked = stats["chunked"]
    print(
        f"kl vocab={args.vocab} tokens={args.tokens} peak_mem_ratio={naive['peak_bytes'] / chunked['peak_bytes']:.2f} "
        f"time_ratio={chunked['cpu_seconds'] / naive['cpu_seconds']:.2f} max_abs_err={errs['chunked']:.2e}"
    )
    return 0


# --- CUDA: in process -------------------------------------------------------------------------------
def _cuda_inputs(args: argparse.Namespace, device: str = "cuda") -> dict[str, torch.Tensor]:
    """bf16-representable inputs on ``device``, in fp32 (see the module docstring)."""
    g = torch.Generator(device=device).manual_seed(args.seed)
    n, h, ht, v = args.tokens, args.hidden, args.teacher_hidden, args.vocab
    draw = {"hs": ((n, h), 1.0), "ws": ((v, h), h**-0.5), "ht": ((n, ht), 1.0), "wt": ((v, ht), ht**-0.5)}
    return {
        k: (torch.randn(*shape, generator=g, device=device) * sc).bfloat16().float() for k, (shape, sc) in draw.items()
    }


def _cuda_prepare(variant: str, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The inputs of ``variant`` (``kind/dtype[/chunk]``): x cast to its dtype, student tensors as leaves."""
    dtype = getattr(torch, variant.split("/")[1])
    hs, ws = (x[k].to(dtype, copy=True).requires_grad_() for k in ("hs", "ws"))
    return hs, ws, x["ht"].to(dtype), x["wt"].to(dtype)


def _cuda_run(variant: str, inputs: tuple[torch.Tensor, ...], chunk: int) -> dict[str, torch.Tensor]:
    """One forward + backward of ``variant`` on prepared inputs -> loss and the student's gradients (fp32)."""
    hs, ws, ht, wt = inputs
    kind = variant.split("/")[0]
    n, v, dev = hs.shape[0], ws.shape[0], hs.device
    div, temp, weights = get_divergence("reverse_kl"), torch.ones(n, device=dev), torch.full((n,), 1.0 / n, device=dev)
    if kind == "naive":
        loss = (weights * naive_divergence(div, hs @ ws.T, ht @ wt.T, v, temp)).sum()
    elif kind in ("chunked", "chunked_no_top"):
        loss = divergence_loss(
            div,
            StudentLogits(v, hidden=hs, head_weight=ws),
            HiddenTarget(ht, wt, v),
            weights,
            temp,
            Chunking(chunk),
            top_tokens=8 if kind == "chunked" else 0,
        ).loss
    else:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        liger = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=1.0, compiled=False)
        loss = liger(hs, ws, ht, wt, torch.zeros(n, dtype=torch.long, device=dev))
    loss.backward()
    return {"loss": loss.detach().float(), "grad_h": hs.grad.float(), "grad_w": ws.grad.float()}


def _cuda_step(variant: str, x: dict[str, torch.Tensor], chunk: int) -> dict[str, torch.Tensor]:
    """``_cuda_prepare`` then ``_cuda_run``."""
    return _cuda_run(variant, _cuda_prepare(variant, x), chunk)


def _cuda_measure(
    prepare: Callable[[], tuple], run: Callable[[tuple], dict], warmup: int, repeats: int
) -> tuple[dict, float, int]:
    """(outputs, median seconds, peak bytes above the allocation before a step) of ``run(prepare())``; the
    inputs are prepared (cast) before the clock and the memory baseline."""
    seconds, peak, out = [], 0, None
    for i in range(warmup + repeats):
        out = None
        inputs = prepare()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        out = run(inputs)
        torch.cuda.synchronize()
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
        peak = max(peak, torch.cuda.max_memory_allocated() - base)
        del inputs
    return out, statistics.median(seconds), peak


def _liger_available() -> bool:
    try:
        import liger_kernel.chunked_loss  # noqa: F401
    except Exception:  # ImportError, or its triton failing to load
        return False
    return True


def cuda_main(args: argparse.Namespace) -> int:
    """The CUDA comparison (module docstring); prints one line per variant and the summary line."""
    if not torch.cuda.is_available():
        print("kl --device cuda: torch sees no CUDA device", file=sys.stderr)
        return 3
    x = _cuda_inputs(args)
    chunks = [int(c) for c in (args.token_chunks or str(args.token_chunk)).split(",")]
    variants = ["naive/float32", "naive/bfloat16"] + [
        f"chunked/{d}/{c}" for d in args.dtypes.split(",") for c in chunks
    ]
    variants.append(f"chunked_no_top/bfloat16/{args.token_chunk}")
    if not args.no_liger and _liger_available():
        variants.append("liger/bfloat16")
    print(
        f"kl device=cuda {torch.cuda.get_device_name(0)} vocab={args.vocab} tokens={args.tokens} "
        f"student_hidden={args.hidden} teacher_hidden={args.teacher_hidden} torch={torch.__version__}",
        flush=True,
    )
    ref, results = None, {}
    for variant in variants:
        chunk = int(variant.split("/")[2]) if variant.startswith("chunked") else 0  # chunked, chunked_no_top
        try:
            out, sec, peak = _cuda_measure(
                lambda: _cuda_prepare(variant, x), lambda i: _cuda_run(variant, i, chunk), args.warmup, args.repeats
            )
        except Exception as e:  # one variant's failure (e.g. liger's triton) is its line, not the end
            print(f"kl {variant:22s} error={type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
            continue
        ref = ref if ref is not None else out  # naive/float32 runs first
        loss_err = float((out["loss"] - ref["loss"]).abs())
        grad_err = max(float((out[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ("grad_h", "grad_w"))
        results[variant] = dict(seconds=sec, peak=peak, loss_err=loss_err, grad_err=grad_err)
        print(
            f"kl {variant:22s} ms={sec * 1e3:8.1f} peak_gib={peak / 2**30:6.2f} loss={float(out['loss']):.6f} "
            f"loss_err={loss_err:.2e} grad_err={grad_err:.2e}",
            flush=True,
        )
        del out
        torch.cuda.empty_cache()
    best = f"chunked/bfloat16/{args.token_chunk}"
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _cuda_step(best, x, args.token_chunk)
            torch.cuda.synchronize()
        print(
            f"kl profile of one {best} step\n"
            + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=50)
        )
    if best in results and "naive/float32" in results:
        ours, naive = results[best], results["naive/float32"]
        liger = results.get("liger/bfloat16")
        vs = f"{ours['seconds'] / liger['seconds']:.2f}" if liger else "none"
        no_top = results.get(f"chunked_no_top/bfloat16/{args.token_chunk}")
        vs_no_top = f"{no_top['seconds'] / liger['seconds']:.2f}" if liger and no_top else "none"
        print(
            f"kl device=cuda vocab={args.vocab} tokens={args.tokens} chunk={args.token_chunk} "
            f"peak_mem_ratio={naive['peak'] / ours['peak']:.2f} time_vs_naive={ours['seconds'] / naive['seconds']:.2f} "
            f"time_vs_liger={vs} loss_err={ours['loss_err']:.2e} grad_err={ours['grad_err']:.2e} "
            f"bf16_tolerance_loss={results.get('naive/bfloat16', {}).get('loss_err', float('nan')):.2e} "
            f"bf16_tolerance_grad={results.get('naive/bfloat16', {}).get('grad_err', float('nan')):.2e} "
            f"time_vs_liger_no_top_mass={vs_no_top}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
