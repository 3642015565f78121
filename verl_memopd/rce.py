"""Rollout Context Equivalence (RCE) audit: packed logits == independent per-call logits.

For every action token ``a_{t,k}`` the full-vocabulary logits of the ``packed`` forward must equal
those of running call ``t`` alone (``||l_pack - l_ind||_inf <= eps``). The reference is built from
the invocation records alone (:func:`reference_logits`): each call's ``prompt_ids + response_ids``,
positions 0..n-1, under the model's stock ``sdpa`` attention -- nothing the packer produced, so a
packer bug cannot reproduce itself on both sides. The ``flat`` layout (persistent history) is
measured the same way to show that its misalignment is real::

    python -m verl_memopd.rce --episodes 200 --seed 0
    ...
    RCE episodes=200 max_abs_diff=<x> flat_max_abs_diff=<y>

Exit status 0 only when ``max_abs_diff`` is within the dtype's tolerance (``TOLERANCES``).

``--self-test`` shows that both RCE audits can fail: it injects (a) a packer fault (a copy of the
packed layout with one call block reversed) and (b) an attention-backend fault (a copy of the
``torch`` backend with a wrong softmax scale, registered only for the test) and checks that this
offline audit catches both and the in-training spot-check (``verl_memopd.trainer.audit``) catches
(b), and that both pass on the clean path::

    python -m verl_memopd.rce --self-test
    ...
    RCE self-test packer_fault_detected=1 backend_fault_detected=1 clean_pass=1

(The spot-check builds its alone pass from the packed rows, so a fault already in the rows is the
offline audit's to find.)
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from verl_memopd.attention import BACKENDS, attention_implementation, forward_layout, hf_name, scoped_backend
from verl_memopd.packing import BatchLayout, build_layout, pack_episode
from verl_memopd.records import Episode, Invocation

__all__ = ["Tolerance", "TOLERANCES", "EpisodeShape", "random_episodes", "RceReport", "reference_logits",
           "rce_audit", "reversed_block_packer", "spot_check_packed_rows", "SelfTest", "self_test", "main"]

#: ``build_layout``'s signature: the packer under audit (``rce_audit(pack=...)``).
Packer = Callable[[str, Sequence[Episode], Optional[int]], BatchLayout]


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
def reference_logits(model: torch.nn.Module, episodes: Sequence[Episode], attention: str = "sdpa",
                     batch_calls: int = 64) -> torch.Tensor:
    """Independent per-call logits at every action token, from the invocation records alone.

    Each call is its own sequence ``prompt_ids + response_ids`` with positions 0..n-1, run right-padded
    ``batch_calls`` at a time under the stock ``attention`` (plain causal: padding follows every real
    token); response token k is predicted at position ``len(prompt_ids) + k - 1``. Returns (A, V) in
    ``(episode, call, k)`` order -- the order of every layout's ``action_origin``.
    """
    seqs = [(list(inv.prompt_ids) + list(inv.response_ids),
             [len(inv.prompt_ids) + k - 1 for k, m in enumerate(inv.action_mask) if m])
            for ep in episodes for inv in ep.invocations]
    device = model.get_input_embeddings().weight.device
    out = []
    with attention_implementation(model, attention):
        for i in range(0, len(seqs), batch_calls):
            batch = seqs[i:i + batch_calls]
            width = max(len(ids) for ids, _ in batch)
            ids = torch.tensor([x + [x[0]] * (width - len(x)) for x, _ in batch], device=device)  # (S, L)
            hidden = model.base_model(input_ids=ids, position_ids=torch.arange(width, device=device).expand_as(ids),
                                      use_cache=False).last_hidden_state  # (S, L, H)
            index = torch.tensor([s * width + j for s, (_, js) in enumerate(batch) for j in js], device=device)
            out.append(model.get_output_embeddings()(hidden.reshape(-1, hidden.shape[-1])[index]))
    return torch.cat(out)


@torch.no_grad()
def rce_audit(model: torch.nn.Module, episodes: Sequence[Episode], backend: str = "torch",
              batch_episodes: int = 25, reference_attention: str = "sdpa", pack: Packer = build_layout) -> RceReport:
    """Compare ``packed`` (memopd ``backend``) and ``flat`` with the independent per-call reference.

    Episodes go ``batch_episodes`` at a time; ``pack`` builds the packed and flat layouts (the packer
    under audit), :func:`reference_logits` the reference under ``reference_attention`` (a stock
    transformers implementation). A packed layout that does not list the reference's action tokens
    counts as an infinite difference. The model is left with the attention implementation it had.
    """
    if batch_episodes < 1:
        raise ValueError(f"batch_episodes must be >= 1, got {batch_episodes}")
    vocab = model.config.vocab_size
    diff = flat_diff = ref_max = 0.0
    tokens = 0
    for i in range(0, len(episodes), batch_episodes):
        batch = episodes[i:i + batch_episodes]
        ref = reference_logits(model, batch, reference_attention).float()
        with attention_implementation(model, reference_attention):
            flat = forward_layout(model, pack("flat", batch, vocab)).float()
        with attention_implementation(model, hf_name(backend)):
            packed = forward_layout(model, pack("packed", batch, vocab)).float()
        diff = max(diff, _sup_diff(packed, ref))
        flat_diff = max(flat_diff, _sup_diff(flat, ref))
        ref_max = max(ref_max, ref.abs().max().item())
        tokens += ref.shape[0]
    dtype = model.get_input_embeddings().weight.dtype
    if dtype not in TOLERANCES:
        raise KeyError(f"no RCE tolerance for dtype {dtype}; known: {', '.join(map(str, TOLERANCES))}")
    return RceReport(len(episodes), tokens, diff, flat_diff, TOLERANCES[dtype].bound(ref_max),
                     str(dtype).replace("torch.", ""), backend)


def _sup_diff(logits: torch.Tensor, ref: torch.Tensor) -> float:
    """max |logits - ref| over (A, V); inf when the two do not cover the same action tokens."""
    if logits.shape != ref.shape:
        return float("inf")
    return (logits - ref).abs().max().item() if ref.numel() else 0.0


# --- self-test: each audit must be able to fail ----------------------------------------------------
def reversed_block_packer(name: str, episodes: Sequence[Episode], vocab_size: Optional[int] = None) -> BatchLayout:
    """A faulty copy of the packer: ``build_layout``, but in the ``packed`` layout the first call block
    (of any episode) with two different tokens has its tokens reversed -- positions, segments and the
    action bookkeeping untouched, as a packer bug that scrambles a block would leave them."""
    layout = build_layout(name, episodes, vocab_size)
    if name != "packed":
        return layout
    start = 0
    for ep in episodes:
        row = pack_episode(ep)
        seg = torch.tensor(row.segment_ids)
        for t in range(1, int(seg.max()) + 1):
            block = torch.nonzero(seg == t, as_tuple=True)[0] + start
            ids = layout.input_ids[0, block]
            if not torch.equal(ids, ids.flip(0)):
                faulty = layout.input_ids.clone()
                faulty[0, block] = ids.flip(0)
                return dataclasses.replace(layout, input_ids=faulty)
        start += seg.numel()
    raise ValueError("reversed_block_packer: no call block with two different tokens to reverse")


def _scale_fault(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, scale: float, dropout: float) -> torch.Tensor:
    """A faulty copy of the ``torch`` backend: softmax scale off by 10%."""
    return BACKENDS["torch"](q, k, v, meta, 1.1 * scale, dropout)


@torch.no_grad()
def spot_check_packed_rows(model: torch.nn.Module, episodes: Sequence[Episode],
                           backend: str) -> tuple[int, int, float]:
    """The in-training spot-check (``verl_memopd.trainer.audit.rce_spot_check``, as the actor engine runs it)
    on the episodes' packed rows in one remove-padding stream, packed forward under ``backend``.
    Returns (calls above their tolerance, calls checked, largest per-call difference)."""
    from verl_memopd.segments import segment_meta
    from verl_memopd.trainer.audit import rce_spot_check

    rows = [pack_episode(ep) for ep in episodes]
    ids = [torch.tensor(r.prompt_ids + r.response_ids) for r in rows]
    seg = [torch.tensor(r.segment_ids) for r in rows]
    pos = torch.cat([torch.tensor(r.position_ids) for r in rows])
    lengths = torch.tensor([x.numel() for x in ids])
    meta = segment_meta(torch.cat(seg), torch.repeat_interleave(torch.arange(len(rows)), lengths), pos)
    with attention_implementation(model, hf_name(backend)):
        logits = model(input_ids=torch.cat(ids)[None], position_ids=pos[None], memopd_segments=meta,
                       use_cache=False).logits  # (1, N, V)
        diffs, tolerances = rce_spot_check(model, model, logits.flatten(0, 1), torch.cumsum(lengths, 0) - lengths,
                                           ids, seg, [torch.tensor(r.response_mask) for r in rows])
    failed = int(sum((d > t).sum() for d, t in zip(diffs, tolerances)))
    return failed, sum(d.numel() for d in diffs), float(torch.cat(diffs).max())


@dataclass(frozen=True)
class SelfTest:
    """Outcome of :func:`self_test`: each audit's largest difference on the clean path and under each fault
    (offline: ``max_abs_diff``; spot-check: largest per-call difference), and the verdicts."""

    offline: dict[str, RceReport]
    spot_check: dict[str, tuple[int, int, float]]

    @property
    def packer_fault_detected(self) -> bool:
        return not self.offline["packer_fault"].passed

    @property
    def backend_fault_detected(self) -> bool:
        return not self.offline["backend_fault"].passed and self.spot_check["backend_fault"][0] > 0

    @property
    def clean_pass(self) -> bool:
        return self.offline["clean"].passed and self.spot_check["clean"][0] == 0

    def lines(self) -> list[str]:
        out = [f"offline {case}: max_abs_diff={r.max_abs_diff:.3e} tolerance={r.tolerance:.3e} "
               f"{'PASS' if r.passed else 'FAIL'}" for case, r in self.offline.items()]
        out += [f"spot-check {case}: max_call_diff={d:.3e} calls_failed={n}/{total}"
                for case, (n, total, d) in self.spot_check.items()]
        out.append(f"RCE self-test packer_fault_detected={int(self.packer_fault_detected)} "
                   f"backend_fault_detected={int(self.backend_fault_detected)} clean_pass={int(self.clean_pass)}")
        return out


def self_test(model: torch.nn.Module, episodes: Sequence[Episode]) -> SelfTest:
    """Inject each fault into a copy of the code path -- the packer (:func:`reversed_block_packer`) and the
    attention backend (:func:`_scale_fault`, registered only inside this call) -- and run both audits."""
    offline = {"clean": rce_audit(model, episodes),
               "packer_fault": rce_audit(model, episodes, pack=reversed_block_packer)}
    spot = {"clean": spot_check_packed_rows(model, episodes, "torch")}
    with scoped_backend("selftest_scale_fault", _scale_fault):
        offline["backend_fault"] = rce_audit(model, episodes, backend="selftest_scale_fault")
        spot["backend_fault"] = spot_check_packed_rows(model, episodes, "selftest_scale_fault")
    return SelfTest(offline, spot)


def _load_model(path: Optional[str], seed: int, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if path is not None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        from verl_memopd.tiny import student_model

        model = student_model(seed=seed).to(dtype)
    return model.to(device).eval()


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_memopd.rce", description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=None, help="random episodes to audit (default 200; self-test 12)")
    p.add_argument("--seed", type=int, default=0, help="seed of episodes and random model weights (default 0)")
    p.add_argument("--model", default=None, help="HF model folder (default: random tiny student, verl_memopd.tiny)")
    p.add_argument("--backend", default="torch", choices=sorted(BACKENDS),
                   help="packed attention backend (default torch)")
    p.add_argument("--dtype", default="float32", choices=[str(d).replace("torch.", "") for d in TOLERANCES])
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--batch-episodes", type=int, default=25, help="episodes per forward (default 25)")
    p.add_argument("--self-test", action="store_true",
                   help="inject a packer and an attention-backend fault and check both audits catch them")
    args = p.parse_args(argv)
    model = _load_model(args.model, args.seed, getattr(torch, args.dtype), args.device)
    if args.self_test:
        result = self_test(model, random_episodes(args.episodes or 12, model.config.vocab_size, args.seed))
        print("\n".join(result.lines()))
        return 0 if result.packer_fault_detected and result.backend_fault_detected and result.clean_pass else 1
    episodes = random_episodes(args.episodes or 200, model.config.vocab_size, args.seed)
    report = rce_audit(model, episodes, args.backend, args.batch_episodes)
    print(f"rce: {report.action_tokens} action tokens, {report.dtype}, backend {report.backend}, "
          f"tolerance {report.tolerance:.3e}: {'PASS' if report.passed else 'FAIL'}")
    print(report.line())
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
