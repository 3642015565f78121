"""Packing benchmark: actor forward+backward and teacher forward, packed vs ``per_call``.

Model: the tiny teacher architecture (``tiny.teacher_config``: 4 layers, hidden 256, 8 heads,
4 KV heads, SwiGLU 512), random weights. Episodes: by default a shared prefix ``q`` 2-4x the mean
call block, 4-6 calls (``SHAPE``); ``--calls T`` fixes the number of calls, ``--q-ratio R`` sets
``|q|`` to R x the mean block, ``--group-size N`` gives every N consecutive episodes the same ``q``
(GRPO / ``rollout.n`` groups), which the packed variant then computes once per group
(``verl_memopd.streams.share_prefix``, as the trainer's engines do with
``memopd.share_prefix_across_group``). One actor step = forward of the whole batch,
full-vocabulary log-probs at the action tokens, backward of their sum; one teacher step = the
forward alone (no gradients), final hidden states at the action tokens. Variants are timed
round-robin (warm-up rounds, then the median of timed rounds), single-threaded by default, in
process CPU time on CPU (wall time on an accelerator)::

    python -m verl_memopd.bench packing [--group-size 8 --q-ratio 2 --calls 2]
    ...
    packing speedup_vs_per_call=<x> ideal=<y> efficiency=<x/y>

``speedup_vs_per_call`` = against the faster per-call variant, the median over timed rounds of its
actor step time / ``packed``'s in the same round (``paired_ratio``: a round runs the variants back to
back, so a load swing on a shared machine cancels in the round's ratio); the per-variant lines print
median times and these ratios. ``ideal`` = the ratio of attention+MLP work implied by the segments,
per layer (the layer count and the backward's ~2x factor cancel; embeddings and the LM head,
identical for both, are left out)::

    work(layout) = sum over segments [ Lq * c_tok + pairs(Lq, Lk) * c_pair ]
    c_tok  = 2 * (H * (Hq*D + 2 * Hkv*D) + Hq*D * H + 3 * H * I)    projections + SwiGLU MLP, FLOPs/token
    c_pair = 4 * Hq * D                                              QK^T and PV, FLOPs/visible pair
    pairs  = Lq * (Lk - Lq) + Lq * (Lq + 1) / 2                      bottom-right causal segment
    ideal  = work(per_call, unpadded) / work(packed)

The shape line also gives the token-count ratio ``n T (q + b) / (q + n T b)`` (n episodes per
group, T calls, mean |q| and block b), the ideal when attention is free.

``--model-shape qwen2.5-3b --layers N`` replaces the tiny model by N layers of Qwen2.5-3B's shape and
its 151,936-token vocabulary (random weights, built on ``--device``; on CUDA the defaults become bf16
and the ``torch_varlen`` backend). The LM head and the full-vocabulary log-softmax at the A action
tokens cost the same in every variant, so they cap the measurable speed-up below ``ideal``; the
shape line prints ``ideal_with_head`` = ``(N work(per_call) + h) / (N work(packed) + h)`` with
``h = 2 A H V`` (the head's forward FLOPs), what the step can reach when every FLOP costs the same.
``--profile`` adds ``torch.profiler`` tables (top ops by device time, CPU time on CPU) of one actor
step of ``packed`` and of ``per_call_varlen``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence, Union

import torch

from verl_memopd.attention import BACKENDS, attention_implementation, backend_of, hf_name
from verl_memopd.fields import SEGMENTS
from verl_memopd.packing import BatchLayout, build_layout, pack_episode
from verl_memopd.rce import EpisodeShape, random_episodes
from verl_memopd.records import Episode
from verl_memopd.segments import SegmentMeta
from verl_memopd.streams import share_prefix

__all__ = [
    "SHAPE",
    "MODEL_SHAPES",
    "model_config",
    "Stream",
    "grouped_episodes",
    "group_stream",
    "layout_work",
    "round_seconds",
    "step_seconds",
    "paired_ratio",
    "sync",
    "clock",
    "actor_step_seconds",
    "main",
]

#: Benchmark episodes: q of 256-320 tokens; blocks = memory (a slice of the previous response)
#: + a 48-80 token chunk + a 16-48 token response, ~105 tokens on average: q / block ~ 2.7.
SHAPE = EpisodeShape(prefix_len=(256, 320), calls=(4, 6), chunk_len=(48, 80), response_len=(16, 48))


#: ``--model-shape`` name -> Qwen2 config fields (layers from ``--layers``).
MODEL_SHAPES: dict[str, dict] = {
    "qwen2.5-3b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=128,
        tie_word_embeddings=False,
    ),
}


def model_config(shape: str, layers: Optional[int]):
    """The benchmark model's config: ``tiny`` (``tiny.teacher_config``) or a ``MODEL_SHAPES`` entry, ``layers`` deep."""
    from transformers import Qwen2Config

    from verl_memopd.bench.tiny import teacher_config

    if shape == "tiny":
        config = teacher_config()
        if layers:
            config.num_hidden_layers = layers
        return config
    return Qwen2Config(num_hidden_layers=layers or 8, max_position_embeddings=32768, **MODEL_SHAPES[shape])


