"""``f1.png`` from ``metrics.csv`` rows (matplotlib, no display needed).

Five panels:
  1. SFT: val F1 of the teacher's and the student's SFT checkpoints vs SFT step;
  2. arms: val F1 vs step, one line per arm (mean over seeds, min-max band), the teacher's F1 and the
     student's start as horizontal references;
  3. training reverse KL to the teacher vs step (each arm on its own rollouts);
  4. held-out reverse KL vs step: every arm on one fixed set of the start student's rollouts;
  5. the teacher from the student's state: val F1 when the teacher takes over at call t (``handoff.csv``).
A panel with no data yet says so (a partial run still produces the picture).

``f1_vs_horizon.png`` (:func:`plot_horizon`, a several-preset experiment): test F1 of the teacher, the start and each
arm vs the horizon T (mean over seeds and episodes, 95% bootstrap interval), then one panel per T with the held-out
reverse KL by call index (the drift along the episode) of the start and each arm's final model.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

__all__ = ["band", "plot_metrics", "plot_horizon"]

COLORS = {
    "memopd": "tab:blue",
    "flat": "tab:orange",
    "ppo": "tab:green",
    "opd": "tab:purple",
    "kd_soft": "tab:red",
    "kd": "tab:brown",
    "sft": "tab:olive",
    "teacher": "black",
    "student": "tab:gray",
}
ARMS = ("memopd", "flat", "ppo", "opd", "kd_soft", "kd", "sft")


def band(rows: list[dict], arm: str, split: str, key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps and the (mean, min, max) of ``key`` over seeds at each step (steps where some seed has a value)."""
    by_step: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        if r["arm"] == arm and r["split"] == split and r[key] is not None:
            by_step[r["step"]].append(r[key])
    steps = sorted(by_step)
    return (
        steps,
        [sum(by_step[s]) / len(by_step[s]) for s in steps],
        [min(by_step[s]) for s in steps],
        [max(by_step[s]) for s in steps],
    )


def _reference(rows: list[dict], role: str) -> float | None:
    """Val F1 of the SFT checkpoint the experiment uses: the latest one that also has a test row (the teacher's
    final checkpoint, the chosen student; as the summary's test F1)."""
    tested = {r["step"] for r in rows if r["arm"] == role and r["split"] == "test"}
    vals = {r["step"]: r["f1"] for r in rows if r["arm"] == role and r["split"] == "val" and r["step"] in tested}
    return vals[max(vals)] if vals else None


def _empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"{what}: not measured yet", ha="center", va="center", transform=ax.transAxes, color="gray")


def _lines(ax, rows: list[dict], arms, split: str, key: str, style: str) -> None:
    for arm in arms:
        steps, mean, lo, hi = band(rows, arm, split, key)
        if steps:
            ax.plot(steps, mean, style, color=COLORS[arm], label=arm)
            ax.fill_between(steps, lo, hi, color=COLORS[arm], alpha=0.2)


def _kl_panel(ax, rows: list[dict], split: str, style: str, title: str, xlabel: str, ylabel: str, what: str) -> None:
    """One reverse-KL panel: every arm's ``reverse_kl`` rows of ``split`` (mean, min-max band)."""
    _lines(ax, rows, ARMS, split, "reverse_kl", style)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if ax.lines:
        ax.legend()
    else:
        _empty(ax, what)


