"""Audit benchmark: what the in-training RCE check adds to an audit step, against the step's own passes.

On one micro-batch of packed episodes (one remove-padding stream), timed round-robin (warm-up rounds, then
the median of timed rounds; process CPU time on CPU, wall time on an accelerator):

    forward     the packed forward with logits, no gradients (the old-log-prob forward the check rides on)
    train       the packed forward + full-vocabulary action log-probs + backward (one actor update pass)
    check_old   the check as it was before the noise-floor rule: each call alone, in the model's dtype
    check       the check as it runs now: in fp16 / bf16 also the fp32 reference alone pass (TF32 products on
                CUDA); in fp32 the same as ``check_old``

and prints::

    python -m verl_memopd.bench audit [--device cuda --model-shape qwen2.5-3b --layers 8 --shape memory-agent]
    ...
    audit check_over_old_check=<c / c_old> audit_step_over_old_audit_step<=<(f + t + c) / (f + t + c_old)> \
        audit_step_over_step<=<(f + t + c) / (f + t)>

    (one line; wrapped here)

The two step ratios count only the actor's own passes (f = forward, t = train, one update pass); every other
stage of a real step (rollout, teacher, critic, more update passes) adds to both sides, so the real ratios
are smaller: these are upper bounds. The model is unsharded; under FSDP the reference also gathers each
unit's fp32 shards (``verl_memopd.fp32_reference``), which this does not time.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable, Optional, Sequence

import torch

from verl_memopd.attention import hf_name
from verl_memopd.audit import rce_spot_check
from verl_memopd.bench.packing import (
    MODEL_SHAPES,
    SHAPE,
    Stream,
    actor_step_seconds,
    build_model,
    clock,
    model_config,
    sync,
)
from verl_memopd.packing import build_layout
from verl_memopd.rce import EpisodeShape, SpotBatch, packed_spot_batch, random_episodes

__all__ = ["EPISODE_SHAPES", "main"]

#: ``--shape``: the packing bench's episodes, or memory-agent calls as measured on a GPU (q 200-400 tokens,
#: 3-5 calls, chunks 500-1000, answers / memories 100-300: 5-30k tokens an episode)
EPISODE_SHAPES: dict[str, EpisodeShape] = {
    "bench": SHAPE,
    "memory-agent": EpisodeShape(prefix_len=(200, 400), calls=(3, 5), chunk_len=(500, 1000), response_len=(100, 300)),
}
VARIANTS = ("forward", "train", "check_old", "check")


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m verl_memopd.bench audit", description=__doc__.split("\n")[0])
    p.add_argument("--model-shape", default="tiny", choices=["tiny", *MODEL_SHAPES])
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's, 8 for qwen)")
    p.add_argument("--shape", default="bench", choices=list(EPISODE_SHAPES))
    p.add_argument("--episodes", type=int, default=4, help="episodes in the micro-batch")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="default: bfloat16 on CUDA, float32 on CPU",
    )
    p.add_argument("--backend", default=None, help="packed attention backend (default: torch_varlen on CUDA, torch)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU only)")
    return p.parse_args(argv)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    start = clock(device)
    fn()
    sync(device)
    return clock(device) - start


def _check(model: torch.nn.Module, batch: SpotBatch, reference: bool) -> None:
    rce_spot_check(
        model,
        model,
        batch.logits,
        batch.row_start,
        batch.input_ids,
        batch.response_masks,
        batch.records,
        reference=reference,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    backend = args.backend or ("torch_varlen" if device.type == "cuda" else "torch")
    config = model_config(args.model_shape, args.layers)
    model = build_model(config, args.device, dtype)
    episodes = random_episodes(args.episodes, config.vocab_size, args.seed, EPISODE_SHAPES[args.shape])
    layout = build_layout("packed", episodes, config.vocab_size)
    alone = sum(len(inv.prompt_ids) + len(inv.response_ids) for ep in episodes for inv in ep.invocations)
    print(
        f"audit shape model={args.model_shape} layers={config.num_hidden_layers} dtype={str(dtype)[6:]} "
        f"device={device.type} backend={backend} episodes={len(episodes)} "
        f"calls={sum(len(ep.invocations) for ep in episodes)} packed_tokens={layout.input_ids.numel()} "
        f"alone_tokens={alone} action_tokens={layout.action_ids.numel()}",
        flush=True,
    )
    model.eval()
    batch = packed_spot_batch(model, episodes, backend)
    steps = {
        "forward": lambda: packed_spot_batch(model, episodes, backend),
        "train": lambda: actor_step_seconds(model, Stream.of(layout), hf_name(backend), backward=True),
        "check_old": lambda: _check(model, batch, reference=False),
        "check": lambda: _check(model, batch, reference=True),
    }
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for round_ in range(args.warmup + args.repeats):
        for name in VARIANTS:
            seconds = steps[name]() if name == "train" else _timed(steps[name], device)
            if round_ >= args.warmup:
                times[name].append(seconds)
    med = {name: statistics.median(t) for name, t in times.items()}
    print("audit seconds " + " ".join(f"{name}={med[name]:.4g}" for name in VARIANTS))
    f, t, c, c_old = med["forward"], med["train"], med["check"], med["check_old"]
    print(f"audit check_over_forward={c / f:.3g} check_old_over_forward={c_old / f:.3g}")
    print(
        f"audit check_over_old_check={c / c_old:.3g} "
        f"audit_step_over_old_audit_step<={(f + t + c) / (f + t + c_old):.3g} "
        f"audit_step_over_step<={(f + t + c) / (f + t):.3g}"
    )
    return 0
