"""Run ``python -m verl.trainer.main_ppo`` on CPU from tests, bounded, and parse its metrics.

The environment, the time bound and the step-line parser are the package's
(``verl_memopd.experiment.launching``, shared with the GPU check and the experiment); this module adds the
test-side record of a run: exit status, wall time, the full log for assertion messages and the
parsed per-step metrics.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from verl_memopd.experiment.launching import cpu_env, parse_steps, run_bounded

__all__ = ["VerlRun", "non_finite", "run_command", "run_main_ppo"]


@dataclass
class VerlRun:
    returncode: int
    wall_s: float
    log: str
    steps: dict[int, dict[str, float]] = field(default_factory=dict)

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.splitlines()[-n:])


def non_finite(metrics: dict[str, float]) -> list[str]:
    return [k for k, v in metrics.items() if not math.isfinite(v)]


def run_main_ppo(overrides: list[str], workdir: Path, timeout_s: float, env: dict | None = None) -> VerlRun:
    """Run verl's trainer with ``overrides`` in ``workdir``; never outlives ``timeout_s``."""
    return run_command([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], workdir, timeout_s, env)


def run_command(cmd: list[str], workdir: Path, timeout_s: float, env: dict | None = None) -> VerlRun:
    """Run a command that starts verl (``main_ppo`` or a recipe script) in ``workdir``, bounded
    (``verl_memopd.experiment.launching.run_bounded``: on timeout the driver and its local Ray cluster are killed);
    the log is ``workdir/main_ppo.log``."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = env or cpu_env(workdir)
    os.makedirs(env["RAY_TMPDIR"], exist_ok=True)
    run = run_bounded(cmd, workdir, env, timeout_s, workdir / "main_ppo.log", who="launcher")
    return VerlRun(returncode=run.returncode, wall_s=run.wall_s, log=run.log, steps=parse_steps(run.log))
