"""Run ``python -m verl.trainer.main_ppo`` on CPU from tests, bounded, and parse its metrics.

verl prints one console line per step (``step:N - key:value - key:value ...``); this module
runs the trainer in its own process group under a hard timeout (a failed verl worker can
leave the driver waiting forever), stops the Ray cluster it started, and returns the parsed
per-step metrics together with the full log for assertion messages.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

_STEP_RE = re.compile(r"step:(\d+) - (.*)$")
_NUMBER_RE = re.compile(r"^(?:np\.\w+\()?([-+0-9.eEinfa]+)\)?$")


@dataclass
class VerlRun:
    returncode: int
    wall_s: float
    log: str
    steps: dict[int, dict[str, float]] = field(default_factory=dict)

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.splitlines()[-n:])


def parse_steps(log: str) -> dict[int, dict[str, float]]:
    """Parse verl's console step lines into ``{step: {metric: value}}`` (numeric values only)."""
    steps: dict[int, dict[str, float]] = {}
    for line in log.splitlines():
        m = _STEP_RE.search(line)
        if not m:
            continue
        metrics = {}
        for item in m.group(2).split(" - "):
            key, _, raw = item.partition(":")
            num = _NUMBER_RE.match(raw.strip())
            if num:
                try:
                    metrics[key.strip()] = float(num.group(1))
                except ValueError:
                    pass
        steps[int(m.group(1))] = metrics
    return steps


def non_finite(metrics: dict[str, float]) -> list[str]:
    return [k for k, v in metrics.items() if not math.isfinite(v)]


def cpu_env(workdir: Path) -> dict[str, str]:
    """Environment for a verl CPU run: cpu platform, offline hubs, caches inside ``workdir``."""
    env = dict(os.environ)
    env.update(
        VERL_PLATFORM="cpu",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_MODE="disabled",
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HOME=str(workdir / "hf"),
        VLLM_CACHE_ROOT=str(workdir / "vllm"),
        TRITON_CACHE_DIR=str(workdir / "triton"),
        RAY_TMPDIR="/tmp/ray_memopd",  # Ray needs a short path for its sockets
        PYTHONUNBUFFERED="1",
    )
    return env


def run_main_ppo(overrides: list[str], workdir: Path, timeout_s: float, env: dict | None = None) -> VerlRun:
    """Run verl's trainer with ``overrides`` in ``workdir``; never outlives ``timeout_s``."""
    return run_command([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], workdir, timeout_s, env)


def run_command(cmd: list[str], workdir: Path, timeout_s: float, env: dict | None = None) -> VerlRun:
    """Run a command that starts verl (``main_ppo`` or a recipe script) in ``workdir``, bounded.

    On timeout the whole process group is killed: the driver and the local Ray cluster it started
    (``ray stop`` is not used, it would stop every Ray instance on the machine)."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = env or cpu_env(workdir)
    os.makedirs(env["RAY_TMPDIR"], exist_ok=True)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = -9
        out += f"\n[launcher] killed after {timeout_s:.0f}s timeout\n"
    (workdir / "main_ppo.log").write_text(out)
    return VerlRun(returncode=rc, wall_s=time.monotonic() - start, log=out, steps=parse_steps(out))
