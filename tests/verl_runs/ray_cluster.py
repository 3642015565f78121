"""A two-node Ray cluster on one machine (loopback), jobs submitted to it, nodes stopped by process id.

Two ``ray start --block`` processes form the cluster -- a head and a second node, each with its own
ports, temp dir, ``NODE_CPUS`` logical CPUs, one logical GPU and a marker resource
(``memopd_node_<i>``). Both are started with ``--node-ip-address=127.0.0.1`` and the dashboard
listens on 127.0.0.1 only (Ray itself swaps a loopback node address for the machine's own IP, so
nothing leaves the machine either way). Recent Ray turns token authentication on when a token
exists (``~/.ray/auth_token``): the cluster gets its own fresh token in ``RAY_AUTH_TOKEN`` (nodes
and the submitting CLI), so it neither depends on nor touches one of the user's.

Nodes are stopped -- or killed, to simulate a lost machine -- by process id: ``ray stop`` would stop
every Ray instance on the machine, other users' included. A node's processes are its ``ray start``
process group, their descendants, and any process whose command line names its temp dir.
Every ``ray`` CLI call is a Python start (~3 s of CPU on a loaded 2-core machine): waits watch the
job's log follower and files first and ask the cluster rarely.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from verl_memopd.experiment.launching import cpu_env

RAY = [sys.executable, "-m", "ray.scripts.scripts"]
#: per node: logical CPUs (TransferQueue, TaskRunner, agent and reward workers, vLLM servers each reserve some)
NODE_CPUS = 6
JOB_ENDED = ("SUCCEEDED", "FAILED", "STOPPED")


def free_ports(n: int, reserved: frozenset[int] = frozenset()) -> list[int]:
    """``n`` distinct ports free now and not in ``reserved`` (ports handed out earlier that their owner may not
    have bound yet: the OS would hand them out again)."""
    socks = []
    try:
        while len(socks) < n + len(reserved):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
    return [p for p in ports if p not in reserved][:n]


def _proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, process group, command line) of every process readable in /proc."""
    table = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(") ", 1)[1].split()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        if stat[0] != "Z":
            table[int(d.name)] = (int(stat[1]), int(stat[2]), cmd)
    return table


class RayNode:
    """``ray start --block`` in its own session; stopped (or killed) by signalling its processes by id."""

    def __init__(self, name: str, args: list[str], temp_dir: Path, env: dict, log: Path):
        self.name, self.temp_dir, self.log = name, temp_dir, log
        temp_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [*RAY, "start", "--block", f"--temp-dir={temp_dir}", *args],
            env=env,
            stdout=log.open("a"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def pids(self) -> list[int]:
        """Live processes of this node: its process group, their descendants, any naming its temp dir."""
        table = _proc_table()
        own = {pid for pid, (_, pgid, cmd) in table.items() if pgid == self.proc.pid or str(self.temp_dir) in cmd}
        if self.proc.poll() is None:
            own.add(self.proc.pid)
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        todo = list(own)
        while todo:
            for child in children.get(todo.pop(), ()):
                if child not in own:
                    own.add(child)
                    todo.append(child)
        return sorted(pid for pid in own if pid in table)

    def _signal(self, sig: int, pids: list[int]) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace_s: float = 15) -> None:
        """Graceful: SIGTERM, then after ``grace_s`` SIGKILL to what is left."""
        self._signal(signal.SIGTERM, self.pids())
        deadline = time.monotonic() + grace_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.5)
        self.kill()

    def kill(self, within_s: float = 15) -> None:
        """The machine is lost: SIGKILL to every process of the node (again to any it started meanwhile)."""
        deadline = time.monotonic() + within_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            self._signal(signal.SIGKILL, pids)
            time.sleep(0.2)
        assert not pids, f"node {self.name}: processes {pids} survived SIGKILL for {within_s}s"
        self.proc.wait(timeout=10)


