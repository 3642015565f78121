"""``python -m verl_memopd.gpucheck``: what the CPU tests cannot show, checked in minutes on one CUDA GPU.

Three checks, one line each (``PASS``/``FAIL`` last); exit status 0 when all pass, 1 otherwise, and
``NO_CUDA_STATUS`` (3) with a message on a machine without CUDA::

    gpucheck attention backend=flash_attn tokens=<N> fwd_err=<e> fwd_budget=<b> bwd_err=<e> bwd_budget=<b> PASS
    gpucheck packing speedup_vs_per_call=<x> ideal=<y> efficiency=<x/y> PASS
    gpucheck kl vocab=<V> tokens=<N> peak_mem_ratio=<naive/chunked> time_ratio=<chunked/naive> max_abs_err=<e> PASS

attention
    The packed layout of random episodes (``bench.packing.SHAPE``), Qwen2.5-3B's head shape
    (16 query heads, 2 KV heads, head_dim 128), run by ``backend`` in bf16, forward and backward
    (gradients of a fixed random projection of the output into q and the un-gathered k, v).
    Error budget, flash-attention's own test convention: the error against an fp32 reference
    (the ``torch`` backend on the same bf16 inputs, upcast) may be at most ``FWD_FACTOR`` (forward)
    / ``BWD_FACTOR`` (gradients) times the error of plain PyTorch in bf16 (``plain_bf16_attention``:
    bf16 matmuls, fp32 softmax rounded to bf16) against that reference, plus one bf16 ulp of the
    reference's largest magnitude.
packing
    ``bench.packing``'s step (forward, full-vocabulary action log-probs, backward) on a 4-layer model
    with Qwen2.5-3B's layer shape and vocabulary, bf16: ``packed`` (``backend``) vs the faster of
    ``per_call`` padded (sdpa) and ``per_call_varlen`` (``backend``). PASS: packed is not slower.
kl
    Full-vocabulary reverse KL (the ``hidden`` transport) forward + backward, chunked
    (``losses.divergence_loss``) vs naive (``losses.naive_divergence``), fp32. Peak memory =
    ``torch.cuda.max_memory_allocated`` during the step minus the allocation before it. PASS:
    chunked needs at least ``KL_MIN_MEMORY_RATIO`` times less and agrees with naive.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["NO_CUDA_STATUS", "ModelShape", "QWEN_3B", "plain_bf16_attention", "attention_check", "packing_check", "kl_check", "main"]

#: Exit status when no CUDA device is visible (distinct from a failed check, 1).
NO_CUDA_STATUS = 3
FWD_FACTOR, BWD_FACTOR = 2.0, 3.0
KL_MIN_MEMORY_RATIO = 2.0
BF16_ULP = 2.0 ** -7


@dataclass(frozen=True)
class ModelShape:
    """Attention heads (query, KV), head_dim, hidden size, MLP width and vocabulary of the checked model."""

    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int


#: Qwen2.5-3B's shape (the student of the 1-node recipe).
QWEN_3B = ModelShape(heads=16, kv_heads=2, head_dim=128, hidden=2048, intermediate=11008, vocab=151936)


def plain_bf16_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """Plain PyTorch attention in the inputs' dtype, per segment, bottom-right causal.

    q (N, Hq, D); k, v (Nk, Hkv, D) gathered by ``meta.key_index`` -> (N, Hq, D). Matmuls run in the
    inputs' dtype; the softmax in fp32, its probabilities rounded back to that dtype.
    """
    groups = q.shape[1] // k.shape[1]
    outs = []
    for qa, qb, ka, kb in meta.bounds:
        qs = q[qa:qb].transpose(0, 1)                                          # (Hq, Lq, D)
        ks, vs = (x[ka:kb].repeat_interleave(groups, dim=1).transpose(0, 1) for x in (k, v))  # (Hq, Lk, D)
        n, m = qb - qa, kb - ka
        scores = (qs @ ks.transpose(1, 2)) * scale                             # (Hq, Lq, Lk)
        visible = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
        probs = scores.float().masked_fill(~visible, float("-inf")).softmax(-1).to(q.dtype)
        outs.append((probs @ vs).transpose(0, 1))                              # (Lq, Hq, D)
    return torch.cat(outs)


def _packed_meta(episodes: int, seed: int, device: str, vocab: int):
    from verl_memopd.bench.packing import SHAPE
    from verl_memopd.packing import build_layout
    from verl_memopd.rce import random_episodes

    eps = random_episodes(episodes, vocab, seed, SHAPE)
    return build_layout("packed", eps, vocab).segments.to(device)


def _attention_outputs(fn, q, k, v, meta, scale, proj) -> tuple[torch.Tensor, ...]:
    """Output and gradients (q, stream k, stream v) of ``(fn(q, k[idx], v[idx]) * proj).sum()``."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k.index_select(0, meta.key_index), v.index_select(0, meta.key_index), meta, scale)
    (out.float() * proj).sum().backward()
    return tuple(x.detach().float() for x in (out, q.grad, k.grad, v.grad))


