"""The horizon study's statistics: paired differences of arms with bootstrap intervals, and the one-line-per-horizon
summary (``python -m verl_memopd.experiment summary results/cpu_smollm2_horizon/metrics.csv``), from per-episode test
rows (``report.EPISODE_COLUMNS``; ``episodes.csv``, written by the report stage, with ``horizon`` for the combined
file of a several-preset experiment).

A paired difference of arms A and B (:func:`paired_difference`) is taken episode by episode at each seed both arms
have (the same test episodes in the same order: every eval's ``input_sha`` is checked), and its 95% interval is a
bootstrap over seeds and episodes together (each replicate resamples the seeds and the episodes with replacement and
averages the differences on that grid), so it reflects both the test-set size and the seed-to-seed spread.
"""

from __future__ import annotations

import statistics

__all__ = ["SUMMARY_ARMS", "DIFFERENCES", "paired_difference", "mean_interval", "horizon_summary_lines"]

#: the arms of the summary line, in its order
SUMMARY_ARMS = ("memopd", "opd", "kd_soft", "kd", "sft", "flat")
#: the summary line's paired differences: (name, arm A, arm B) -> ``<name>=<mean A - B> <name>_ci=<lo>,<hi>``
DIFFERENCES = (("opd_minus_kd_soft", "opd", "kd_soft"), ("memopd_minus_kd", "memopd", "kd"))
#: bootstrap replicates of a paired difference, and the generator's seed (the intervals are reproducible)
BOOTSTRAP_REPLICATES = 10000
BOOTSTRAP_SEED = 0


def _by_seed(rows: list[dict], arm: str) -> dict[int, list[dict]]:
    """``arm``'s episodes per seed, each list in episode order."""
    out: dict[int, list[dict]] = {}
    for r in sorted((r for r in rows if r["arm"] == arm), key=lambda r: (r["seed"], r["episode"])):
        out.setdefault(r["seed"], []).append(r)
    return out


def _bootstrap(grid, replicates: int = BOOTSTRAP_REPLICATES) -> tuple[float, float]:
    """95% percentile interval of the mean of ``grid`` (seeds, episodes) when seeds and episodes are resampled."""
    import numpy as np

    rng = np.random.default_rng(BOOTSTRAP_SEED)
    n_s, n_e = grid.shape
    reps = np.empty(replicates)
    for i in range(replicates):
        reps[i] = grid[np.ix_(rng.integers(0, n_s, n_s), rng.integers(0, n_e, n_e))].mean()
    lo, hi = np.percentile(reps, [2.5, 97.5])
    return float(lo), float(hi)


def mean_interval(rows: list[dict], arm: str) -> tuple[float, float, float, int] | None:
    """Mean test F1 of ``arm`` over its seeds and episodes, its 95% bootstrap interval (seeds and episodes
    resampled), and its number of seeds; None without rows. Every seed must list the same episodes."""
    import numpy as np

    per_seed = _by_seed(rows, arm)
    if not per_seed:
        return None
    lengths = {len(eps) for eps in per_seed.values()}
    if len(lengths) != 1:
        raise ValueError(f"{arm}: its seeds were evaluated on different numbers of test episodes {sorted(lengths)}")
    grid = np.array([[r["f1"] for r in eps] for eps in per_seed.values()])
    return (float(grid.mean()), *_bootstrap(grid), len(per_seed))


def paired_difference(rows: list[dict], a: str, b: str) -> tuple[float, float, float, int] | None:
    """Mean of F1(a) - F1(b) over the episodes of every seed both arms have, its 95% bootstrap interval over seeds and
    episodes, and the number of common seeds; None if they share no seed. Raises if two evals do not list the same
    episodes (``input_sha``) in the same order."""
    import numpy as np

    ea, eb = _by_seed(rows, a), _by_seed(rows, b)
    seeds = sorted(set(ea) & set(eb))
    if not seeds:
        return None
    reference = [r["input_sha"] for r in ea[seeds[0]]]
    for arm, per_seed in ((a, ea), (b, eb)):
        for s in seeds:
            if [r["input_sha"] for r in per_seed[s]] != reference:
                raise ValueError(
                    f"paired {a} - {b}: {arm} seed {s} was evaluated on other test episodes (or in another order) "
                    f"than {a} seed {seeds[0]}"
                )
    d = np.array([[x["f1"] - y["f1"] for x, y in zip(ea[s], eb[s])] for s in seeds])  # (seeds, episodes)
    return (float(d.mean()), *_bootstrap(d), len(seeds))


def _fmt(x: float | None) -> str:
    return "na" if x is None else f"{x:.4f}"


def _mean_f1(rows: list[dict], arm: str) -> tuple[float | None, int]:
    """Mean test F1 of ``arm`` over its seeds (each seed's mean over episodes) and how many seeds it has."""
    per_seed = _by_seed(rows, arm)
    if not per_seed:
        return None, 0
    return statistics.fmean(statistics.fmean(r["f1"] for r in eps) for eps in per_seed.values()), len(per_seed)


def horizon_summary_lines(episodes: list[dict], model: str) -> list[str]:
    """One ``experiment horizon=<T> ...`` line per horizon of the combined ``episodes.csv`` rows, shortest horizon
    first. ``seeds``: the fewest seeds any arm of the line has (0 while an arm has none); ``test_episodes``: the
    distinct test episodes of the horizon; ``<arm>_f1``: the mean over the arm's seeds; the differences are paired
    (:func:`paired_difference`), ``na`` until both arms have a seed in common."""
    lines = []
    for horizon in sorted({r["horizon"] for r in episodes}):
        rows = [r for r in episodes if r["horizon"] == horizon]
        means = {arm: _mean_f1(rows, arm) for arm in ("teacher", "student", *SUMMARY_ARMS)}
        seeds = min(means[arm][1] for arm in SUMMARY_ARMS)
        n_episodes = len({r["input_sha"] for r in rows})
        fields = [
            f"experiment horizon={horizon} model={model} seeds={seeds} test_episodes={n_episodes}",
            f"teacher_f1={_fmt(means['teacher'][0])} start_f1={_fmt(means['student'][0])}",
            *(f"{arm}_f1={_fmt(means[arm][0])}" for arm in SUMMARY_ARMS),
        ]
        for name, a, b in DIFFERENCES:
            diff = paired_difference(rows, a, b)
            fields.append(
                f"{name}=na {name}_ci=na,na"
                if diff is None
                else f"{name}={diff[0]:.4f} {name}_ci={diff[1]:.4f},{diff[2]:.4f}"
            )
        lines.append(" ".join(fields))
    return lines