def ray_cli(args: list[str], env: dict, timeout_s: float = 120) -> tuple[str, str]:
    """Run a ``ray`` CLI command; (stdout, stderr) -- the CLI writes its messages to stderr."""
    done = subprocess.run([*RAY, *args], env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(
            f"ray {' '.join(args[:3])} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
        )
    return done.stdout, done.stderr


def parse_job_status(job_id: str, answer: str) -> str:
    """PENDING/RUNNING/SUCCEEDED/FAILED/STOPPED from ``ray job status``'s answer (its status line, not the
    job's log tail that a failed job's "Status message" quotes)."""
    quoted = re.escape(job_id)
    if m := re.search(rf"Job '{quoted}' (succeeded|failed|was stopped)", answer):
        return {"succeeded": "SUCCEEDED", "failed": "FAILED", "was stopped": "STOPPED"}[m.group(1)]
    if m := re.search(rf"Status for job '{quoted}': (\w+)", answer):
        return m.group(1).rpartition(".")[2].upper()
    raise AssertionError(f"no status line for job {job_id} in `ray job status`'s answer:\n{answer[-3000:]}")


class LoopbackCluster:
    """A head and a second node on this machine, the jobs submitted to them, and their clean-up."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.short = Path(f"/tmp/rmn{os.getpid()}")  # Ray's socket paths must stay short
        env = cpu_env(tmp_path)
        for key in ("RAY_TMPDIR", "RAY_ADDRESS"):
            env.pop(key, None)
        env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
        self.env = env
        gcs_port, dash, client = self.head_ports = free_ports(3)
        self.gcs, self.dashboard = f"127.0.0.1:{gcs_port}", f"http://127.0.0.1:{dash}"
        self.head_args = [
            "--head",
            f"--port={gcs_port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            f"--ray-client-server-port={client}",
            "--include-dashboard=true",
        ]
        self.nodes: list[RayNode] = []
        self.jobs: list[str] = []
        self.followers: list[subprocess.Popen] = []

    def _node_args(self, i: int) -> list[str]:
        # free now, not when the cluster was made: a node restarted minutes later would find ports taken meanwhile
        # by the jobs' workers (its dashboard agent then fails to bind and the raylet exits with it); never the
        # head's, which its dashboard may not have bound yet (Ray refuses two components on one port)
        listen, grpc, runtime_env, metrics = free_ports(4, frozenset(self.head_ports))
        return [
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={NODE_CPUS}",
            "--num-gpus=1",
            f"--resources={json.dumps({f'memopd_node_{i}': 1})}",
            f"--dashboard-agent-listen-port={listen}",
            f"--dashboard-agent-grpc-port={grpc}",
            f"--runtime-env-agent-port={runtime_env}",
            f"--metrics-export-port={metrics}",
            "--disable-usage-stats",
        ]

    def start_head(self, wait: bool = True) -> None:
        self.nodes.append(
            RayNode(
                "head", [*self.head_args, *self._node_args(0)], self.short / "head", self.env, self.tmp / "ray_head.log"
            )
        )
        if wait:
            self.wait_nodes(1)

    def start_second(self) -> RayNode:
        """Start (or restart) the second node without waiting for it (see ``wait_nodes``)."""
        slot = len(self.nodes)
        node = RayNode(
            f"second{slot}",
            [f"--address={self.gcs}", *self._node_args(1)],
            self.short / f"second{slot}",
            self.env,
            self.tmp / f"ray_second{slot}.log",
        )
        self.nodes.append(node)
        return node

    def wait_nodes(self, n: int, exclude: frozenset[str] = frozenset(), timeout_s: float = 120) -> list[dict]:
        """The ALIVE nodes (``ray list nodes --detail``) once they are ``n``, one per marker ``memopd_node_<i>``
        (i < n), none of them in ``exclude`` (a killed node stays ALIVE until the head's health check notices).

        Raises at once when the newest node's ``ray start`` has exited, and after ``timeout_s`` otherwise,
        with the tail of that node's log either way."""
        deadline = time.monotonic() + timeout_s
        wanted = {f"memopd_node_{i}" for i in range(n)}
        while True:
            done = subprocess.run(
                [*RAY, "list", "nodes", "--address", self.dashboard, "--format", "json", "--detail"],
                env=self.env,
                capture_output=True,
                text=True,
            )
            try:  # prints "No resource in the cluster" instead of [] while the cluster is empty
                nodes = (
                    [x for x in json.loads(done.stdout) if x.get("state") == "ALIVE"] if done.returncode == 0 else []
                )
            except json.JSONDecodeError:
                nodes = []
            nodes = [x for x in nodes if x["node_id"] not in exclude]
            if len(nodes) == n and set(self.markers(nodes).values()) == wanted:
                return nodes
            newest = self.nodes[-1]
            exited = newest.proc.poll()
            if exited is not None or time.monotonic() > deadline:
                why = f"`ray start` of {newest.name} exited {exited}" if exited is not None else f"after {timeout_s}s"
                raise TimeoutError(
                    f"{len(nodes)} of {n} Ray nodes alive ({why}): {self.markers(nodes)} "
                    f"{done.stderr[-1000:]}\n{newest.name}'s log ({newest.log}):\n"
                    f"{tail(newest.log.read_text(errors='replace'), 40)}"
                )
            time.sleep(3)

    @staticmethod
    def markers(nodes: list[dict]) -> dict[str, str]:
        """node id -> its marker resource (``memopd_node_<i>``)."""
        return {n["node_id"]: next(k for k in n["resources_total"] if k.startswith("memopd_node_")) for n in nodes}

    def job_status(self, job_id: str) -> tuple[str, str]:
        """(status, the CLI's full answer)."""
        out, err = ray_cli(["job", "status", job_id, "--address", self.dashboard], self.env)
        return parse_job_status(job_id, out + err), out + err

    def follow(self, job_id: str, cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
        """Run ``cmd`` -- a script that runs ``ray job submit`` (without ``--no-wait``) for ``job_id`` and so
        follows the job's log until it ends -- writing its output to ``log``."""
        self.jobs.append(job_id)
        proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.followers.append(proc)
        return proc

    def driver_log(self, job_id: str) -> Path:
        """The job's driver log on the head node (what ``ray job logs`` serves, without the CLI's delay)."""
        return self.nodes[0].temp_dir / "session_latest" / "logs" / f"job-driver-{job_id}.log"

    @staticmethod
    def wait_until(
        condition: Callable[[], bool], timeout_s: float, follower: subprocess.Popen, poll_s: float = 0.25
    ) -> bool:
        """True as soon as ``condition()`` holds; False once ``follower`` (the job) has ended or ``timeout_s``
        passed without it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and follower.poll() is None:
            if condition():
                return True
            time.sleep(poll_s)
        return condition()

    def wait_job(
        self, job_id: str, timeout_s: float, follower: subprocess.Popen | None = None, ask_every_s: float = 60
    ) -> tuple[str, str]:
        """Wait until the job ends (its ``follower`` exits or the cluster says so) or ``timeout_s`` passes;
        then (status, CLI answer) from the cluster."""
        start = time.monotonic()
        asked = start
        while True:
            now = time.monotonic()
            if follower is not None and follower.poll() is not None:
                status, answer = self.job_status(job_id)
                if status in JOB_ENDED:
                    return status, answer
                follower = None  # the follower lost the log stream: fall back to asking
            if now - start > timeout_s:
                return self.job_status(job_id)
            if now - asked > ask_every_s:
                asked = now
                status, answer = self.job_status(job_id)
                if status in JOB_ENDED:
                    return status, answer
            time.sleep(1)

    def logs(self, job_id: str) -> str:
        logs = ray_cli(["job", "logs", job_id, "--address", self.dashboard], self.env)[0]
        (self.tmp / f"{job_id}.log").write_text(logs)
        return logs

    def tasks(self, job_id: str) -> list[dict]:
        """Ray's task records (name, node_id, ...) of the submission ``job_id``."""
        jobs = json.loads(ray_cli(["list", "jobs", "--address", self.dashboard, "--format", "json"], self.env)[0])
        ray_job = next(j["job_id"] for j in jobs if j.get("submission_id") == job_id)
        return json.loads(
            ray_cli(
                [
                    "list",
                    "tasks",
                    "--address",
                    self.dashboard,
                    "--detail",
                    "--format",
                    "json",
                    "--limit",
                    "10000",
                    "--filter",
                    f"job_id={ray_job}",
                ],
                self.env,
            )[0]
        )

    def actors(self) -> list[dict]:
        """Ray's actor records (class_name, node_id, ...), finished jobs' dead actors included."""
        return json.loads(
            ray_cli(
                ["list", "actors", "--address", self.dashboard, "--detail", "--format", "json", "--limit", "10000"],
                self.env,
            )[0]
        )

    def close(self) -> None:
        """Stop the jobs, the followers and both nodes (by process id); remove Ray's session dirs."""
        for job_id in self.jobs:
            subprocess.run(
                [*RAY, "job", "stop", job_id, "--address", self.dashboard, "--no-wait"],
                env=self.env,
                capture_output=True,
                timeout=60,
            )
        for proc in self.followers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        for node in reversed(self.nodes):
            if node.proc.poll() is None or node.pids():
                node.stop()
        shutil.rmtree(self.short, ignore_errors=True)  # job logs are in tmp_path


def tail(text: str, n: int = 60) -> str:
    return "\n".join(text.splitlines()[-n:])
