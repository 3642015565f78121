"""Transport benchmark: wire bytes per supervised token, teacher -> actor.

For a Qwen2.5-7B-sized teacher (H = 3584, V = 152,064, bf16; random weights, seeded) the
teacher side encodes ``--tokens`` positions with each transport of
:mod:`verl_memopd.supervision`, and the bytes of the payload tensors it would ship are
counted (tensor storage; framing is per batch, not per token)::

    hidden   final post-norm hidden states, bf16                  exact
    topk     k ids (int32) + k log-probs (fp32) + tail (fp32)       k + 1 bins (exact only at k = V)
    logits   the full bf16 logits, for comparison                   exact, what is too big to ship

Each measured figure must equal the transport's own ``bytes_per_token`` accounting, else the
benchmark fails. Ends with::

    transport bytes_per_token hidden=<a> logits=<b> topk=<c> exact_ratio=<b/a>
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import torch

from verl_memopd.supervision import dense_logits_bytes_per_token, get_transport, payload_bytes_per_token

__all__ = ["main"]


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m verl_memopd.bench transport", description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=3584, help="teacher H (default: Qwen2.5-7B's 3584)")
    p.add_argument("--vocab", type=int, default=152064, help="teacher head rows V (default: Qwen2.5-7B's 152,064)")
    p.add_argument("--k", type=int, default=get_transport("topk").k, help="top-k of the topk transport")
    p.add_argument("--tokens", type=int, default=32, help="positions encoded (default 32)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(list(argv))


def _measure(args: argparse.Namespace) -> dict[str, float]:
    g = torch.Generator().manual_seed(args.seed)
    dtype = torch.bfloat16
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(dtype)
    head = torch.randn(args.vocab, args.hidden, generator=g).mul_(args.hidden**-0.5).to(dtype)
    temperature = torch.ones(args.tokens)
    measured = {}
    for name, options in (("hidden", {}), ("topk", {"k": args.k})):
        transport = get_transport(name, **options)
        payload = transport.encode(hidden, head, args.vocab, temperature)
        measured[name] = payload_bytes_per_token(payload)
        accounted = transport.bytes_per_token(args.hidden, args.vocab, dtype)
        if measured[name] != accounted:
            raise RuntimeError(f"transport {name!r}: encoded {measured[name]} B/token, accounting says {accounted}")
    logits = hidden @ head.T  # (tokens, V) bf16: the dense alternative
    measured["logits"] = payload_bytes_per_token({"logits": logits})
    if measured["logits"] != dense_logits_bytes_per_token(args.vocab, dtype):
        raise RuntimeError(
            f"dense logits: {measured['logits']} B/token, "
            f"accounting says {dense_logits_bytes_per_token(args.vocab, dtype)}"
        )
    return measured


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    measured = _measure(args)
    notes = {
        "hidden": "exact (actor holds the teacher head)",
        "topk": f"k={args.k} + tail bin",
        "logits": "exact, dense",
    }
    for name, value in measured.items():
        print(f"{name:7s} {value:9.0f} B/token ({value / 1024:7.2f} KiB)  {notes[name]}")
    a, b, c = (int(measured[k]) for k in ("hidden", "logits", "topk"))
    print(f"transport bytes_per_token hidden={a} logits={b} topk={c} exact_ratio={b / a:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
