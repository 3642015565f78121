"""Rollout Context Equivalence (RCE) audit: packed logits == independent per-call logits.

For every action token ``a_{t,k}`` the full-vocabulary logits of the ``packed`` forward must equal
those of running call ``t`` alone (``||l_pack - l_ind||_inf <= eps``). The reference is genuinely
independent: the ``per_call`` layout -- one row ``[q ; x_t ; a_t]`` per call, positions 0..L-1 --
run under the model's stock ``sdpa`` attention. The ``flat`` layout (persistent history) is
measured the same way to show that its misalignment is real::

    python -m verl_memopd.rce --episodes 200 --seed 0
    ...
    RCE episodes=200 max_abs_diff=<x> flat_max_abs_diff=<y>

Exit status 0 only when ``max_abs_diff`` is within the dtype's tolerance (``TOLERANCES``).
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from verl_memopd.attention import BACKENDS, attention_implementation, forward_layout, hf_name
from verl_memopd.packing import build_layout
from verl_memopd.records import Episode, Invocation

__all__ = ["Tolerance", "TOLERANCES", "EpisodeShape", "random_episodes", "RceReport", "rce_audit", "main"]


@dataclass(frozen=True)
class Tolerance:
    """Allowed ``max |l_pack - l_ind|``: ``atol + rtol * max |l_ind|`` over the audited logits."""

    atol: float
    rtol: float

    def __post_init__(self) -> None:
        if self.atol < 0 or self.rtol < 0 or self.atol + self.rtol == 0:
            raise ValueError(f"Tolerance needs atol, rtol >= 0, not both 0; got {self}")

    def bound(self, ref_max_abs: float) -> float:
        return self.atol + self.rtol * ref_max_abs


#: Per-dtype tolerance. fp32: 1e-4 absolute (packed vs per-call differ only in summation order,
#: ~1e-6 observed). fp16/bf16: 8 machine epsilons (2^-10 / 2^-7) relative to the largest reference
#: logit -- a few units in the last place of the logits, whose rounding alone differs by one ulp.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-4, rtol=0.0),
    torch.float16: Tolerance(atol=0.0, rtol=8 * 2.0 ** -10),
    torch.bfloat16: Tolerance(atol=0.0, rtol=8 * 2.0 ** -7),
}


@dataclass(frozen=True)
class EpisodeShape:
    """Inclusive ``(low, high)`` ranges for random episodes (defaults: the RCE audit's shapes)."""

    prefix_len: tuple[int, int] = (8, 64)
    calls: tuple[int, int] = (1, 8)
    chunk_len: tuple[int, int] = (1, 32)
    response_len: tuple[int, int] = (1, 24)

    def __post_init__(self) -> None:
        for name in ("prefix_len", "calls", "chunk_len", "response_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"EpisodeShape.{name} = {(lo, hi)} must satisfy 1 <= low <= high")


def random_episodes(n: int, vocab_size: int, seed: int, shape: EpisodeShape = EpisodeShape()) -> list[Episode]:
    """``n`` random memory-agent episodes: call ``t + 1`` sees ``[q ; m_t ; o_t]`` where ``m_t`` is a
    random slice of call ``t``'s response (memory re-appearing as context) and ``o_t`` a new chunk.
    About a quarter of calls end with a forced (non-sampled) token; teacher mask = action mask."""
    rng = random.Random(seed)

    def ids(lo_hi: tuple[int, int]) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(rng.randint(*lo_hi))]

    episodes = []
    for e in range(n):
        q, memory, calls = ids(shape.prefix_len), [], []
        for _ in range(rng.randint(*shape.calls)):
            response = ids(shape.response_len)
            start = rng.randint(0, len(response))
            end = rng.randint(start, len(response))
            action = [True] * len(response)
            if len(response) > 1 and rng.random() < 0.25:
                action[-1] = False
            calls.append(Invocation(
                prompt_ids=tuple(q + memory + ids(shape.chunk_len)), response_ids=tuple(response),
                response_logprobs=tuple(-rng.random() * 5 for _ in response), action_mask=tuple(action),
                memory_span=(start, end), finish_reason=rng.choice(("stop", "stop", "stop", "length"))))
            memory = response[start:end]
        episodes.append(Episode(f"rce-{seed}-{e}", f"uid-{e}", tuple(q), tuple(calls)))
    return episodes


@dataclass(frozen=True)
class RceReport:
    """Result of an audit: sup-norm logit differences over all ``action_tokens`` of ``episodes``."""

    episodes: int
    action_tokens: int
    max_abs_diff: float
    flat_max_abs_diff: float
    tolerance: float
    dtype: str
    backend: str

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance

    def line(self) -> str:
        return (f"RCE episodes={self.episodes} max_abs_diff={self.max_abs_diff:.3e} "
                f"flat_max_abs_diff={self.flat_max_abs_diff:.3e}")


@torch.no_grad()
def rce_audit(model: torch.nn.Module, episodes: Sequence[Episode], backend: str = "torch",
              batch_episodes: int = 25, reference_attention: str = "sdpa") -> RceReport:
    """Compare ``packed`` (memopd ``backend``) and ``flat`` with independent per-call logits.

    Episodes are laid out ``batch_episodes`` at a time; the reference ``per_call`` and ``flat`` run
    under ``reference_attention`` (a stock transformers implementation). The model is left with
    the attention implementation it had.
    """
    if batch_episodes < 1:
        raise ValueError(f"batch_episodes must be >= 1, got {batch_episodes}")
    vocab = model.config.vocab_size
    diff = flat_diff = ref_max = 0.0
    tokens = 0
    for i in range(0, len(episodes), batch_episodes):
        batch = episodes[i:i + batch_episodes]
        with attention_implementation(model, reference_attention):
            ref = forward_layout(model, build_layout("per_call", batch, vocab)).float()
            flat = forward_layout(model, build_layout("flat", batch, vocab)).float()
        with attention_implementation(model, hf_name(backend)):
            packed = forward_layout(model, build_layout("packed", batch, vocab)).float()
        diff = max(diff, (packed - ref).abs().max().item())
        flat_diff = max(flat_diff, (flat - ref).abs().max().item())
        ref_max = max(ref_max, ref.abs().max().item())
        tokens += ref.shape[0]
    dtype = model.get_input_embeddings().weight.dtype
    if dtype not in TOLERANCES:
        raise KeyError(f"no RCE tolerance for dtype {dtype}; known: {', '.join(map(str, TOLERANCES))}")
    return RceReport(len(episodes), tokens, diff, flat_diff, TOLERANCES[dtype].bound(ref_max),
                     str(dtype).replace("torch.", ""), backend)


def _load_model(path: Optional[str], seed: int, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

    if path is not None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        from verl_memopd.tiny import student_config

        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(student_config()).to(dtype)
    return model.to(device).eval()


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_memopd.rce", description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=200, help="random episodes to audit (default 200)")
    p.add_argument("--seed", type=int, default=0, help="seed of episodes and random model weights (default 0)")
    p.add_argument("--model", default=None, help="HF model folder (default: random tiny student, verl_memopd.tiny)")
    p.add_argument("--backend", default="torch", choices=sorted(BACKENDS),
                   help="packed attention backend (default torch)")
    p.add_argument("--dtype", default="float32", choices=[str(d).replace("torch.", "") for d in TOLERANCES])
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--batch-episodes", type=int, default=25, help="episodes per forward (default 25)")
    args = p.parse_args(argv)
    model = _load_model(args.model, args.seed, getattr(torch, args.dtype), args.device)
    episodes = random_episodes(args.episodes, model.config.vocab_size, args.seed)
    report = rce_audit(model, episodes, args.backend, args.batch_episodes)
    print(f"rce: {report.action_tokens} action tokens, {report.dtype}, backend {report.backend}, "
          f"tolerance {report.tolerance:.3e}: {'PASS' if report.passed else 'FAIL'}")
    print(report.line())
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