def _exact_sdpa(device: str):
    """fp32 reference: SDPA's math kernel, without TF32 (CUDA may otherwise pick a fused kernel)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.matmul.allow_tf32 = False
    return sdpa_kernel([SDPBackend.MATH])


def attention_check(backend: str = "flash_attn", episodes: int = 8, seed: int = 0, device: str = "cuda",
                    shape: ModelShape = QWEN_3B) -> dict:
    """Packed attention of ``backend`` in bf16 vs an fp32 reference, budgeted by plain bf16 PyTorch's error."""
    from verl_memopd.attention import get_backend

    meta = _packed_meta(episodes, seed, device, shape.vocab)
    n, d = meta.num_tokens, shape.head_dim
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(n, h, d, generator=g, device=device).to(torch.bfloat16)
               for h in (shape.heads, shape.kv_heads, shape.kv_heads))
    proj = torch.randn(n, shape.heads, d, generator=g, device=device)
    scale = d ** -0.5
    torch_ref = get_backend("torch")
    with _exact_sdpa(device):
        ref = _attention_outputs(lambda *a: torch_ref(*a, 0.0), q.float(), k.float(), v.float(), meta, scale, proj)
    plain = _attention_outputs(plain_bf16_attention, q, k, v, meta, scale, proj)
    got = _attention_outputs(lambda *a: get_backend(backend)(*a, 0.0), q, k, v, meta, scale, proj)

    def err(xs, i):
        return (xs[i] - ref[i]).abs().max().item()

    def budget(factor, i):
        return factor * err(plain, i) + BF16_ULP * ref[i].abs().max().item()

    fwd_err, fwd_budget = err(got, 0), budget(FWD_FACTOR, 0)
    bwd = [(err(got, i), budget(BWD_FACTOR, i)) for i in (1, 2, 3)]  # dq, dk, dv
    bwd_err, bwd_budget = max(bwd, key=lambda eb: eb[0] / eb[1])
    passed = fwd_err <= fwd_budget and all(e <= b for e, b in bwd)
    return dict(backend=backend, tokens=n, fwd_err=fwd_err, fwd_budget=fwd_budget, bwd_err=bwd_err,
                bwd_budget=bwd_budget, passed=passed)


