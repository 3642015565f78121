"""Two diagnostics of the teacher's supervision, run with Hugging Face models (``hf_agent.py``).

- **Teacher from the student's state** (``eval/handoff.json``, the eval stage): the start student runs calls
  ``0..t-1`` of each val episode, then the teacher takes over from call ``t`` (greedy); mean F1 per ``t``
  (``t = 0``: the teacher alone; ``t = N + 1``: the student alone). The teacher's supervision on the student's
  rollouts is only useful if the teacher can still answer from the states the student writes.
- **Held-out reverse KL** (``eval/heldout_rollouts.json``, then ``arms/<arm>_seed<s>/heldout_kl.json``): one fixed
  set of the start student's sampled rollouts of the val episodes (temperature 1, a fixed seed), and for a model
  the mean per-token KL(model || teacher) on their sampled tokens, each call run alone in the state it was
  sampled in, overall and by call index (the drift along the episode). The same tokens for every arm and step, so
  the values compare across arms (unlike the training KL, which each arm measures on its own rollouts).
- **F1 by state** (``eval/state_<model>_<split>.json``, the eval stage with ``teacher_flat_sft``): a teacher acting
  alone (greedy) in the aligned state and in the flat state, the persistent history the ``flat`` arm's teacher
  scores in (``hf_agent.agent_calls(state=)``, the separator the arm's trainer resolves); mean F1 and per-episode
  F1 of each. The flat arm's teacher is a fair control only if it is competent in the flat state.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from verl_memopd.experiment.config import ExperimentConfig, Paths

__all__ = [
    "HELDOUT_SEED",
    "STATE_BATCH",
    "teacher_handoff",
    "heldout_rollouts",
    "heldout_kl",
    "arm_heldout_kl",
    "state_f1",
]

#: sampling seed of the held-out rollouts (fixed: the same tokens in every run of the experiment)
HELDOUT_SEED = 12345
#: episodes per ``generate`` batch by state: a flat-state call's input is the whole history (~2.2k tokens at h12's
#: last call), and CPU attention over a left-padded batch holds a (batch, heads, L, L) score tensor
STATE_BATCH = {"aligned": 32, "flat": 8}


def _split_rows(paths: Paths, split: str) -> list[dict]:
    import pandas as pd

    frame = pd.read_parquet(paths.data / f"{split}.parquet")
    return [frame.iloc[i].to_dict() for i in range(len(frame))]


def teacher_handoff(cfg: ExperimentConfig, paths: Paths, student: Path, teacher: Path) -> dict:
    """``eval/handoff.json``: ``{"f1_by_switch": {t: F1}, ...}`` (cached). Each switch point is saved as it
    finishes (``eval/handoff.partial.json``), so a stopped run resumes at the next one (a long horizon has many)."""
    from verl_memopd.experiment.hf_agent import handoff_f1, load_model
    from verl_memopd.experiment.launch import AGENT_TOKENS

    out, partial = paths.evals() / "handoff.json", paths.evals() / "handoff.partial.json"
    if out.is_file():
        return json.loads(out.read_text())
    started = time.monotonic()
    rows = _split_rows(paths, "val")
    switches = range(len(rows[0]["extra_info"]["chunks"]) + 2)
    f1 = {int(t): v for t, v in json.loads(partial.read_text()).items()} if partial.is_file() else {}
    print(
        f"[experiment {time.strftime('%H:%M:%S')}] eval handoff: the teacher takes over from the student at call t "
        f"(val, greedy, Hugging Face generate; t = {switches.start}..{switches.stop - 1}, {len(f1)} done)",
        flush=True,
    )
    (s_model, tokenizer), (t_model, _) = load_model(student), load_model(teacher)
    for t in (t for t in switches if t not in f1):
        f1.update(handoff_f1(rows, s_model, t_model, tokenizer, **AGENT_TOKENS, switches=[t]))
        partial.write_text(json.dumps({str(k): v for k, v in sorted(f1.items())}) + "\n")
        print(f"[experiment {time.strftime('%H:%M:%S')}] eval handoff: t={t} F1 {f1[t]:.3f}", flush=True)
    result = {
        "student": str(student),
        "teacher": str(teacher),
        "split": "val",
        "f1_by_switch": {str(t): f1[t] for t in switches},
        "wall_s": round(time.monotonic() - started, 1),
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    partial.unlink()
    print(
        "[experiment] eval handoff: F1 by the call the teacher takes over at: "
        + " ".join(f"{t}:{f1[t]:.3f}" for t in switches),
        flush=True,
    )
    return result


def heldout_rollouts(cfg: ExperimentConfig, paths: Paths, student: Path):
    """The fixed held-out rollouts (``eval/heldout_rollouts.json``, cached): a list of ``AgentCall``."""
    from verl_memopd.experiment.hf_agent import AgentCall, agent_calls, load_model
    from verl_memopd.experiment.launch import AGENT_TOKENS

    out = paths.evals() / "heldout_rollouts.json"
    if not out.is_file():
        model, tokenizer = load_model(student)
        episodes = agent_calls(
            _split_rows(paths, "val"), [model], tokenizer, sample=True, seed=HELDOUT_SEED, **AGENT_TOKENS
        )
        calls = [asdict(c) for e in episodes for c in e.calls]
        out.write_text(
            json.dumps(
                {
                    "student": str(student),
                    "seed": HELDOUT_SEED,
                    "calls": calls,
                    "student_f1": sum(e.f1 for e in episodes) / len(episodes),
                }
            )
            + "\n"
        )
    return [
        AgentCall(**{k: tuple(v) if isinstance(v, list) else v for k, v in c.items()})
        for c in json.loads(out.read_text())["calls"]
    ]


def heldout_kl(cfg: ExperimentConfig, paths: Paths, model_dir: Path, teacher: Path, out_json: Path, meta: dict) -> dict:
    """Mean per-token KL(model || teacher) on the held-out rollouts (cached in ``out_json``)."""
    from verl_memopd.experiment.hf_agent import load_model, reverse_kl_on_calls
    from verl_memopd.experiment.sft import start_models

    if out_json.is_file():
        return json.loads(out_json.read_text())
    started = time.monotonic()
    calls = heldout_rollouts(cfg, paths, start_models(cfg, paths)[0])
    (model, _), (t_model, _) = load_model(model_dir), load_model(teacher)
    kl, by_call = reverse_kl_on_calls(model, t_model, calls)
    result = {
        **meta,
        "heldout_reverse_kl": kl,
        "heldout_reverse_kl_by_call": {str(k): v for k, v in by_call.items()},
        "tokens": sum(len(c.response_ids) for c in calls),
        "model": str(model_dir),
        "wall_s": round(time.monotonic() - started, 1),
    }
    out_json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"[experiment] held-out reverse KL {out_json.parent.name}/{out_json.name}: {kl:.4f}", flush=True)
    return result


def arm_heldout_kl(
    cfg: ExperimentConfig, paths: Paths, arm: str, seed: int, exports: dict[int, Path], teacher: Path
) -> None:
    """Held-out reverse KL of an arm's model at each of its saved steps (``exports``: step -> HF folder)."""
    run_dir = paths.arm(arm, seed)
    for step, model in sorted(exports.items()):
        heldout_kl(
            cfg,
            paths,
            model,
            teacher,
            run_dir / f"heldout_kl_step{step}.json",
            {"arm": arm, "seed": seed, "step": step},
        )