def build_model(config, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """Random-weight ``Qwen2ForCausalLM`` initialised on ``device`` (no CPU copy), cast to ``dtype``, train mode."""
    from transformers import Qwen2ForCausalLM

    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.to(device, dtype).train()


@dataclass(frozen=True)
class Stream:
    """One way to run a batch: (B, L) inputs, their segments over the ``B * L`` stream, and the A
    action tokens: ``predictors`` (A,) flat stream index of the position predicting each, ``action_ids`` (A,)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: SegmentMeta
    predictors: torch.Tensor
    action_ids: torch.Tensor
    needs_segment_attention: bool = True

    @classmethod
    def of(cls, layout: BatchLayout) -> "Stream":
        return cls(
            layout.input_ids,
            layout.position_ids,
            layout.segments,
            layout.action_index,
            layout.action_ids,
            layout.needs_segment_attention,
        )


def grouped_episodes(
    episodes: Sequence[Episode], group_size: int, q_len: Optional[int], seed: int, vocab_size: int
) -> list[Episode]:
    """Every ``group_size`` consecutive episodes get one prompt ``q`` (the group's first one's, or
    ``q_len`` random tokens when given); ``uid`` = the group."""
    rng, out = random.Random(seed), []
    for e, ep in enumerate(episodes):
        if e % group_size == 0:
            q = ep.prefix_ids if q_len is None else tuple(rng.randrange(vocab_size) for _ in range(q_len))
        calls = tuple(replace(inv, prompt_ids=q + inv.prompt_ids[ep.prefix_len :]) for inv in ep.invocations)
        out.append(replace(ep, uid=f"group-{e // group_size}", prefix_ids=q, invocations=calls))
    return out


def group_stream(episodes: Sequence[Episode], packed: BatchLayout) -> Stream:
    """The packed rows of ``episodes`` with each prompt group's q computed once (the engines' stream)."""
    rows = [pack_episode(ep) for ep in episodes]
    uids = {ep.uid: None for ep in episodes}
    groups = [list(uids).index(ep.uid) for ep in episodes]
    shared = share_prefix(
        [torch.tensor(r.prompt_ids + r.response_ids) for r in rows],
        [torch.tensor(r.position_ids) for r in rows],
        [torch.tensor(r.segment_ids) for r in rows],
        groups,
    )
    if shared is None:
        return Stream.of(packed)
    inputs, index = shared
    return Stream(
        inputs["input_ids"], inputs["position_ids"], inputs[SEGMENTS], index[packed.action_index], packed.action_ids
    )


def layout_work(layout: Union[BatchLayout, Stream], config) -> float:
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


def sync(device: torch.device) -> None:
    """Wait for the accelerator's queued kernels (a no-op on CPU), so a clock read after it covers them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> float:
    """CPU time of this process on CPU (a shared machine's load swings wall time by several x; the
    process's own CPU time hardly moves), wall time on an accelerator."""
    return time.process_time() if device.type == "cpu" else time.perf_counter()


def _hidden(model: torch.nn.Module, stream: Stream) -> torch.Tensor:
    """Final post-norm hidden states at the predicting positions: (A, H)."""
    device = model.get_input_embeddings().weight.device
    kwargs = {} if backend_of(model) is None else {SEGMENTS: stream.segments.to(device)}
    out = model.base_model(
        input_ids=stream.input_ids.to(device), position_ids=stream.position_ids.to(device), use_cache=False, **kwargs
    )
    hidden = out.last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, stream.predictors.to(device))


