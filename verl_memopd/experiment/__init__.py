"""Does MemOPD make a memory agent better? The CPU experiments behind ``recipes/experiment_cpu.sh``.

A competent teacher and a weak student trained by verl's SFT trainer on the oracle's calls, then matched arms from
that student (:data:`.config.ARMS`: MemOPD, OPD alone, persistent-history teacher scoring, PPO alone, OPD's
off-policy twin kd_soft, KD and continued SFT), validation F1 every K steps, a final test-split table with
per-episode rows, ``metrics.csv`` and ``f1.png``; the horizon study repeats them per number of memory calls
(``cpu_smollm2_horizon``: paired statistics in :mod:`.horizon`, ``f1_vs_horizon.png``).
Stages: :mod:`.pipeline`; numbers: :mod:`.config`; CLI: ``python -m verl_memopd.experiment``.
"""
