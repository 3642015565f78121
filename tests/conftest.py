"""Shared fixtures: offline environment, tiny models, and the ``slow`` marker.

``slow`` marks tests that start Ray + vLLM + verl workers (minutes each on 2 cores); they run in
CI (the README's test command runs everything) and can be skipped locally with ``-m "not slow"``.
"""

from __future__ import annotations

import os

import pytest

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
}
for _k, _v in OFFLINE_ENV.items():
    os.environ.setdefault(_k, _v)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: starts Ray/vLLM/verl workers (minutes on 2 CPU cores)")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """The tiny student and teacher (built once per test session, offline, seed 0)."""
    from verl_memopd.bench.tiny import build

    return build(tmp_path_factory.mktemp("tiny"), seed=0)