def actor_step_seconds(
    model: torch.nn.Module, layout: Union[BatchLayout, Stream], impl: str, backward: bool = True
) -> float:
    """Time (``clock``) of one forward + full-vocabulary action log-probs + backward under ``impl``, or
    (``backward=False``) of the teacher's forward to the action positions' hidden states, without gradients."""
    stream = layout if isinstance(layout, Stream) else Stream.of(layout)
    device = model.get_input_embeddings().weight.device
    with attention_implementation(model, impl):
        model.zero_grad(set_to_none=True)
        sync(device)
        start = clock(device)
        if backward:
            logits = model.get_output_embeddings()(_hidden(model, stream)).float()
            logprobs = torch.log_softmax(logits, -1).gather(1, stream.action_ids.to(device).unsqueeze(1))
            logprobs.sum().backward()
        else:
            with torch.no_grad():
                _hidden(model, stream)
        sync(device)
    return clock(device) - start


def round_seconds(
    model: torch.nn.Module,
    variants: dict[str, tuple[Union[BatchLayout, Stream], str]],
    warmup: int,
    repeats: int,
    backward: bool = True,
) -> dict[str, list[float]]:
    """Step times per variant ``name -> (layout, attention implementation)``: ``repeats`` values each, by round.

    Variants are timed round-robin (one step each per round, back to back), so load changes on a shared
    machine hit all of them alike; the first ``warmup`` rounds are not timed.
    """
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(warmup + repeats):
        for name, (layout, impl) in variants.items():
            seconds = actor_step_seconds(model, layout, impl, backward)
            if round_ >= warmup:
                times[name].append(seconds)
    return times


def step_seconds(
    model: torch.nn.Module,
    variants: dict[str, tuple[Union[BatchLayout, Stream], str]],
    warmup: int,
    repeats: int,
    backward: bool = True,
) -> dict[str, float]:
    """Median step time per variant (``round_seconds``)."""
    return {name: statistics.median(t) for name, t in round_seconds(model, variants, warmup, repeats, backward).items()}


def paired_ratio(times: dict[str, list[float]], baseline: str, target: str) -> float:
    """Median over rounds of ``baseline``'s step time / ``target``'s in the same round.

    A round runs every variant once, back to back: a load swing on a shared machine that slows a whole
    round cancels in its ratio, where it would shift one variant's median and not the other's."""
    return statistics.median(b / t for b, t in zip(times[baseline], times[target], strict=True))


