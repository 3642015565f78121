"""Packed attention alone on CUDA: how the ``torch_varlen`` backend's GQA handling costs, per layer.

torch 2.11's public ``varlen_attn`` has no ``enable_gqa``, so ``attention.call_varlen_attn`` repeats the
K/V heads to the query heads (``repeat_interleave``, 8x for Qwen2.5-3B's 16 / 2 heads) before the
kernel, and backward sums them again. The flash kernel underneath takes fewer K/V heads natively.
This benchmark times forward + backward of one layer's packed attention on ``bench.packing``'s
episodes (``--episodes``), Qwen2.5-3B's heads, bf16, and the key gather ``index_select`` included::

    varlen_repeat   backend torch_varlen as shipped (call_varlen_attn)
    varlen_gqa      torch's private op ``torch.ops.torch_attn._varlen_attn`` with the Hkv heads (if present)
    flash_attn      flash-attn varlen (if installed)

Each line: median ms over ``--repeats`` and the largest difference of output and gradients from
``varlen_repeat``. ``python -m verl_memopd.bench attention [--episodes 8]`` (CUDA only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, Optional, Sequence

import torch

__all__ = ["native_gqa_varlen", "main"]


def native_gqa_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """Causal varlen attention through ``torch.ops.torch_attn._varlen_attn`` with K/V at their own head
    count (the flash kernel's GQA); arguments named from the op's schema, whatever its torch version."""
    op = torch.ops.torch_attn._varlen_attn
    names = [a.name for a in op.default._schema.arguments]
    kwargs: dict[str, object] = {}
    if "is_causal" in names:
        kwargs["is_causal"] = True
    if "window_size" in names:
        kwargs["window_size"] = [-1, 0] if "is_causal" not in names else [-1, -1]
    if "scale" in names:
        kwargs["scale"] = scale
    if "enable_gqa" in names:
        kwargs["enable_gqa"] = True
    out = op(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k, **kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


def _variants() -> dict[str, Callable]:
    from verl_memopd.attention import get_backend

    variants = {"varlen_repeat": lambda q, k, v, meta, scale: get_backend("torch_varlen")(q, k, v, meta, scale, 0.0),
                "varlen_gqa": native_gqa_varlen}
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
    from verl_memopd.gpucheck import QWEN_3B, _packed_meta

    meta = _packed_meta(args.episodes, args.seed, "cuda", QWEN_3B.vocab)
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    n, d = meta.num_tokens, QWEN_3B.head_dim
    q, k, v = (torch.randn(n, h, d, generator=g, device="cuda").bfloat16()
               for h in (QWEN_3B.heads, QWEN_3B.kv_heads, QWEN_3B.kv_heads))
    proj = torch.randn(n, QWEN_3B.heads, d, generator=g, device="cuda")
    scale = d ** -0.5
    print(f"attention: {n} query tokens, {meta.key_index.numel()} gathered keys, {len(meta.bounds)} segments, "
          f"heads {QWEN_3B.heads}/{QWEN_3B.kv_heads}, torch {torch.__version__}", flush=True)
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
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(out, ref))
        print(f"attention {name:14s} ms={statistics.median(times) * 1e3:7.3f} max_diff_vs_varlen_repeat={diff:.3e}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
