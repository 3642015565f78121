"""Subprocesses of the experiment: bounded, logged to a file, killed as a process group on timeout.

A failed verl worker can leave its driver waiting forever, so every long command runs in its own
process group under a hard bound. Heavy commands (anything that starts Ray/vLLM: evals and arms)
can be serialised with other jobs on the machine through an ``flock`` file (``MEMOPD_HEAVY_LOCK``).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["run_checked", "run_logged", "heavy", "heavy_wall_s", "attempts", "last_attempt"]


#: printed by a heavy command once it holds the lock (epoch seconds): its own wall time starts there
STARTED = "[experiment] heavy command started at "
#: the header line :func:`run_logged` writes into the log before each command it runs
HEADER = "===== "


def heavy(cmd: list[str], timeout_s: float) -> list[str]:
    """``cmd`` bounded by ``timeout_s`` once it runs, under the shared heavy-job lock when ``MEMOPD_HEAVY_LOCK``
    names a lock file (``flock LOCK timeout T cmd``: waiting for the lock does not count against the bound).
    The command first prints :data:`STARTED` and the time (see :func:`heavy_wall_s`)."""
    bounded = [
        "bash",
        "-c",
        f'echo "{STARTED}$(date +%s.%N)"; exec "$@"',
        "heavy",
        "timeout",
        "-k",
        "60",
        str(int(timeout_s)),
        *cmd,
    ]
    lock = os.environ.get("MEMOPD_HEAVY_LOCK")
    return ["flock", lock, *bounded] if lock else bounded


def heavy_wall_s(log: Path) -> float:
    """Seconds since the last heavy command in ``log`` started (lock wait excluded); call when it has ended."""
    starts = [line[len(STARTED) :] for line in log.read_text(errors="replace").splitlines() if line.startswith(STARTED)]
    if not starts:
        raise RuntimeError(f"{log}: no '{STARTED.strip()}' line (not a heavy() command?)")
    return time.time() - float(starts[-1])


#: a header line as :func:`run_logged` writes it (a command's own output may start a line with "===== " too)
_HEADER_LINE = re.compile(rf"^{re.escape(HEADER)}\d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\dZ \$ ", re.MULTILINE)


def attempts(log: Path) -> int:
    """How many commands :func:`run_logged` has run into ``log``: 1 for a run that went through at once, more for one
    retried (the experiment's supervisor) or resumed (a later session) into the same log."""
    return len(_HEADER_LINE.findall(log.read_text(errors="replace")))


def last_attempt(log: Path) -> str:
    """The output of the last command :func:`run_logged` ran into ``log`` (its header line onwards)."""
    text = log.read_text(errors="replace")
    starts = [m.start() for m in _HEADER_LINE.finditer(text)]
    return text[starts[-1] :] if starts else text


def run_checked(cmd: list[str], env: dict[str, str] | None = None) -> None:
    """A short command, output passed through; raises on a non-zero exit."""
    print(f"[experiment] $ {shlex.join(cmd)}", flush=True)
    subprocess.run(cmd, env=env, check=True)


def _stop(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM the command's process group (torchrun forwards it to its workers, which run in their own
    groups), then SIGKILL whatever is left after ``grace_s``."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _kill_leftovers(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_logged(
    cmd: list[str], log: Path, env: dict[str, str], timeout_s: float | None, cwd: Path | None = None
) -> float:
    """Run ``cmd`` with stdout+stderr appended to ``log``; return wall seconds; raise on failure/timeout.

    The command runs in its own session; on timeout (None: the command bounds itself, see :func:`heavy`)
    the whole group is stopped, and whatever of the group outlives the command (verl's local Ray
    cluster after a crash) is killed when it ends.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[experiment] $ {shlex.join(cmd)}\n[experiment]   log: {log}", flush=True)
    start = time.monotonic()
    with open(log, "ab") as out:
        out.write(f"\n{HEADER}{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} $ {shlex.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise TimeoutError(f"{cmd[0]}... exceeded {timeout_s:.0f}s; see {log}") from None
        finally:
            _kill_leftovers(proc)
    wall = time.monotonic() - start
    if rc != 0:
        raise RuntimeError(f"exit status {rc} after {wall:.0f}s: {shlex.join(cmd)[:300]}...; see {log}")
    return wall
