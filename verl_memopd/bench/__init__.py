"""Benchmarks, one module per measurement; run with ``python -m verl_memopd.bench <name>``."""
