"""Does MemOPD make a memory agent better? The CPU experiment behind ``recipes/experiment_cpu.sh``.

A competent teacher and a weak student trained by verl's SFT trainer on the oracle's calls, then
three matched RL arms from that student (MemOPD, persistent-history teacher scoring, PPO only),
validation F1 every K steps, a final test-split table, ``metrics.csv`` and ``f1.png``.
Stages: :mod:`.pipeline`; numbers: :mod:`.config`; CLI: ``python -m verl_memopd.experiment``.
"""
