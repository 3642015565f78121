"""Packing benchmark: actor forward+backward on ``packed`` vs ``per_call`` (padded and varlen).

Model: the tiny teacher architecture (``tiny.teacher_config``: 4 layers, hidden 256, 8 heads,
4 KV heads, SwiGLU 512), random weights. Episodes: a shared prefix ``q`` 2-4x the mean call block
(``SHAPE``). One step = forward of the whole batch, full-vocabulary log-probs at the action
tokens, backward of their sum. Variants are timed round-robin (warm-up rounds, then the median
of timed rounds), single-threaded by default::

    python -m verl_memopd.bench packing
    ...
    packing speedup_vs_per_call=<x> ideal=<y> efficiency=<x/y>

``speedup_vs_per_call`` = median step time of the faster per-call variant / that of ``packed``.
``ideal`` = the ratio of attention+MLP work implied by the token counts, per layer (the layer
count and the backward's ~2x factor cancel; embeddings and the LM head, identical for both, are
left out)::

    work(layout) = sum over segments [ Lq * c_tok + pairs(Lq, Lk) * c_pair ]
    c_tok  = 2 * (H * (Hq*D + 2 * Hkv*D) + Hq*D * H + 3 * H * I)    projections + SwiGLU MLP, FLOPs/token
    c_pair = 4 * Hq * D                                              QK^T and PV, FLOPs/visible pair
    pairs  = Lq * (Lk - Lq) + Lq * (Lq + 1) / 2                      bottom-right causal segment
    ideal  = work(per_call, unpadded) / work(packed)
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Optional, Sequence

import torch

from verl_memopd.attention import BACKENDS, attention_implementation, forward_layout, hf_name
from verl_memopd.packing import BatchLayout, build_layout
from verl_memopd.rce import EpisodeShape, random_episodes

__all__ = ["SHAPE", "layout_work", "step_seconds", "main"]

#: Benchmark episodes: q of 256-320 tokens; blocks = memory (a slice of the previous response)
#: + a 48-80 token chunk + a 16-48 token response, ~105 tokens on average: q / block ~ 2.7.
SHAPE = EpisodeShape(prefix_len=(256, 320), calls=(4, 6), chunk_len=(48, 80), response_len=(16, 48))


def layout_work(layout: BatchLayout, config) -> float:
    """Attention+MLP FLOPs of one layer's forward over the layout's segments (formula above)."""
    h, i = config.hidden_size, config.intermediate_size
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // hq
    c_tok = 2 * (h * (hq * d + 2 * hkv * d) + hq * d * h + 3 * h * i)
    c_pair = 4 * hq * d
    work = 0.0
    for qa, qb, ka, kb in layout.segments.bounds:
        lq, lk = qb - qa, kb - ka
        work += lq * c_tok + (lq * (lk - lq) + lq * (lq + 1) / 2) * c_pair
    return work


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model: torch.nn.Module, layout: BatchLayout, impl: str) -> float:
    """Wall time of one forward + full-vocabulary action log-probs + backward under ``impl``."""
    device = model.get_input_embeddings().weight.device
    with attention_implementation(model, impl):
        model.zero_grad(set_to_none=True)
        _sync(device)
        start = time.perf_counter()
        logits = forward_layout(model, layout).float()
        logprobs = torch.log_softmax(logits, -1).gather(1, layout.action_ids.to(device).unsqueeze(1))
        logprobs.sum().backward()
        _sync(device)
    return time.perf_counter() - start


def step_seconds(model: torch.nn.Module, variants: dict[str, tuple[BatchLayout, str]], warmup: int,
                 repeats: int) -> dict[str, float]:
    """Median step time per variant ``name -> (layout, attention implementation)``.

    Variants are timed round-robin (one step each per round), so load changes on a shared machine
    hit all of them alike; the first ``warmup`` rounds are not timed.
    """
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(warmup + repeats):
        for name, (layout, impl) in variants.items():
            seconds = _step(model, layout, impl)
            if round_ >= warmup:
                times[name].append(seconds)
    return {name: statistics.median(t) for name, t in times.items()}


def _timed(build: Callable[[], BatchLayout]) -> tuple[BatchLayout, float]:
    start = time.perf_counter()
    layout = build()
    return layout, time.perf_counter() - start


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_memopd.bench packing", description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=4, help="episodes per step (default 4)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant (default 1)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per variant; median reported (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of episodes and weights (default 0)")
    p.add_argument("--backend", default="torch", choices=sorted(BACKENDS), help="packed attention backend")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1: on a shared CPU, several threads per op make small "
                        "ops wait on each other and distort the ratios)")
    args = p.parse_args(argv)
    if min(args.repeats, args.episodes, args.threads) < 1 or args.warmup < 0:
        p.error("--episodes, --repeats and --threads must be >= 1, --warmup >= 0")

    from transformers import Qwen2ForCausalLM

    from verl_memopd.tiny import teacher_config

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = teacher_config()
    model = Qwen2ForCausalLM(config).to(args.device, getattr(torch, args.dtype)).train()
    episodes = random_episodes(args.episodes, config.vocab_size, args.seed, SHAPE)
    packed, build_s = _timed(lambda: build_layout("packed", episodes, config.vocab_size))
    padded = build_layout("per_call", episodes, config.vocab_size)
    varlen = build_layout("per_call_varlen", episodes, config.vocab_size)
    blocks = [len(inv.prompt_ids) - ep.prefix_len + len(inv.response_ids) for ep in episodes for inv in ep.invocations]
    prefix = statistics.mean(ep.prefix_len for ep in episodes)
    print(f"packing: {args.episodes} episodes, {len(blocks)} calls, mean len(q) {prefix:.0f} = "
          f"{prefix / statistics.mean(blocks):.2f}x mean block; tokens packed {packed.input_ids.numel()}, "
          f"per_call varlen {varlen.input_ids.numel()}, padded {padded.input_ids.numel()}; "
          f"{packed.action_index.numel()} action tokens; packed layout built in {build_s * 1e3:.1f} ms")

    seconds = step_seconds(model, {
        "per_call_padded": (padded, "sdpa"),
        "per_call_varlen": (varlen, hf_name(args.backend)),
        "packed": (packed, hf_name(args.backend)),
    }, args.warmup, args.repeats)
    for name, s in seconds.items():
        print(f"packing: {name:16s} median step {s * 1e3:8.1f} ms  speed-up of packed {s / seconds['packed']:.3f}x")
    speedup = min(seconds["per_call_padded"], seconds["per_call_varlen"]) / seconds["packed"]
    ideal = layout_work(varlen, config) / layout_work(packed, config)
    print(f"packing speedup_vs_per_call={speedup:.3f} ideal={ideal:.3f} efficiency={speedup / ideal:.3f}")
    return 0
