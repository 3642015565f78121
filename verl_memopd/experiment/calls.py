"""Per-call accuracy from the oracle's state: which call of an episode a model gets wrong.

The agent-loop evals (``evaluate.py``) score whole episodes, where a memory call's mistake carries into
every later call. Here each call is scored alone: for every row of the oracle's val traces
(``sft_data/val.parquet``: q, the call's message built from the **oracle's** memory, the oracle's reply)
the model writes its reply greedily from exactly that state (Hugging Face ``generate`` on the model's
chat template, fp32, CPU). Two scores per call index (0..N-1 memory calls, N the answer call):
``exact`` (the reply equals the oracle's) and ``lines`` (how many of the oracle's reply lines, i.e. the
facts its memory keeps or the ``k: answer`` lines, appear as lines of the reply; ``lines_n`` of them in
all). They say how good a model is at each call given a correct past, e.g. the teacher's quality on later
calls, which bounds what its supervision can teach there.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Sequence

__all__ = ["CallScore", "score_calls", "call_accuracy", "greedy_replier"]

CallScore = dict  # {"call": int, "exact": int, "n": int, "lines": int, "lines_n": int}

#: (chat messages up to the reply) -> the model's reply text
Replier = Callable[[Sequence[dict]], str]


def score_calls(rows: Iterable[tuple[int, Sequence[dict]]], reply: Replier) -> list[CallScore]:
    """Exact replies and oracle lines kept, per call index, over ``rows`` of ``(call, messages)``;
    ``messages[-1]`` is the oracle's reply (role assistant), ``reply`` is asked for the messages before it.
    Sorted by call."""
    counts: dict[int, Counter] = {}
    for call, messages in rows:
        if not messages or messages[-1]["role"] != "assistant":
            raise ValueError(
                f"call {call}: the last message must be the oracle's reply (role 'assistant'), "
                f"got {messages[-1]['role'] if messages else 'no messages'}"
            )
        got, want = reply(list(messages[:-1])).strip(), messages[-1]["content"].strip()
        got_lines, want_lines = _lines(got), _lines(want)
        c = counts.setdefault(call, Counter())
        c.update(n=1, exact=int(got == want), lines=len(want_lines & got_lines), lines_n=len(want_lines))
    return [
        {"call": call, **{k: c[k] for k in ("exact", "n", "lines", "lines_n")}} for call, c in sorted(counts.items())
    ]


def _lines(text: str) -> set[str]:
    return {line.strip() for line in text.splitlines() if line.strip()}


def greedy_replier(model_dir: Path, max_new_tokens: int) -> Replier:
    """Greedy replies of the Hugging Face model in ``model_dir`` (fp32, CPU, sdpa attention: an RL actor's export
    names the plugin's packed attention, which a single unpacked sequence does not need), stopping at its EOS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()

    def reply(messages: Sequence[dict]) -> str:
        ids = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    return reply


def call_accuracy(model_dir: Path, traces: Path, out_json: Path, max_new_tokens: int) -> list[CallScore]:
    """Per-call scores (:func:`score_calls`) of ``model_dir`` on the oracle's ``traces``, written to ``out_json``
    (or read back from it when it exists)."""
    if out_json.is_file():
        return json.loads(out_json.read_text())["calls"]
    import pandas as pd

    frame = pd.read_parquet(traces, columns=["call", "messages"])
    rows = ((int(call), list(messages)) for call, messages in zip(frame["call"], frame["messages"]))
    scores = score_calls(rows, greedy_replier(model_dir, max_new_tokens))
    out_json.write_text(json.dumps({"model": str(model_dir), "traces": str(traces), "calls": scores}, indent=1) + "\n")
    return scores
