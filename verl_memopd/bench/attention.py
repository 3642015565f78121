"""Packed attention alone on CUDA: the ``torch_varlen`` backend's GQA handling, per layer.

torch 2.11's public ``varlen_attn`` has no ``enable_gqa``; the backend (``attention.call_varlen_attn``)
then calls the private op underneath with the K/V heads as they are (the flash kernel's own GQA) and
only without that op repeats the K/V heads to the query heads (``repeat_interleave``, 8x for
Qwen2.5-3B's 16 / 2 heads; backward sums them again). This benchmark times forward + backward of one
layer's packed attention on ``bench.packing``'s episodes (``--episodes``), Qwen2.5-3B's heads, bf16, the
key gather ``index_select`` included::

    torch_varlen    the backend as shipped
    varlen_repeat   K/V heads repeated to Hq, then the public ``varlen_attn`` (the fallback)
    flash_attn      flash-attn varlen (if installed)

Each line: median ms over ``--repeats`` and, per output / gradient, the largest difference from
``varlen_repeat`` relative to that tensor's largest magnitude (bf16 rounding: ~1e-2).
``python -m verl_memopd.bench attention [--episodes 8]`` (CUDA only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, Optional, Sequence

import torch

__all__ = ["repeat_kv_varlen", "main"]


def repeat_kv_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """The fallback: K/V heads repeated to Hq, then ``call_varlen_attn`` with equal head counts."""
    from torch.nn.attention.varlen import varlen_attn

    from verl_memopd.attention import call_varlen_attn

    groups = q.shape[1] // k.shape[1]
    return call_varlen_attn(
        varlen_attn, q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), meta, scale
    )


def _variants() -> dict[str, Callable]:
    from verl_memopd.attention import get_backend

    variants = {
        "varlen_repeat": repeat_kv_varlen,
        "torch_varlen": lambda q, k, v, meta, scale: get_backend("torch_varlen")(q, k, v, meta, scale, 0.0),
    }
    try:
        import flash_attn  # noqa: F401

        variants["flash_attn"] = lambda q, k, v, meta, scale: get_backend("flash_attn")(q, k, v, meta, scale, 0.0)
    except ImportError:
        pass
    return variants


def _run(fn: Callable, q, k, v, meta, scale, proj) -> tuple[torch.Tensor, ...]:
    """Gather keys (``meta.key_index``), attend, backward of ``(out * proj).sum()``: output and gradients."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k.index_select(0, meta.key_index), v.index_select(0, meta.key_index), meta, scale)
    (out.float() * proj).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_memopd.bench attention", description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention: needs CUDA", file=sys.stderr)
        return 3
    from verl_memopd.bench.gpucheck import QWEN_3B, _packed_meta

    meta = _packed_meta(args.episodes, args.seed, "cuda", QWEN_3B.vocab)
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    n, d = meta.num_tokens, QWEN_3B.head_dim
    q, k, v = (
        torch.randn(n, h, d, generator=g, device="cuda").bfloat16()
        for h in (QWEN_3B.heads, QWEN_3B.kv_heads, QWEN_3B.kv_heads)
    )
    proj = torch.randn(n, QWEN_3B.heads, d, generator=g, device="cuda")
    scale = d**-0.5
    print(
        f"attention: {n} query tokens, {meta.key_index.numel()} gathered keys, {len(meta.bounds)} segments, "
        f"heads {QWEN_3B.heads}/{QWEN_3B.kv_heads}, torch {torch.__version__}",
        flush=True,
    )
    ref = None
    for name, fn in _variants().items():
        try:
            out = _run(fn, q, k, v, meta, scale, proj)
            times = []
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                start = time.perf_counter()
                _run(fn, q, k, v, meta, scale, proj)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
        except Exception as e:  # a variant this torch lacks is its line, not the end
            print(f"attention {name:14s} error={type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        ref = ref if ref is not None else out
        diffs = [float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(out, ref)]
        print(
            f"attention {name:14s} ms={statistics.median(times) * 1e3:7.3f} rel_diff_vs_varlen_repeat out/dq/dk/dv="
            + "/".join(f"{d:.1e}" for d in diffs),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
