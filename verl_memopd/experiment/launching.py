"""verl's trainer as a subprocess: the environment it runs in, a hard time bound, the metrics it prints.

verl prints one console line per step, ``step:N - key:value - key:value ...``, possibly after a tqdm
bar or a Ray actor prefix on the same line; the validation metrics of a step may come on a line of
their own, and numbers may be printed as numpy reprs::

    (TaskRunner pid=1) step:1 - actor/memopd/reverse_kl:0.5 - training/global_step:np.int64(1)
    step:1 - val-core/memopd_memory/tiny/reward/mean@1:0.25

One copy for every caller: the GPU check (``verl_memopd.bench.gpucheck``), the CPU experiment
(``verl_memopd.experiment``) and the tests' launcher (``tests/verl_runs/launcher.py``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

__all__ = ["BoundedRun", "cpu_env", "offline_env", "parse_steps", "prune_checkpoints", "run_bounded"]

_STEP = re.compile(r"step:(\d+) - (.*)$")
_NUMBER = re.compile(r"^(?:np\.\w+\()?([-+0-9.eEinfa]+)\)?$")


def parse_steps(log: str) -> dict[int, dict[str, float]]:
    """verl's console step lines -> ``{step: {metric: value}}``, numeric values only.

    Lines of one step are merged (a later line's value wins for a key printed twice); a value that
    is not a number (``note:text``) is skipped.
    """
    steps: dict[int, dict[str, float]] = {}
    for line in log.splitlines():
        m = _STEP.search(line)
        if not m:
            continue
        metrics = steps.setdefault(int(m.group(1)), {})
        for item in m.group(2).split(" - "):
            key, _, raw = item.partition(":")
            num = _NUMBER.match(raw.strip())
            if num:
                try:
                    metrics[key.strip()] = float(num.group(1))
                except ValueError:
                    pass
    return steps


def offline_env() -> dict[str, str]:
    """This process's environment for a verl run with no network: offline hubs, no wandb, unbuffered output."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }


def cpu_env(workdir: Path, threads: int | None = None) -> dict[str, str]:
    """:func:`offline_env` for a verl CPU run: cpu platform, a 1 GiB vLLM KV cache, caches in ``workdir/cache``.

    ``threads``: torch threads of each Ray worker (``OMP_NUM_THREADS``, which Ray leaves alone when set; unset, Ray
    gives a worker started without ``num_cpus`` -- verl's worker groups -- one thread). None keeps this process's
    environment as it is."""
    if threads is not None and threads < 1:
        raise ValueError(f"cpu_env: threads must be >= 1 or None, got {threads}")
    cache = Path(workdir) / "cache"
    env = {
        **offline_env(),
        "VERL_PLATFORM": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HOME": str(cache / "hf"),
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "RAY_TMPDIR": "/tmp/ray_memopd",  # Ray needs a short path for its sockets
    }
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


@dataclass(frozen=True)
class BoundedRun:
    """A finished :func:`run_bounded` command: exit status (``-9`` when killed at the bound), output, seconds."""

    returncode: int
    log: str
    wall_s: float


def run_bounded(
    cmd: Sequence[str], cwd: Path, env: Mapping[str, str], timeout_s: float, log_path: Path, who: str
) -> BoundedRun:
    """Run ``cmd`` in ``cwd`` in its own session, stdout+stderr captured and written to ``log_path``.

    At ``timeout_s`` the whole process group is killed (a failed verl worker can leave the driver
    waiting forever; the group holds the local Ray cluster the driver started, and ``ray stop`` is
    not used, it would stop every Ray instance on the machine); the log then ends with
    ``[<who>] killed after the <timeout_s>s timeout``.
    """
    start = time.monotonic()
    proc = subprocess.Popen(
        list(cmd),
        cwd=cwd,
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=timeout_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        rc = -signal.SIGKILL
        log += f"\n[{who}] killed after the {timeout_s:.0f}s timeout\n"
    Path(log_path).write_text(log)
    return BoundedRun(rc, log, time.monotonic() - start)


def prune_checkpoints(checkpoints: Path, keep: str = "actor/huggingface") -> None:
    """After an arm is done: drop its resumable state (FSDP shards, optimizer, the critic), keep the Hugging Face
    exports (``global_step_*/<keep>``: evaluated, diagnosed) -- ~3 GB less per arm of a 135M-parameter model."""
    import shutil

    for step_dir in checkpoints.glob("global_step_*"):
        kept = step_dir / keep
        for item in list(step_dir.rglob("*")):
            if (
                item.exists()
                and item != kept
                and kept not in item.parents
                and item not in kept.parents
                and item.name != "data.pt"
            ):
                shutil.rmtree(item) if item.is_dir() else item.unlink()
