"""``python -m verl_memopd.rce``: the offline RCE audit and its fault self-test (the rule: the package docstring).

A command line, so it may use the lab's tiny models (``verl_memopd.bench.tiny``); the audit itself does not.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import torch

from verl_memopd.attention import BACKENDS
from verl_memopd.rce import SELF_TEST_QK_SCALE, TOLERANCES, random_episodes, rce_audit, self_test, sharpen_attention


def _load_model(
    path: Optional[str], seed: int, dtype: torch.dtype, device: str, qk_scale: float = 1.0
) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if path is not None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        from verl_memopd.bench.tiny import student_model

        model = sharpen_attention(student_model(seed=seed), qk_scale).to(dtype)
    return model.to(device).eval()


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m verl_memopd.rce", description="the offline RCE audit of the packed layout"
    )
    p.add_argument("--episodes", type=int, default=None, help="random episodes to audit (default 200; self-test 12)")
    p.add_argument("--seed", type=int, default=0, help="seed of episodes and random model weights (default 0)")
    p.add_argument(
        "--model", default=None, help="HF model folder (default: random tiny student, verl_memopd.bench.tiny)"
    )
    p.add_argument(
        "--backend", default="torch", choices=sorted(BACKENDS), help="packed attention backend (default torch)"
    )
    p.add_argument("--dtype", default="float32", choices=[str(d).replace("torch.", "") for d in TOLERANCES])
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--batch-episodes", type=int, default=25, help="episodes per forward (default 25)")
    p.add_argument(
        "--self-test",
        action="store_true",
        help="inject packer and attention-backend faults and check both audits catch each",
    )
    args = p.parse_args(argv)
    model = _load_model(
        args.model, args.seed, getattr(torch, args.dtype), args.device, SELF_TEST_QK_SCALE if args.self_test else 1.0
    )
    if args.self_test:
        if args.model is None:
            print(
                f"self-test model: the random tiny student, q/k projections x{SELF_TEST_QK_SCALE:g} "
                f"(SELF_TEST_QK_SCALE), {args.dtype}"
            )
        result = self_test(
            model, random_episodes(args.episodes or 12, model.config.vocab_size, args.seed), args.backend
        )
        print("\n".join(result.lines()))
        return 0 if result.ok else 1
    episodes = random_episodes(args.episodes or 200, model.config.vocab_size, args.seed)
    report = rce_audit(model, episodes, args.backend, args.batch_episodes)
    print(
        f"rce: {report.action_tokens} action tokens, {report.dtype}, backend {report.backend}, rule "
        f"{report.rule}: {'PASS' if report.passed else 'FAIL'}"
    )
    print(f"rce: {report.calls.text()}")
    print(report.line())
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