def plot_metrics(rows: list[dict], out: Path, handoff: dict[int, float] | None = None) -> Path:
    """Draw the panels (module docstring) into ``out``; ``handoff``: val F1 by the call the teacher takes over at."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    (ax_sft, ax_f1, ax_kl), (ax_held, ax_hand, ax_off) = axes
    ax_off.axis("off")
    for role in ("teacher", "student"):
        steps, mean, _, _ = band(rows, role, "val", "f1")
        if steps:
            ax_sft.plot(steps, mean, "o-", color=COLORS[role], label=f"{role} SFT")
    ax_sft.set(title="SFT checkpoints (verl val_only, greedy)", xlabel="SFT step", ylabel="val F1", ylim=(0, 1))
    if ax_sft.lines:
        ax_sft.legend()
    else:
        _empty(ax_sft, "SFT val F1")

    _lines(ax_f1, rows, ARMS, "val", "f1", "o-")
    for role, style in (("teacher", "--"), ("student", ":")):
        ref = _reference(rows, role)
        if ref is not None:
            ax_f1.axhline(ref, linestyle=style, color=COLORS[role], label=f"{role} (SFT) {ref:.2f}")
    ax_f1.set(title="arms: val F1 (mean, min-max over seeds)", xlabel="step", ylabel="val F1", ylim=(0, 1))
    if not any(band(rows, a, "val", "f1")[0] for a in ARMS):
        _empty(ax_f1, "RL arms")
    if ax_f1.lines:
        ax_f1.legend(fontsize=8)

    _kl_panel(
        ax_kl,
        rows,
        "train",
        "-",
        "training reverse KL to the teacher (own rollouts)",
        "RL step",
        "reverse KL (nats/token)",
        "reverse KL",
    )
    _kl_panel(
        ax_held,
        rows,
        "heldout",
        "o-",
        "held-out reverse KL (fixed start-student rollouts)",
        "step",
        "KL(model || teacher), nats/token",
        "held-out reverse KL",
    )

    if handoff:
        calls = sorted(handoff)
        ax_hand.plot(calls, [handoff[t] for t in calls], "o-", color=COLORS["teacher"])
        ax_hand.set(ylim=(0, 1))
    else:
        _empty(ax_hand, "teacher from the student's state")
    ax_hand.set(
        title="teacher takes over from the start student at call t",
        xlabel="t (0: teacher alone; last: student alone)",
        ylabel="val F1",
    )

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def plot_horizon(episodes: list[dict], drift: list[dict], out: Path) -> Path:
    """Draw ``f1_vs_horizon.png`` (module docstring) from the combined ``episodes.csv`` and ``drift.csv`` rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from verl_memopd.experiment.horizon import mean_interval

    horizons = sorted({r["horizon"] for r in episodes} | {r["horizon"] for r in drift})
    fig, axes = plt.subplots(1, 1 + max(len(horizons), 1), figsize=(5 * (1 + max(len(horizons), 1)), 4.5))
    ax_f1, kl_axes = axes[0], axes[1:]
    models = ("teacher", "student", *ARMS)
    for k, model in enumerate(models):
        points = [(t, mean_interval([r for r in episodes if r["horizon"] == t], model)) for t in horizons]
        points = [(t, m) for t, m in points if m is not None]
        if not points:
            continue
        x = [t + 0.08 * (k - len(models) / 2) for t, _ in points]  # side by side at each T
        mean = [m[0] for _, m in points]
        err = [[m[0] - m[1] for _, m in points], [m[2] - m[0] for _, m in points]]
        style = "--" if model in ("teacher", "student") else "-"
        label = "start" if model == "student" else model
        ax_f1.errorbar(x, mean, yerr=err, fmt="o" + style, color=COLORS[model], label=label, capsize=3)
    ax_f1.set(title="test F1 vs horizon (95% bootstrap, seeds x episodes)", xlabel="memory calls T", ylabel="test F1")
    ax_f1.set(xticks=horizons, ylim=(0, 1))
    if ax_f1.lines:
        ax_f1.legend(fontsize=8)
    else:
        _empty(ax_f1, "test F1")
    for ax, t in zip(kl_axes, horizons or [None]):
        rows = [r for r in drift if r["horizon"] == t]
        for model in ("student", *ARMS):
            mine = [r for r in rows if r["arm"] == model]
            if not mine:
                continue
            last = max(r["step"] for r in mine)
            by_call: dict[int, list[float]] = defaultdict(list)
            for r in mine:
                if r["step"] == last:
                    by_call[r["call"]].append(r["reverse_kl"])
            calls = sorted(by_call)
            label = "start" if model == "student" else f"{model} (step {last})"
            ax.plot(calls, [sum(by_call[c]) / len(by_call[c]) for c in calls], "o-", color=COLORS[model], label=label)
        ax.set(title=f"T={t}: held-out KL by call (start's rollouts)", xlabel="call index", ylabel="KL, nats/token")
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            _empty(ax, "held-out KL by call")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
