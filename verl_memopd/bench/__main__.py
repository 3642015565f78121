"""``python -m verl_memopd.bench {packing,kl,transport,attention,audit,step,threads} [args]``: run one benchmark.

Each benchmark is a module ``verl_memopd.bench.<name>`` with ``main(argv) -> int`` (the exit
status); it is imported only when run. Every benchmark prints ratios measured in one run and ends
with the one line its issue specifies.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

#: benchmark name -> what it measures.
BENCHMARKS: dict[str, str] = {
    "packing": "actor forward+backward: packed vs per-call layouts (speed-up against the token-count ideal)",
    "kl": "full-vocabulary divergence: chunked vs naive (time, memory, agreement)",
    "transport": "teacher supervision transports: hidden states vs top-k + tail vs full logits",
    "attention": "packed attention alone on CUDA: torch_varlen's K/V head repeat vs native GQA vs flash-attn",
    "audit": "in-training RCE check (bf16: with its fp32 reference) vs the audit step's own passes",
    "step": "the recipe's training step in verl, fp32 then bf16 (same data and seeds): stage timings, audits",
    "threads": "the recipe's fp32 step in verl, Ray workers on one torch thread then on N: stage timings",
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHMARKS:
        got = repr(argv[0]) if argv else "no benchmark"
        listing = "\n".join(f"  {name:10s} {what}" for name, what in BENCHMARKS.items())
        print(f"usage: python -m verl_memopd.bench NAME [args]  ({got} given); benchmarks:\n{listing}", file=sys.stderr)
        return 2
    return importlib.import_module(f"verl_memopd.bench.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