def profile_table(model: torch.nn.Module, layout: Union[BatchLayout, Stream], impl: str, rows: int = 25) -> str:
    """``torch.profiler`` table of one actor step (``actor_step_seconds``): the top ``rows`` ops by self device time
    (self CPU time on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    device = model.get_input_embeddings().weight.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    actor_step_seconds(model, layout, impl)  # warm
    with profile(activities=activities) as prof:
        actor_step_seconds(model, layout, impl)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def _timed(build: Callable[[], BatchLayout]) -> tuple[BatchLayout, float]:
    start = time.perf_counter()
    layout = build()
    return layout, time.perf_counter() - start


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m verl_memopd.bench packing", description=__doc__.split("\n")[0])
    p.add_argument(
        "--episodes",
        type=int,
        default=None,
        help="episodes per step, a multiple of --group-size (default max(4, group size))",
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=1,
        help="episodes sharing one prompt q (GRPO / rollout.n group); 1 = per-episode packing (default)",
    )
    p.add_argument(
        "--q-ratio",
        type=float,
        default=None,
        help="|q| = R x the mean call block (default: SHAPE's q of 256-320 tokens, ~2.7x)",
    )
    p.add_argument("--calls", type=int, default=None, help="calls per episode (default: SHAPE's 4-6)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant (default 1)")
    p.add_argument(
        "--repeats",
        type=int,
        default=9,
        help="timed rounds, one step per variant each; medians reported (default 9: single steps "
        "on a loaded 2-core machine move by +-15%%)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of episodes and weights (default 0)")
    p.add_argument(
        "--backend",
        default=None,
        choices=sorted(BACKENDS),
        help="packed attention backend (default torch; torch_varlen on cuda)",
    )
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="model dtype (default float32; bfloat16 on cuda)"
    )
    p.add_argument(
        "--model-shape",
        default="tiny",
        choices=["tiny", *MODEL_SHAPES],
        help="tiny (default: the tiny teacher) or N layers of a real model's shape (--layers)",
    )
    p.add_argument("--layers", type=int, default=None, help="layers of --model-shape (default: tiny 4, others 8)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="print torch.profiler tables of one packed and one per_call_varlen actor step",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for torch (default 1: on a shared CPU, several threads per op make small "
        "ops wait on each other and distort the ratios)",
    )
    args = p.parse_args(argv)
    args.episodes = args.episodes or max(4, args.group_size)
    cuda = str(args.device).startswith("cuda")
    args.backend = args.backend or ("torch_varlen" if cuda else "torch")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be >= 1")
    if min(args.repeats, args.episodes, args.threads, args.group_size) < 1 or args.warmup < 0:
        p.error("--episodes, --repeats, --threads and --group-size must be >= 1, --warmup >= 0")
    if (
        args.episodes % args.group_size
        or (args.calls is not None and args.calls < 1)
        or (args.q_ratio is not None and args.q_ratio <= 0)
    ):
        p.error("--episodes must be a multiple of --group-size; --calls >= 1; --q-ratio > 0")
    return args


def _episodes(args: argparse.Namespace, vocab_size: int) -> list[Episode]:
    shape = SHAPE if args.calls is None else replace(SHAPE, calls=(args.calls, args.calls))
    episodes = random_episodes(args.episodes, vocab_size, args.seed, shape)
    q_len = None
    if args.q_ratio is not None:
        q_len = max(1, round(args.q_ratio * statistics.mean(_blocks(episodes))))
    return grouped_episodes(episodes, args.group_size, q_len, args.seed, vocab_size)


def _blocks(episodes: Sequence[Episode]) -> list[int]:
    return [len(inv.prompt_ids) - ep.prefix_len + len(inv.response_ids) for ep in episodes for inv in ep.invocations]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = model_config(args.model_shape, args.layers)
    model = build_model(config, args.device, getattr(torch, args.dtype))
    episodes = _episodes(args, config.vocab_size)
    layout, build_s = _timed(lambda: build_layout("packed", episodes, config.vocab_size))
    packed = group_stream(episodes, layout)
    padded = build_layout("per_call", episodes, config.vocab_size)
    varlen = build_layout("per_call_varlen", episodes, config.vocab_size)
    blocks = _blocks(episodes)
    q, b, n = statistics.mean(ep.prefix_len for ep in episodes), statistics.mean(blocks), args.group_size
    t = len(blocks) / len(episodes)
    print(
        f"packing: {args.episodes} episodes in groups of {n} sharing q, {t:.1f} calls each, mean len(q) {q:.0f} = "
        f"{q / b:.2f}x mean block {b:.0f}; token ideal n*T*(q+b)/(q+n*T*b) = {n * t * (q + b) / (q + n * t * b):.3f}; "
        f"tokens packed {packed.input_ids.numel()}, per_call varlen {varlen.input_ids.numel()}, padded "
        f"{padded.input_ids.numel()}; {packed.action_ids.numel()} action tokens; packed layout built in "
        f"{build_s * 1e3:.1f} ms"
    )

    variants = {
        "per_call_padded": (padded, "sdpa"),
        "per_call_varlen": (varlen, hf_name(args.backend)),
        "packed": (packed, hf_name(args.backend)),
    }
    actor = round_seconds(model, variants, args.warmup, args.repeats)
    teacher = round_seconds(model, variants, args.warmup, args.repeats, backward=False)
    for name in variants:
        print(
            f"packing: {name:16s} actor fwd+bwd {statistics.median(actor[name]) * 1e3:8.1f} ms "
            f"(packed {paired_ratio(actor, name, 'packed'):.3f}x)  teacher fwd "
            f"{statistics.median(teacher[name]) * 1e3:8.1f} ms (packed {paired_ratio(teacher, name, 'packed'):.3f}x)"
        )
    ideal = layout_work(varlen, config) / layout_work(packed, config)
    head = 2.0 * packed.action_ids.numel() * config.hidden_size * config.vocab_size
    layers = config.num_hidden_layers
    with_head = (layers * layout_work(varlen, config) + head) / (layers * layout_work(packed, config) + head)
    print(
        f"packing: model {args.model_shape} x {layers} layers, {args.dtype}, {args.device}, backend {args.backend}; "
        f"LM head {head / (layers * layout_work(packed, config) + head):.1%} of packed forward FLOPs; "
        f"ideal_with_head={with_head:.3f}"
    )
    if args.profile:
        for name in ("packed", "per_call_varlen"):
            print(f"packing: profile of one {name} actor step\n{profile_table(model, *variants[name])}")
    baselines = ("per_call_padded", "per_call_varlen")
    t_speedup = min(paired_ratio(teacher, name, "packed") for name in baselines)
    print(f"packing teacher_speedup_vs_per_call={t_speedup:.3f} ideal={ideal:.3f} efficiency={t_speedup / ideal:.3f}")
    speedup = min(paired_ratio(actor, name, "packed") for name in baselines)
    print(f"packing speedup_vs_per_call={speedup:.3f} ideal={ideal:.3f} efficiency={speedup / ideal:.3f}")
    return 0