def packing_check(backend: str = "flash_attn", episodes: int = 8, layers: int = 4, seed: int = 0,
                  warmup: int = 2, repeats: int = 5, device: str = "cuda", shape: ModelShape = QWEN_3B) -> dict:
    """``bench.packing``'s speed ratio on a model of ``shape``, ``layers`` deep, random weights, bf16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl_memopd.attention import hf_name
    from verl_memopd.bench.packing import SHAPE, layout_work, step_seconds
    from verl_memopd.packing import build_layout
    from verl_memopd.rce import random_episodes

    c = shape
    config = Qwen2Config(vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=c.intermediate,
                         num_hidden_layers=layers, num_attention_heads=c.heads, num_key_value_heads=c.kv_heads,
                         head_dim=c.head_dim, max_position_embeddings=32768, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(device, torch.bfloat16).train()
    eps = random_episodes(episodes, c.vocab, seed, SHAPE)
    layouts = {name: build_layout(name, eps, c.vocab) for name in ("packed", "per_call", "per_call_varlen")}
    seconds = step_seconds(model, {
        "per_call_padded": (layouts["per_call"], "sdpa"),
        "per_call_varlen": (layouts["per_call_varlen"], hf_name(backend)),
        "packed": (layouts["packed"], hf_name(backend)),
    }, warmup, repeats)
    speedup = min(seconds["per_call_padded"], seconds["per_call_varlen"]) / seconds["packed"]
    ideal = layout_work(layouts["per_call_varlen"], config) / layout_work(layouts["packed"], config)
    return dict(speedup_vs_per_call=speedup, ideal=ideal, efficiency=speedup / ideal,
                seconds=seconds, passed=speedup >= 1.0)


def kl_check(vocab: int = QWEN_3B.vocab, hidden: int = QWEN_3B.hidden, tokens: int = 2048, seed: int = 0,
             device: str = "cuda") -> dict:
    """Peak CUDA memory and time of chunked vs naive full-vocabulary reverse KL, forward + backward."""
    from verl_memopd.losses import Chunking, StudentLogits, divergence_loss, get_divergence, naive_divergence
    from verl_memopd.supervision import HiddenTarget

    div = get_divergence("reverse_kl")
    g = torch.Generator(device=device).manual_seed(seed)
    s = hidden ** -0.5
    hs, ws, ht, wt = (torch.randn(*shape, generator=g, device=device) * sc
                      for shape, sc in (((tokens, hidden), 1.0), ((vocab, hidden), s), ((tokens, hidden), 1.0),
                                        ((vocab, hidden), s)))
    weights, temp = torch.full((tokens,), 1.0 / tokens, device=device), torch.ones(tokens, device=device)
    results = {}
    for variant in ("naive", "chunked"):
        x_h, x_w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        if variant == "naive":
            per_token = naive_divergence(div, x_h @ x_w.T, ht @ wt.T, vocab, temp)
            (weights * per_token).sum().backward()
        else:
            res = divergence_loss(div, StudentLogits(vocab, hidden=x_h, head_weight=x_w),
                                  HiddenTarget(ht, wt, vocab), weights, temp, Chunking())
            res.loss.backward()
            per_token = res.per_token
        torch.cuda.synchronize(device)
        results[variant] = dict(seconds=time.perf_counter() - start,
                                peak_bytes=torch.cuda.max_memory_allocated(device) - base,
                                values=(per_token.detach(), x_h.grad, x_w.grad))
        del x_h, x_w, per_token
    naive, chunked = results["naive"], results["chunked"]
    max_abs_err = max((a - b).abs().max().item() for a, b in zip(naive["values"], chunked["values"]))
    scale = max(v.abs().max().item() for v in naive["values"])
    ratio = naive["peak_bytes"] / chunked["peak_bytes"]
    return dict(vocab=vocab, tokens=tokens, peak_mem_ratio=ratio, time_ratio=chunked["seconds"] / naive["seconds"],
                max_abs_err=max_abs_err, naive_peak_gib=naive["peak_bytes"] / 2**30,
                chunked_peak_gib=chunked["peak_bytes"] / 2**30,
                passed=ratio >= KL_MIN_MEMORY_RATIO and max_abs_err <= 1e-3 * scale)


def _line(name: str, result: dict, keys: Sequence[str]) -> str:
    fields = " ".join(f"{k}={result[k]:.4g}" if isinstance(result[k], float) else f"{k}={result[k]}" for k in keys)
    return f"gpucheck {name} {fields} {'PASS' if result['passed'] else 'FAIL'}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_memopd.gpucheck", description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="flash_attn", choices=["flash_attn", "torch_varlen"],
                   help="packed attention backend under test (default flash_attn)")
    p.add_argument("--episodes", type=int, default=8, help="random episodes per layout (default 8)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpucheck: no CUDA device visible (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda or 'none'}); this script checks the GPU path and needs one GPU. "
              f"Exit status {NO_CUDA_STATUS}.", file=sys.stderr)
        return NO_CUDA_STATUS
    print(f"gpucheck: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    checks = [
        ("attention", lambda: attention_check(args.backend, args.episodes, args.seed),
         ["backend", "tokens", "fwd_err", "fwd_budget", "bwd_err", "bwd_budget"]),
        ("packing", lambda: packing_check(args.backend, args.episodes, seed=args.seed),
         ["speedup_vs_per_call", "ideal", "efficiency"]),
        ("kl", lambda: kl_check(seed=args.seed),
         ["vocab", "tokens", "peak_mem_ratio", "time_ratio", "max_abs_err", "naive_peak_gib", "chunked_peak_gib"]),
    ]
    failed = 0
    for name, run, keys in checks:
        try:
            result = run()
        except Exception as e:  # one broken check must not hide the others' results
            print(f"gpucheck {name} error={type(e).__name__}: {e} FAIL", flush=True)
            failed += 1
        else:
            print(_line(name, result, keys), flush=True)
            failed += not result["passed"]
        finally:
            torch.cuda.empty_cache()
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