def state_f1(paths: Paths, name: str, model_dir: Path, step: int, split: str) -> dict:
    """``eval/state_<name>_<split>.json`` (cached): the model ``model_dir`` (``name`` at SFT ``step``) acting alone,
    greedy, on every episode of ``split`` in each state of ``hf_agent.STATES``: ``{"f1": {state: mean F1},
    "episodes": {state: [F1 per episode, in the split's order]}, "separator": [...], "wall_s": the last attempt's
    seconds, ...}``. Each state is saved as it finishes (``.partial.json``), so a stopped run resumes at the next
    one."""
    from verl_memopd.experiment.hf_agent import STATES, agent_calls, load_model
    from verl_memopd.experiment.launch import AGENT_TOKENS
    from verl_memopd.trainer.teacher import flat_separator_ids

    out = paths.evals() / f"state_{name}_{split}.json"
    partial = out.with_suffix(".partial.json")
    if out.is_file():
        return json.loads(out.read_text())
    started = time.monotonic()
    rows = _split_rows(paths, split)
    done = json.loads(partial.read_text()) if partial.is_file() else {}
    model, tokenizer = load_model(model_dir)
    separator = list(flat_separator_ids(None, tokenizer, len(tokenizer)))  # the flat arm's (option left at null)
    for state in (s for s in STATES if s not in done):
        print(
            f"[experiment {time.strftime('%H:%M:%S')}] eval state: {name} acting in the {state} state ({split}, "
            f"{len(rows)} episodes, greedy, Hugging Face generate)",
            flush=True,
        )
        episodes = agent_calls(
            rows, [model], tokenizer, batch=STATE_BATCH[state], state=state, separator=separator, **AGENT_TOKENS
        )
        done[state] = [e.f1 for e in episodes]
        partial.write_text(json.dumps(done) + "\n")
    result = {
        "model": name,
        "path": str(model_dir),
        "step": step,
        "split": split,
        "separator": separator,
        "f1": {state: sum(done[state]) / len(done[state]) for state in STATES},
        "episodes": {state: done[state] for state in STATES},
        "wall_s": round(time.monotonic() - started, 1),
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    partial.unlink()
    print(
        f"[experiment] eval state {name} ({split}): F1 "
        + " ".join(f"{state} {result['f1'][state]:.3f}" for state in STATES),
        flush=True,
    )
    return result
